"""A mutation run's survivors in the dtype a conversion writes (``converter/output_dtype.py``), ``thinker verify``'s
exact check (``converter/weights_check.py``) and the presets (``thinker/presets.py``): each test pins what the user
gets (the folder's dtype, the tensors kept wider, the row a changed weight is named by, a preset refused or taken)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import edit_tensors
from convert_helpers import build_reference
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig

from converter.convert import convert
from converter.output_dtype import kept_wider, resolve_dtype
from converter.parity_report import IDENTICAL
from thinker import presets
from thinker.presets import load_preset
from thinker_common.sources import SafetensorsSource, open_source

DOWN = "model.layers.1.mlp.down_proj.weight"  # (32, 48): rows of 48 float32 values
NORM = "model.layers.0.input_layernorm.weight"  # (32,)


def tensor_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> SafetensorsSource:
    """A folder of one model.safetensors holding ``tensors``, opened as a source."""
    folder.mkdir(parents=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, folder / "model.safetensors")
    return SafetensorsSource(folder)


# --- converter/output_dtype.py: resolve_dtype ------------------------------------------------------------------------


def test_auto_without_a_declared_dtype_takes_the_dtype_of_most_bytes(tmp_path):
    """No dtype in the config (a GGUF, a bare state dict): the floating dtype holding most bytes, counted in bytes
    not elements (1500 bfloat16 values are 3000 bytes, fewer than 1000 float32 values' 4000), integer buffers left
    out however large, and float32 where nothing is floating."""
    source = tensor_folder(
        tmp_path / "mixed",
        {
            "big.weight": torch.zeros(1500, dtype=torch.bfloat16),
            "wide.weight": torch.zeros(1000, dtype=torch.float32),
            "ids": torch.zeros(100_000, dtype=torch.int64),
        },
    )
    try:
        assert resolve_dtype("auto", None, source) == torch.float32
    finally:
        source.close()
    source = tensor_folder(
        tmp_path / "mostly_half",
        {"big.weight": torch.zeros(64, 64, dtype=torch.bfloat16), "norm.weight": torch.zeros(64)},
    )
    try:
        assert resolve_dtype("auto", None, source) == torch.bfloat16  # the norm's float32 is the fewer bytes
    finally:
        source.close()
    source = tensor_folder(tmp_path / "integers", {"ids": torch.zeros(8, dtype=torch.int64)})
    try:
        assert resolve_dtype("auto", None, source) == torch.float32
    finally:
        source.close()


def test_auto_takes_a_declared_dtype_given_as_a_torch_dtype(tmp_path):
    """A config object's dtype is a ``torch.dtype`` (transformers' ``config.dtype``), not only a name: it is taken
    as declared, over the float32 the bytes are stored in."""
    source = tensor_folder(tmp_path / "source", {"w.weight": torch.zeros(8, 8)})
    try:
        assert resolve_dtype("auto", torch.bfloat16, source) == torch.bfloat16
        assert resolve_dtype("auto", "float16", source) == torch.float16
        assert resolve_dtype(torch.float16, "bfloat16", source) == torch.float16  # asked for: taken as asked
    finally:
        source.close()


# --- converter/output_dtype.py: kept_wider ---------------------------------------------------------------------------


def test_kept_wider_keeps_float16_in_a_bfloat16_folder_as_float16(tmp_path):
    """bfloat16 rounds float16's fine steps: a float16 tensor of a bfloat16 folder is kept as float16 (the dtype
    that holds it, not float32); a step joining a bfloat16 and a float32 tensor is kept float32 as a whole; one
    joining float16 and bfloat16 (neither holds the other) float32; the rest, which bfloat16 holds, not at all."""
    source = tensor_folder(
        tmp_path / "source",
        {
            "half": torch.zeros(4, dtype=torch.float16),
            "brain": torch.zeros(4, dtype=torch.bfloat16),
            "wide": torch.zeros(4, dtype=torch.float32),
            "ids": torch.zeros(4, dtype=torch.int64),
        },
    )
    steps = [
        SimpleNamespace(sources=["half"], targets=["t.half"]),
        SimpleNamespace(sources=["brain", "wide"], targets=["t.joined", "t.joined_too"]),
        SimpleNamespace(sources=["half", "brain"], targets=["t.neither"]),
        SimpleNamespace(sources=["brain", "ids"], targets=["t.held"]),
    ]
    try:
        assert kept_wider("auto", torch.bfloat16, steps, source) == {
            "t.half": torch.float16,
            "t.joined": torch.float32,
            "t.joined_too": torch.float32,
            "t.neither": torch.float32,
        }
        assert kept_wider("bfloat16", torch.bfloat16, steps, source) == {}  # a dtype asked for casts all
    finally:
        source.close()


def bfloat16_copy(source: Path, folder: Path) -> Path:
    """A copy of ``source`` whose config.json declares bfloat16 (its tensors as they were: the caller casts them)."""
    folder = shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return folder


def test_auto_keeps_a_float16_tensor_of_a_bfloat16_source_as_float16(qwen3_source, tmp_path):
    """End to end: a source declaring bfloat16 with one norm stored in float16 converts to a bfloat16 folder holding
    that norm in float16, bit for bit (not rounded to bfloat16, not widened to float32)."""
    source = bfloat16_copy(qwen3_source, tmp_path / "source")
    edit_tensors(
        source,
        lambda tensors: tensors.update(
            {name: tensor.to(torch.float16 if name == NORM else torch.bfloat16) for name, tensor in tensors.items()}
        ),
    )
    result = convert(source, tmp_path / "out", verify=False, progress=False)
    assert result.dtype == "bfloat16" and result.kept == {NORM: "float16"}
    written = SafetensorsSource(tmp_path / "out")
    stored = SafetensorsSource(source)
    try:
        assert written.dtype(NORM) == torch.float16
        assert torch.equal(written.load(NORM), stored.load(NORM))
        assert {written.dtype(name) for name in written.names() if name != NORM} == {torch.bfloat16}
    finally:
        written.close()
        stored.close()


# --- converter/weights_check.py --------------------------------------------------------------------------------------


def _verdict(source: Path, converted: Path, dtype: torch.dtype = torch.float32) -> str:
    from converter.weights_check import weights_verdict

    tensors = open_source(source)
    try:
        return weights_verdict(tensors, converted, dtype, "SOURCE")
    finally:
        tensors.close()


def _one_step_up(tensors: dict[str, torch.Tensor], name: str, index: tuple[int, ...]) -> None:
    tensors[name][index] = torch.nextafter(tensors[name][index], torch.tensor(float("inf")))


def test_verify_names_the_row_of_a_change_beyond_the_first_buffer(qwen3_source, qwen3_thinker, tmp_path, monkeypatch):
    """The bytes are compared a buffer at a time: a change in a later buffer is named by its row in the whole
    tensor, not by its row within that buffer (a 64-byte buffer here; tensors of real size span many 4 MiB ones)."""
    monkeypatch.setattr("converter.weights_check.COPY_PIECE", 64)
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: _one_step_up(tensors, DOWN, (20, 7)))
    verdict = _verdict(qwen3_source, folder)
    assert f"tensor {DOWN!r} is not what converting SOURCE writes (row 20 of (32, 48) differs first)" in verdict


def test_verify_names_the_element_of_a_changed_vector(qwen3_source, qwen3_thinker, tmp_path):
    """A vector's rows are its elements: the 6th value of a norm changed is row 5, not byte 20."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: _one_step_up(tensors, NORM, (5,)))
    assert f"tensor {NORM!r} is not what converting SOURCE writes (row 5 of (32,) differs first)" in _verdict(
        qwen3_source, folder
    )
    assert _verdict(qwen3_source, qwen3_thinker) == IDENTICAL


