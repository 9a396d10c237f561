"""Source readers (thinker_common/sources.py, fp8_source.py) and parity inputs (parity_inputs.py) at edges no other
test held (a mutation run, helper-256): the foreign block's positions against Qwen's own get_rope_index, the prompt
batches' rows drawn apart, a split head's vocabulary edges, a scanned read in several pieces, unindexed shards beside
other weight files, training checkpoints, and a multimodal FP8 release's text_config.torch_dtype."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from thinker_common import sources
from thinker_common.parity_inputs import (
    DEEP_PROMPT_LENGTH,
    deep_prompt,
    fixed_prompts,
    foreign_block_prompt,
    image_block_positions,
    left_padded,
    long_prompts,
    vocabulary_edges,
)
from thinker_common.sources import open_source


def test_the_image_block_positions_are_qwens_own_for_an_image_there():
    """Each row's block numbered as Qwen3.5's ``get_rope_index`` numbers an image of (block / 2) x 2 merged patches in
    those slots: the three streams differ inside the block (height and width), and the text after it resumes past
    the block's largest position. Streams all equal (no image at all, to the graph) passed every other test."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    image = 60
    config = Qwen3_5Config(
        text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, layer_types=["full_attention"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32),
        image_token_id=image, vision_start_token_id=61, vision_end_token_id=62,
    )  # fmt: skip
    _, mask, _ = left_padded([[1] * 9, [1] * 4, [1] * 3, [1] * 2])
    mask = mask.numpy()
    positions, foreign = image_block_positions(mask)
    assert foreign.sum(axis=1).tolist() == [4, 2, 0, 0]
    ids = np.where(foreign, image, 5)
    grids = torch.tensor([[1, int(row.sum()), 4] for row in foreign if row.any()])  # patches before the 2 x 2 merge
    expected, _ = Qwen3_5Model(config).get_rope_index(
        torch.from_numpy(ids),
        mm_token_type_ids=torch.from_numpy(foreign.astype(np.int32)),
        image_grid_thw=grids,
        attention_mask=torch.from_numpy(mask),
    )
    kept = mask.astype(bool)
    np.testing.assert_array_equal(positions[:, kept], expected.numpy()[:, kept])
    assert (positions[:, ~kept] == 0).all()  # pads at position 0


def test_a_foreign_block_prompt_without_multimodal_rope_counts_positions_per_row():
    """Text positions for a model without multimodal RoPE: counted from each row's first kept slot, as the token
    prompts' are, pads at 0; the foreign rows cover kept slots only."""
    _, mask, expected = left_padded(fixed_prompts(64))
    tokens = np.ones((*mask.shape, 8), np.float32)
    embeds, positions, foreign = foreign_block_prompt(tokens, mask.numpy(), multimodal=False)
    np.testing.assert_array_equal(positions, expected.numpy())
    assert foreign.sum() > 0 and not foreign[~mask.numpy().astype(bool)].any()
    assert (embeds[foreign] != 1).all() and (embeds[~foreign] == 1).all()


def test_the_vocabulary_edges_take_each_side_of_a_heads_split():
    """Each side of a row where a mixed head turns from one precision to the other (export/quantize.py), besides the
    vocabulary's own edges and powers of two."""
    assert vocabulary_edges(300, {100, 200})[0].tolist() == [0, 1, 99, 100, 199, 200, 255, 256, 298, 299]


def test_the_rows_of_each_prompt_batch_are_drawn_apart():
    """Each batch's rows are draws of their own over the vocabulary, not one row and its own tail (which would give
    the shorter row the longer one's ids at the same slots) nor a corner of it."""
    for short, long in (fixed_prompts(1000)[::-1], long_prompts(1000, 1000)[::-1]):
        assert len(short) < len(long) and long[-len(short) :] != short
    ids = deep_prompt(1000)
    assert ids.shape == (1, DEEP_PROMPT_LENGTH) and len(set(ids[0].tolist())) == DEEP_PROMPT_LENGTH and ids.max() > 100


def test_a_multimodal_fp8_release_declaring_torch_dtype_in_its_text_config(tmp_path):
    """The older key, ``torch_dtype``, inside ``text_config``: the dequantized weight loads in that dtype."""
    folder = tmp_path / "fp8"
    folder.mkdir()
    weights = {"w.weight": torch.ones(32, 32).to(torch.float8_e4m3fn), "w.weight_scale_inv": torch.ones(1, 1)}
    save_file(weights, folder / "model.safetensors")
    quantization = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    config = {"quantization_config": quantization, "text_config": {"torch_dtype": "bfloat16"}}
    (folder / "config.json").write_text(json.dumps(config))
    source = open_source(folder)
    try:
        assert source.dtype("w.weight") == torch.bfloat16
    finally:
        source.close()


def test_unindexed_shards_are_read_without_the_other_weight_files_beside_them(tmp_path):
    """Numbered shards without their index (converted with --no-verify) beside files transformers never reads as
    weights (Mistral's consolidated copy, a Trainer's training_args.bin): the shards alone are the checkpoint, the
    stale copy neither read nor refused as a clash."""
    folder = tmp_path / "shards"
    folder.mkdir()
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 3)}
    save_file({"a": tensors["a"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"]}, folder / "model-00002-of-00002.safetensors")
    save_file({name: tensor + 1 for name, tensor in tensors.items()}, folder / "consolidated.safetensors")
    source = open_source(folder)
    try:
        assert sorted(source.names()) == ["a", "b"]
        assert all(torch.equal(source.load(name), tensor) for name, tensor in tensors.items())
    finally:
        source.close()
    bins = tmp_path / "bins"
    bins.mkdir()
    torch.save({"a": tensors["a"]}, bins / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": tensors["b"]}, bins / "pytorch_model-00002-of-00002.bin")
    (bins / "training_args.bin").write_bytes(b"a pickled TrainingArguments, no tensors")
    source = open_source(bins)
    try:
        assert sorted(source.names()) == ["a", "b"]
    finally:
        source.close()


def test_a_scanned_read_in_several_pieces_reads_each_piece_from_its_own_offset(tmp_path, monkeypatch):
    """``load(scan=...)`` reads a tensor larger than a scan piece in pieces: each piece from where the last ended
    (the real pieces are 4 MiB, which no fixture's tensor reaches, so they are made small here)."""
    from thinker_common.values import ValueScan

    monkeypatch.setattr(sources, "_SCAN_CHUNK", 36)  # not a multiple of the 8-byte elements: partial ones wait
    values = torch.arange(37, dtype=torch.float64) * 1.5
    save_file({"pad": torch.ones(3), "w": values}, tmp_path / "model.safetensors")
    source = open_source(tmp_path)
    try:
        scan = ValueScan()
        assert torch.equal(source.load("w", scan=scan), values)
        assert (scan.low, scan.high) == (0.0, 54.0)
    finally:
        source.close()


@pytest.mark.parametrize("key", ["model", "state_dict", "model_state_dict", "module"])
def test_a_training_checkpoint_is_read_as_the_state_dict_it_holds(key, tmp_path):
    """A training script's save, {key: state_dict, "optimizer": ..., "epoch": ...}: its one dict of tensors is the
    model (not a checkpoint of no tensors, every one then reported missing)."""
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 3)}
    torch.save({key: tensors, "optimizer": {"lr": 0.1}, "epoch": 3}, tmp_path / "pytorch_model.bin")
    source = open_source(tmp_path)
    try:
        assert sorted(source.names()) == ["a", "b"]
        assert all(torch.equal(source.load(name), tensor) for name, tensor in tensors.items())
    finally:
        source.close()
