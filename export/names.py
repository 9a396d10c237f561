"""Plain data the exporter, the runtime and the command line share, importable without onnx or torch (so that
``thinker export --help`` answers at once): the ONNX folder's file names and the choices of ``thinker export``."""

from __future__ import annotations

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
REPORT_FILE = "export_report.json"
GENAI_CONFIG_FILE = "genai_config.json"

# --graph: "plain", standard ONNX operators only; "fused", onnxruntime's contrib operators (export/fused_graph.py).
GRAPHS = {"plain": "export.decoder_graph:DecoderGraph", "fused": "export.fused_graph:FusedDecoderGraph"}


def default_graph(hybrid: bool) -> str:
    """The graph ``thinker export`` writes when ``--graph`` is not given: fused for hybrid models (linear-attention
    layers), whose plain recurrence is a ``Scan`` over tokens and whose plain graph measured slower at prefill and
    decode (docs/hybrid-export.md, section 6); plain, which any runtime runs, for the others."""
    return "fused" if hybrid else "plain"


# --quantize and its options (export/quantize.py).
BITS = {"int4": 4, "int8": 8}
ALGORITHMS = ("rtn", "rtn-asym", "hqq")
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 1, 4)
# --accuracy-guard (export/accuracy_guard.py): the least teacher-forced top-1 agreement of an accuracy-level-4 graph
# with the same weights at level 1, below which layers fall back to level 1.
DEFAULT_MIN_AGREEMENT = 0.9
