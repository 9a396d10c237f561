"""The converter's checks on a folder, by the message the user reads (a mutation run's survivors): the weights held
against config.json (``converter/folder_weights.py``), ``thinker verify``'s exact check and config comparison
(``converter/weights_check.py``, ``converter/config_compare.py``), the dtype ``auto`` writes
(``converter/output_dtype.py``), a config.json that is no object (``thinker_common/folder_source.py``), what
``from_pretrained`` takes for a foreign checkpoint (``thinker/foreign.py``), a full disk's advice
(``thinker_common/staging.py``) and two split GGUFs side by side (``thinker_common/gguf_split.py``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import assert_error, assert_nothing_written, edit_config, edit_tensors, thinker
from safetensors import safe_open

from thinker_common.errors import ThinkerError

DOWN = "model.layers.1.mlp.down_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"
SPLIT_SETS = [f"{stem}-0000{n}-of-00002.gguf" for stem in ("a", "b") for n in (1, 2)]


# --- converter/folder_weights.py -------------------------------------------------------------------------------------


def test_a_wrong_size_counts_the_other_tensors_it_gives_a_wrong_shape(qwen3_thinker, tmp_path):
    """intermediate_size moves the gate, up and down projections of both layers: the first is named, the five others
    counted, not six."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, intermediate_size=40)
    output = tmp_path / "onnx"
    expected = (
        f"{folder}/config.json: intermediate_size=40 gives {GATE} the shape (40, 32), but the folder holds (48, 32) "
        "(and 5 more tensor(s)); config.json does not describe these weights: correct it"
    )
    assert_error(thinker("export", folder, output, "--no-verify"), expected)
    assert_nothing_written(output)


def test_a_tensor_missing_from_a_thinker_folder_is_named(qwen3_thinker, tmp_path):
    """A tensor deleted from the folder is named as lacking, in one line, not a KeyError from the shape check."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.pop(DOWN))
    output = tmp_path / "onnx"
    expected = (
        f"{folder}: the weights do not fit config.json: the folder lacks {DOWN} (1 in all), which the model of its "
        "config.json has (check num_hidden_layers, layer_types, tie_word_embeddings and the MoE fields)"
    )
    assert_error(thinker("export", folder, output, "--no-verify"), expected)
    assert_nothing_written(output)


# --- converter/weights_check.py, converter/config_compare.py ---------------------------------------------------------


def test_verify_names_a_tensor_stored_in_another_dtype(qwen3_source, qwen3_thinker, tmp_path):
    """One float32 tensor of the folder rounded to bfloat16 (the rest, and config.json's dtype, float32): its bytes
    cast back compare equal, so only its stored dtype tells that the folder was changed; ``thinker verify`` names
    it."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({DOWN: tensors[DOWN].to(torch.bfloat16)}))
    message = assert_error(thinker("verify", qwen3_source, folder))
    assert (
        f"tensor {DOWN!r} is stored as bfloat16, where converting {qwen3_source} writes float32; the folder was "
        "changed after its conversion: convert it again"
    ) in message, message


def test_verify_leaves_the_runtime_switches_out_of_the_config_comparison(qwen3_source, qwen3_thinker, tmp_path):
    """use_cache and output_router_logits switch how the model runs, not which model it is: a config.json with them
    set otherwise is still the one its source translates to."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, use_cache=False, output_router_logits=True)
    result = thinker("verify", qwen3_source, folder)
    assert result.exit_code == 0, result.output
    assert json.loads((folder / "parity.json").read_text())["passed"] is True


# --- converter/output_dtype.py ---------------------------------------------------------------------------------------


def test_auto_writes_the_dtype_the_source_config_declares(source_copy, tmp_path):
    """A source whose config.json declares bfloat16 over float32 weights (as DeepSpeed saves them): ``auto``'s folder
    declares bfloat16 too, as transformers' ``dtype="auto"`` loads the source, not the float32 most bytes are stored
    in; every tensor, which bfloat16 would round, is kept float32 (``kept_wider``)."""
    source = source_copy()
    edit_config(source, dtype="bfloat16")
    output = tmp_path / "out"
    result = thinker("convert", source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(output / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"F32"}


# --- thinker_common/folder_source.py ---------------------------------------------------------------------------------


def test_a_config_json_that_is_no_object_is_named(source_copy, tmp_path):
    source = source_copy()
    (source / "config.json").write_text("[1, 2]")
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify"), f"{source}/config.json: expected a JSON object")
    assert_nothing_written(output)


# --- thinker/foreign.py ----------------------------------------------------------------------------------------------


def test_what_is_a_foreign_checkpoint(qwen3_source, qwen3_thinker, tmp_path):
    """A weights file (no config beside it to read) and a folder without config.json (a training script's
    checkpoint) go to the converter's loader; a Thinker folder to transformers' own loading."""
    from thinker.foreign import is_foreign_checkpoint

    assert is_foreign_checkpoint(qwen3_source / "model.safetensors")
    (tmp_path / "scratch").mkdir()
    torch.save({}, tmp_path / "scratch" / "model.pth")
    assert is_foreign_checkpoint(tmp_path / "scratch")
    assert is_foreign_checkpoint(qwen3_source)
    assert not is_foreign_checkpoint(qwen3_thinker)


# --- thinker_common/staging.py ---------------------------------------------------------------------------------------


def test_a_full_disk_says_to_free_space_or_move_output(qwen3_source, tmp_path, monkeypatch):
    monkeypatch.setattr("thinker_common.staging.free_bytes", lambda folder: 1000)
    output = tmp_path / "out"
    message = assert_error(thinker("convert", qwen3_source, output, "--no-verify"), f"the disk is full at {tmp_path}")
    assert message.endswith("free some space or put OUTPUT on another disk (nothing was written)"), message
    assert_nothing_written(output)


# --- thinker_common/gguf_split.py ------------------------------------------------------------------------------------


def test_a_folder_of_two_split_ggufs_lists_both(tmp_path):
    """Two split GGUFs side by side (two quantisations, say) are no one split GGUF: the folder's files are listed,
    not one set's merge advised as if the other were not there."""
    from thinker_common.sources import open_source

    folder = tmp_path / "gguf"
    folder.mkdir()
    for name in SPLIT_SETS:
        (folder / name).write_bytes(b"GGUF")
    with pytest.raises(ThinkerError) as raised:
        open_source(folder)
    assert str(raised.value) == (
        f"{folder}: holds several .gguf files ({', '.join(SPLIT_SETS)}); pass the one to convert as SOURCE, or name "
        "it with --gguf-file"
    )


def test_a_shard_named_in_a_repo_of_two_split_ggufs_is_told_to_merge_its_own_set():
    from converter.hub import pick_conversion_files

    with pytest.raises(ThinkerError) as raised:
        pick_conversion_files(SPLIT_SETS, "acme/tiny@main", "a-00001-of-00002.gguf")
    message = str(raised.value)
    assert "None" not in message, message
    assert "llama-gguf-split --merge a-00001-of-00002.gguf merged.gguf" in message, message
    assert message.startswith("acme/tiny@main holds a GGUF split into 2 files; merge"), message  # its set: none missing
    with pytest.raises(ThinkerError) as raised:  # a shard the repo does not hold: named so, not merged
        pick_conversion_files(SPLIT_SETS, "acme/tiny@main", "c-00001-of-00002.gguf")
    assert str(raised.value).startswith("acme/tiny@main has no GGUF file 'c-00001-of-00002.gguf'"), raised.value


@pytest.mark.parametrize(
    ("gguf_file", "subfolder"),
    [("Q8/m-00002-of-00002.gguf", None), ("m-00001-of-00002.gguf", "Q8"), (None, "Q8")],
)
def test_a_shard_in_a_quantisations_folder_is_merged_by_its_path_in_the_repo(fake_hub, gguf_file, subfolder):
    """Two quantisations' split GGUFs of the same name, each in its folder: the advice names the folder of the one
    asked for (``--gguf-file Q8/...``, or ``--subfolder Q8`` with or without the shard named), before any download."""
    from converter.hub import resolve_source

    shards = [f"{folder}/m-0000{n}-of-00002.gguf" for folder in ("Q4", "Q8") for n in (1, 2)]
    fake_hub.add_repo("acme/tiny", {name: b"GGUF" for name in ["README.md", *shards]})
    with pytest.raises(ThinkerError) as raised:
        resolve_source("acme/tiny", gguf_file=gguf_file, subfolder=subfolder, progress=False)
    assert "llama-gguf-split --merge Q8/m-00001-of-00002.gguf merged.gguf" in str(raised.value), raised.value
    assert not fake_hub.file_requests()


# --- converter/special_tokens.py -------------------------------------------------------------------------------------

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=128)


