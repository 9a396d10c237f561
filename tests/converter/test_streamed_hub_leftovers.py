"""Cases two mutation runs planned and left unrun (the streamed model's, converter/streamed.py, load.py,
thinker_common/fp8_source.py and parity_inputs.py; the Hub's, converter/hub.py): each test here fails with one of
their survivors planted.

- ``pick_conversion_files`` takes a safetensors index before a pytorch_model.bin beside it, as transformers loads
  them, and takes a named GGUF file at the top level only;
- ``config_for`` writes the dtype asked into the config, and reads a Thinker folder's own config;
- an FP8 config without ``weight_block_size`` means transformers' 128x128 blocks; a float tensor beside a scale is
  not dequantized; a scale grid that does not divide its weight (``weight_block_size`` null) is refused as such;
- the indexer prompts hold an eos, where Qwen3.8's n-gram contexts restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from converter.hub import pick_conversion_files
from converter.load import config_for, load_thinker
from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.fp8_source import DEFAULT_BLOCK, fp8_quantization
from thinker_common.parity_inputs import indexer_batch
from thinker_common.sources import open_source

# --- which files of a Hub repo a conversion reads (converter/hub.py) -----------------------------------------------


def test_a_safetensors_index_beside_pytorch_model_bin_is_taken_before_it():
    """transformers loads model.safetensors.index.json before pytorch_model.bin: so are the shards it names
    fetched, and not the pickle."""
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    listing = ["config.json", *shards, "model.safetensors.index.json", "pytorch_model.bin"]
    assert pick_conversion_files(listing, "acme/a@main") == ["config.json", *shards, "model.safetensors.index.json"]


def test_a_gguf_file_named_by_its_path_in_a_folder_is_not_taken_as_a_top_level_one():
    """``gguf_file`` names a file of the top level (``resolve_source`` moves a path's folder into ``subfolder``
    first): one held only in a folder is refused, naming the top level's GGUF files."""
    listing = ["README.md", "tiny-Q4_0.gguf", "Q8_0/tiny-Q8_0.gguf"]
    with pytest.raises(ThinkerError) as err:
        pick_conversion_files(listing, "acme/g@main", "Q8_0/tiny-Q8_0.gguf")
    assert str(err.value) == (
        "acme/g@main has no GGUF file 'Q8_0/tiny-Q8_0.gguf' at its top level; the GGUF files there: tiny-Q4_0.gguf"
    )
    assert pick_conversion_files(listing, "acme/g@main", "tiny-Q4_0.gguf") == ["README.md", "tiny-Q4_0.gguf"]


# --- config_for (converter/load.py) --------------------------------------------------------------------------------


def test_config_for_writes_the_dtype_asked(qwen3_source):
    assert config_for(qwen3_source).dtype == torch.float32
    assert config_for(qwen3_source, dtype="bfloat16").dtype == torch.bfloat16


def test_config_for_a_thinker_folder_is_its_own_config(qwen3_source, tmp_path):
    load_thinker(qwen3_source).save_pretrained(tmp_path / "thinker")
    config = config_for(tmp_path / "thinker")
    assert isinstance(config, ThinkerConfig)
    assert config.to_dict() == ThinkerConfig.from_pretrained(tmp_path / "thinker").to_dict()


def test_config_for_a_thinker_folder_takes_the_dtype_asked_as_load_thinker_does(qwen3_source, tmp_path):
    """A Thinker folder's config in the dtype asked for, the dtype ``load_thinker`` loads the same folder in; a dtype
    no folder may hold refused by name by both, as for a source to convert."""
    load_thinker(qwen3_source).save_pretrained(tmp_path / "thinker")
    assert config_for(tmp_path / "thinker").dtype == torch.float32
    asked = config_for(tmp_path / "thinker", dtype="bfloat16")
    assert asked.dtype == torch.bfloat16 == load_thinker(tmp_path / "thinker", dtype="bfloat16").dtype
    for refused in ("int8", "float64", torch.float64, None):  # as a source's conversion refuses them
        with pytest.raises(ThinkerError, match=r"--dtype .* is not one of auto, float32, bfloat16, float16"):
            config_for(tmp_path / "thinker", dtype=refused)
        with pytest.raises(ThinkerError, match=r"--dtype .* is not one of auto, float32, bfloat16, float16"):
            load_thinker(tmp_path / "thinker", dtype=refused)