def test_verify_names_the_expert_of_a_changed_fused_expert_weight(tmp_path):
    """A 3-D tensor's rows are its first axis: a change in expert 2 of the fused expert weights is row 2."""
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
    )  # fmt: skip
    source = tmp_path / "source"
    build_reference(config).save_pretrained(source)
    converted = tmp_path / "converted"
    convert(source, converted, verify=False, progress=False)
    name = "model.layers.0.mlp.experts.down_proj"
    assert _verdict(source, converted) == IDENTICAL
    edit_tensors(converted, lambda tensors: _one_step_up(tensors, name, (2, 5, 3)))
    assert f"tensor {name!r} is not what converting SOURCE writes (row 2 of (4, 32, 12) differs first)" in _verdict(
        source, converted
    )


def test_verify_takes_a_folder_cast_to_the_dtype_auto_keeps_some_tensors_wider_than(qwen3_source, tmp_path):
    """A bfloat16 source with its norms stored in float32: ``auto`` keeps the norms float32, ``--dtype bfloat16``
    casts them too. The folder of the latter is what converting the source writes, so the exact check passes it."""
    source = bfloat16_copy(qwen3_source, tmp_path / "source")
    edit_tensors(
        source,
        lambda tensors: tensors.update(
            {name: tensor.to(torch.bfloat16) for name, tensor in tensors.items() if "norm" not in name}
        ),
    )
    convert(source, tmp_path / "out", dtype="bfloat16", verify=False, progress=False)
    assert _verdict(source, tmp_path / "out", torch.bfloat16) == IDENTICAL


def test_verify_names_a_tensor_shorter_than_the_conversion_writes(qwen3_source, qwen3_thinker, tmp_path):
    """A tensor cut short (the CLI's shape check refuses such a folder earlier; the verdict itself names it too,
    rather than raising StopIteration from comparing the bytes it has)."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({DOWN: tensors[DOWN][:-1].clone()}))
    assert f"tensor {DOWN!r} is shorter than converting SOURCE writes" in _verdict(qwen3_source, folder)


# --- thinker/presets.py ----------------------------------------------------------------------------------------------


def test_a_preset_of_another_model_type_is_refused(tmp_path, monkeypatch):
    (tmp_path / "qwen3-like.json").write_text(json.dumps({"model_type": "qwen3", "_source": "test"}))
    monkeypatch.setattr(presets, "_preset_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match=r"^preset 'qwen3-like' has model_type 'qwen3', not 'thinker'$"):
        load_preset("qwen3-like")


def test_a_deeper_copy_with_its_own_layer_types_is_taken():
    """More layers than the preset lists are refused only where the per-layer list is the preset's: given in full,
    the deeper copy loads with the list given."""
    given = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8
    config = load_preset("qwen3.5-0.8b", num_hidden_layers=32, layer_types=given)
    assert config.num_hidden_layers == 32 and config.layer_types == given