def test_an_id_the_reference_leaves_unset_is_not_compared(save_reference, run_convert):
    """The reference names no pad id: a converted model naming one stops no generation the reference would, so the
    gate does not hold it against the conversion."""
    from transformers import Qwen2Config

    from converter.parity import check_parity
    from converter.parity_report import WHOLE_MODEL

    _, source = save_reference(Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, pad_token_id=None))
    converted = run_convert(source, verify=False).output
    edit_config(converted, pad_token_id=7)
    report = check_parity(source, converted, mode=WHOLE_MODEL)
    assert report.special_tokens == [] and report.passed, report.table()


def test_a_gguf_file_without_token_ids_is_not_held_to_the_class_defaults(tmp_path, run_convert):
    """A llama GGUF file with no ``tokenizer.ggml`` ids: transformers' LlamaConfig gives the reference bos 1 and eos 2,
    which the file never named, so the converted model's none is no failure of the gate."""
    from convert_helpers import build_reference, write_gguf
    from transformers import LlamaConfig

    from converter.special_tokens import source_named_ids

    model = build_reference(LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2))
    (tmp_path / "gguf").mkdir()
    path = write_gguf(model, tmp_path / "gguf" / "tiny.gguf", "llama")
    assert source_named_ids(path) == set()
    written = json.loads((run_convert(path).output / "config.json").read_text())
    assert written.get("bos_token_id") is None and written.get("eos_token_id") is None


# --- thinker_common/eager.py -----------------------------------------------------------------------------------------


def test_an_expert_width_torchs_grouped_kernel_refuses_converts_and_verifies(save_reference, run_convert):
    """Expert rows of 12 bfloat16 values (24 bytes) are no multiple of 16 bytes, which torch's CPU grouped_mm
    refuses ("strides should be multiple of 16 bytes"): the gate runs the reference's experts eagerly, so a sound
    model passes (a mutation run: without the eager experts the reference itself failed)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=12, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    _, source = save_reference(config, dtype=torch.bfloat16)
    result = run_convert(source, dtype="bfloat16")
    assert result.parity is not None and result.parity.passed, result.parity