# --- FP8 checkpoints (thinker_common/fp8_source.py) ----------------------------------------------------------------


def fp8_folder(folder: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> Path:
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    config = {"quantization_config": {"quant_method": "fp8", **quantization}, "dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def fp8_values(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    drawn = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 8
    return drawn.to(torch.float8_e4m3fn)


def test_a_config_naming_no_block_takes_transformers_default_of_128(tmp_path):
    """No ``weight_block_size`` key: FineGrainedFP8Config's default, 128x128 blocks, not a block from the grid.
    200 rows in blocks of 128 are 128 + 72 (a grid of 2), where a block from the grid would be 100 + 100."""
    assert fp8_quantization({"quantization_config": {"quant_method": "fp8"}}, tmp_path) == DEFAULT_BLOCK == (128, 128)
    values, scales = fp8_values(200, 64), torch.tensor([[0.5], [4.0]])
    folder = fp8_folder(tmp_path / "default", {"w.weight": values, "w.weight_scale_inv": scales}, {})
    source = open_source(folder)
    try:
        loaded = source.load("w.weight")
    finally:
        source.close()
    expected = values.float() * torch.cat([torch.full((128, 1), 0.5), torch.full((72, 1), 4.0)])
    assert torch.equal(loaded, expected)


def test_a_float_tensor_beside_a_scale_is_read_as_stored(tmp_path):
    """Only FP8 tensors are dequantized: a float one beside a ``_scale_inv`` (a layer left unquantized) is read as
    it is stored, in its own dtype, and the scale stays a tensor of its own."""
    kept = torch.randn(32, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tensors = {
        "q.weight": fp8_values(32, 32),
        "q.weight_scale_inv": torch.tensor([[2.0]]),
        "kept.weight": kept,
        "kept.weight_scale_inv": torch.tensor([[3.0]]),
    }
    source = open_source(fp8_folder(tmp_path / "mixed", tensors, {"weight_block_size": [32, 32]}))
    try:
        assert source.dtype("kept.weight") == torch.bfloat16
        assert torch.equal(source.load("kept.weight"), kept)
        assert "kept.weight_scale_inv" in source.names() and "q.weight_scale_inv" not in source.names()
    finally:
        source.close()


@pytest.mark.parametrize("rows", [80, 2], ids=["not-a-multiple", "fewer-rows-than-the-grid"])
def test_a_grid_that_does_not_divide_its_weight_is_refused_as_such(tmp_path, rows):
    """``weight_block_size: null``: each weight's block is its dimensions over its grid's; a grid of 3 rows does
    not divide 80 rows (nor 2), and is refused saying so, not with a block of 26 (or 0) rows derived from it."""
    tensors = {"w.weight": fp8_values(rows, 64), "w.weight_scale_inv": torch.ones(3, 2)}
    folder = fp8_folder(tmp_path / "grid", tensors, {"weight_block_size": None})
    source = open_source(folder)
    try:
        with pytest.raises(ThinkerError) as err:
            source.load("w.weight")
    finally:
        source.close()
    assert str(err.value) == (
        f"{folder / 'model.safetensors'}: 'w.weight_scale_inv' holds (3, 2) scales for 'w.weight' of shape "
        f"({rows}, 64), where the checkpoint's quantization_config asks for a grid that divides the weight (no "
        "weight_block_size); the scales and the config do not belong together: re-download the checkpoint"
    )


# --- the parity checks' prompts (thinker_common/parity_inputs.py) --------------------------------------------------


def test_the_indexer_prompts_each_hold_an_eos_a_third_of_the_way_in():
    config = SimpleNamespace(vocab_size=50, indexer_budget=8, indexer_compress_ratio=4, ngram_eos_token_id=49)
    ids, mask = indexer_batch(config)
    longest = 8 + 8 * 4
    assert ids.shape == mask.shape == (2, longest)
    lengths = mask.sum(-1).tolist()
    assert lengths == [longest, longest // 2]
    for row, length in zip(ids, lengths, strict=True):
        prompt = row[longest - length :].tolist()
        assert prompt[length // 3] == 49
