"""One counting rule for parameters (issue 15): every weight of the model once, a tied head not again. The same
SmolLM2 used to be reported as 134,515,008 parameters by one export and 162,826,560 (its 28,311,552 tied
embeddings twice) by another: the plain graph stores the head's transposed copy, the quantized one a packed copy.
Every graph of a model reports what PyTorch counts (``model.parameters()`` holds a tied weight once), and so does
the converter's index."""

from __future__ import annotations

import json

import pytest

from export.exporter import export_model
from export.quantize import QuantizeSpec


def torch_count(folder) -> int:
    from thinker import ThinkerForCausalLM

    return sum(p.numel() for p in ThinkerForCausalLM.from_pretrained(folder).parameters())


@pytest.mark.parametrize("family", ["gpt2", "qwen3"], ids=["tied head", "untied head"])
def test_every_export_counts_the_model_once(family, thinker_variant, tmp_path):
    folder = thinker_variant(family, head_dim=16)
    expected = torch_count(folder)
    counts = {}
    for graph, quantize in (("plain", None), ("fused", None), ("plain", QuantizeSpec(bits=8, block_size=16))):
        output = tmp_path / f"{graph}-{quantize is not None}"
        counts[graph, quantize is not None] = export_model(
            folder, output, graph=graph, quantize=quantize, verify=False
        )["parameters"]
        assert json.loads((output / "export_report.json").read_text())["parameters"] == expected
    assert set(counts.values()) == {expected}, counts


@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("bfloat16", 2)])
def test_the_converter_counts_the_same(dtype, itemsize, qwen3_source, tmp_path):
    """The index counts parameters, not bytes over four: a bfloat16 folder holds as many in half the bytes."""
    from converter.convert import convert

    options = {"verify": False, "progress": False, "max_shard_size": "20KB", "dtype": dtype}
    result = convert(qwen3_source, tmp_path / "out", **options)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == torch_count(tmp_path / "out")
    assert result.total_bytes == itemsize * torch_count(tmp_path / "out")
