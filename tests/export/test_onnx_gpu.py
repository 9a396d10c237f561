"""onnxruntime on CUDA: float16 parity, the KV cache kept on the device by IO binding, bfloat16 verification.
Skipped where there is no GPU; failed where one is visible but a CUDA session does not run (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from common.parity_inputs import parity_batch
from export.exporter import export_model
from export.runtime import OnnxDecoder
from export.verify import compare_decoders

pytestmark = pytest.mark.gpu  # run, skipped (no GPU) or failed (a GPU CUDA cannot use): tests/conftest.py


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "gpt2"])
def test_cuda_float16_parity(family, thinker_folder, onnx_folder):
    """The float16 graph on CUDA against the PyTorch model in float32: top-1 agreement, logits close."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_folder(family)).eval()
    decoder = OnnxDecoder(onnx_folder(family, "float16"), provider="cuda")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)
    assert figures["top1_agreement"] >= 0.9, figures
    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures


def test_io_binding_keeps_the_cache_on_the_device(onnx_folder):
    cuda = OnnxDecoder(onnx_folder("qwen3"), provider="cuda")
    cpu = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    input_ids, attention_mask = parity_batch(96)
    _, cuda_state = cuda.prefill(input_ids, attention_mask)
    cpu_logits, cpu_state = cpu.prefill(input_ids, attention_mask)
    token = cpu_logits[:, -1].argmax(-1)
    for _ in range(3):
        assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in cuda_state.cache.values())
        cuda_logits, cpu_logits = cuda.decode_one_token(token, cuda_state), cpu.decode_one_token(token, cpu_state)
        np.testing.assert_allclose(cuda_logits, cpu_logits, atol=1e-2)  # CUDA may run float32 matmuls in TF32
        token = cpu_logits.argmax(-1)
    assert cuda_state.cache["past_key_values.0.key"].shape()[2] == input_ids.shape[1] + 3


def test_cuda_bfloat16_export_verifies(thinker_folder, tmp_path):
    report = export_model(thinker_folder("qwen3_moe"), tmp_path / "bf16", dtype="bfloat16", verify=True)
    assert report["verify"]["provider"] == "cuda"
    assert report["verify"]["passed"] is True, report["verify"]


def test_cuda_generate_runs_greedy(onnx_folder):
    prompt = np.array([[5, 9, 17, 33]], dtype=np.int64)
    cuda = OnnxDecoder(onnx_folder("qwen3", "float16"), provider="cuda").generate(prompt, max_new_tokens=8)
    cpu = OnnxDecoder(onnx_folder("qwen3", "float32"), provider="cpu").generate(prompt, max_new_tokens=8)
    assert cuda.shape == (1, 12)
    assert cuda[0, 4] == cpu[0, 4]  # the first new token; half precision may part ways later, on a near-tie
