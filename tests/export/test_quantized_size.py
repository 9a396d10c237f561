"""export/quantized_size.py: the size a quantized graph will have, known before it is written, so that --verify's
memory plan refuses a budget too small before the quantization, naming the budget that is enough."""

from __future__ import annotations

import re
from pkgutil import resolve_name

import onnx
import pytest
import torch

from export.exporter import export_model
from export.names import GRAPHS
from export.quantize import QuantizeSpec
from export.quantized_size import expected_graph_bytes
from thinker.configuration_thinker import ThinkerConfig

# Each layout the quantizer writes: symmetric int4 with the mixed head, int8, HQQ's float zero points, asymmetric
# int4's packed ones, an int4 head; the families each way the graphs lay weights out (fused QKV, linear attention,
# QMoE and the plain graph's int8-held experts, experts left float, a tied head gathered as the embedding, a float16
# graph's float32 vectors and conv taps, multimodal RoPE's stream selector, hyper-connections and PLE). A QA sweep
# of 612 such combinations found none below; above by up to 10 % only on a tiny float16 GPT-2, whose many bias
# vectors, counted at float32 to stay a bound, are written at float16.
CASES = [
    ("qwen3", "fused", "float32", QuantizeSpec(block_size=16, head_int8_rows=40)),
    ("qwen3", "plain", "float16", QuantizeSpec(bits=8, block_size=16)),
    ("gpt2", "fused", "float32", QuantizeSpec(block_size=16, algo="hqq")),
    ("qwen2_moe", "fused", "float32", QuantizeSpec(block_size=16, algo="rtn-asym")),
    ("qwen3_5_moe", "fused", "float16", QuantizeSpec(block_size=16, head_bits=4)),
    ("qwen3_5_moe", "plain", "float32", QuantizeSpec(block_size=16)),
    # the experts' down stack (16 inputs) narrower than a block: the layer's experts all stay float
    ("qwen3_moe", "fused", "float32", QuantizeSpec(block_size=32)),
    # the conv kernels' taps kept in float32 in a half graph
    ("qwen3_5", "plain", "float16", QuantizeSpec(block_size=16)),
    ("qwen3_next", "fused", "float32", QuantizeSpec(bits=8, block_size=16)),
    ("qwen4_exp", "fused", "float32", QuantizeSpec(block_size=16)),
]


def written_bytes(onnx_path) -> int:
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return sum(int(entry.value) for t in graph.initializer for entry in t.external_data if entry.key == "length")


@pytest.mark.parametrize(
    ("family", "graph", "dtype", "spec"), CASES, ids=[f"{f}-{g}-{d}-{s.label()}" for f, g, d, s in CASES]
)
def test_the_expected_size_bounds_the_graph_written(family, graph, dtype, spec, thinker_folder, tmp_path):
    """At or above the weights file's tensor bytes (so a budget that fits the estimate fits the graph), within 5 %
    of them (so it refuses nothing that fits by much). The accuracy guard is off: its float fallbacks are measured
    after the graph is written."""
    folder = thinker_folder(family)
    config = ThinkerConfig.from_pretrained(folder)
    spec = spec.for_vocab(config.vocab_size)
    output = tmp_path / "onnx"
    export_model(folder, output, dtype, verify=False, graph=graph, quantize=spec, progress=False, accuracy_guard=0)
    written = written_bytes(output / "model.onnx")
    standard_experts = resolve_name(GRAPHS[graph]).standard_experts(config)
    expected = expected_graph_bytes(folder, config, getattr(torch, dtype), spec, standard_experts)
    assert written <= expected <= 1.05 * written, (written, expected)


def test_a_budget_refused_before_the_quantization_is_enough_once_granted(thinker_folder, tmp_path, monkeypatch):
    """The size a refusal names, given as THINKER_VERIFY_MEMORY, passes the check the exporter makes once the graph
    is written (before, the first refusal left the graph out and the next named more). The refusal comes before
    anything is written."""
    from click.testing import CliRunner

    from converter.parity import MEMORY_BUDGET_ENV
    from thinker_common.cli import main

    folder = thinker_folder("qwen3_5")
    options = ["--quantize", "int4", "--block-size", "16", "--min-top1", "0", "--max-perplexity-increase", "1000"]
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "1KB")
    refused = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "refused"), *options])
    assert refused.exit_code == 1 and not (tmp_path / "refused").exists(), refused.output
    named = re.search(r"layer, float and dequantized, ([\d.]+ \w+) with the graph", refused.output)
    assert named, refused.output

    monkeypatch.setenv(MEMORY_BUDGET_ENV, named.group(1).replace(" ", ""))
    granted = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "granted"), *options])
    assert granted.exit_code == 0, granted.output
