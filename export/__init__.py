"""thinker export: a Thinker folder to an ONNX decoder with its KV cache, for onnxruntime and onnxruntime-genai."""
