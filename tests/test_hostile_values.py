"""Hostile values (issues 15 and 16): files and configs that parse but hold what no model can be, and the unclear
messages they used to get. Each ends in one ``error:`` line naming the file, tensor or key, exit 1, no traceback
and no library warning before it, nothing at OUTPUT, in bounded time and memory.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from cli_helpers import (
    as_shard,
    assert_error,
    assert_nothing_written,
    assert_process_error,
    edit_config,
    edit_tensors,
    run_cli,
    thinker,
)
from safetensors.torch import load_file

EMBED = "model.embed_tokens.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"

# --- shard indexes (issue 15, 16) ----------------------------------------------------------------------------------


def write_index(folder: Path, weight_map: object) -> None:
    """An index beside the weights, moved to a shard (beside a whole model.safetensors it would go unread)."""
    as_shard(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "values",
    [lambda names: 3, lambda names: ["model.safetensors"], lambda names: "mixed"],
    ids=["numbers", "lists", "mixed"],
)
def test_an_index_whose_weight_map_is_not_names(values, source_copy, tmp_path):
    source = source_copy()
    names = list(load_file(source / "model.safetensors"))  # write_index moves them to a shard
    if values(names) == "mixed":
        weight_map = {name: ("model.safetensors" if i % 2 else [1, 2]) for i, name in enumerate(names)}
    else:
        weight_map = {name: values(names) for name in names}
    write_index(source, weight_map)
    output = tmp_path / "out"
    result = thinker("convert", source, output, "--no-verify")
    assert_error(result, "model.safetensors.index.json", "'weight_map' maps", "not to a shard file name")
    assert_nothing_written(output)


def test_an_index_with_an_empty_weight_map(source_copy, tmp_path):
    source = source_copy()
    write_index(source, {})
    message = assert_error(thinker("convert", source, tmp_path / "out"), "model.safetensors.index.json", "names no")
    assert "no checkpoint here" not in message


@pytest.mark.parametrize("metadata", ["absent", None, []])
def test_an_index_without_transformers_metadata_is_named_for_the_check(metadata, source_copy, tmp_path):
    """transformers' loader reads the index's "metadata" object, the converter its weight_map alone: the check named
    neither the file nor the key ("the reference model does not load with transformers ('metadata')", a QA run). The
    conversion itself still runs without the check."""
    source = source_copy()
    names = list(as_shard(source))
    index = {"weight_map": dict.fromkeys(names, "model-a.safetensors")}
    if metadata != "absent":
        index["metadata"] = metadata
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    message = assert_error(
        thinker("convert", source, tmp_path / "out"),
        f'{source / "model.safetensors.index.json"}: no "metadata" object, which transformers reads',
        'add "metadata": {} to it, or convert with --no-verify',
    )
    assert "does not load with transformers" not in message
    assert_nothing_written(tmp_path / "out")
    assert thinker("convert", source, tmp_path / "unchecked", "--no-verify").exit_code == 0


# --- JSON nested past the recursion limit (issue 15) ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_too_deeply(name, source_copy, tmp_path):
    source = source_copy()
    if name.endswith(".index.json"):
        as_shard(source)
    (source / name).write_text("[" * 100_000 + "]" * 100_000)
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify"), name, "nested too deeply")
    assert_nothing_written(output)


def test_a_thinker_config_nested_too_deeply(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    (folder / "config.json").write_text('{"model_type": "thinker", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), "config.json", "nested too deeply")
    assert_nothing_written(output)


# --- config values no model can work with (issues 15, 16) ----------------------------------------------------------

NAN = float("nan")
BAD_VALUES = {
    "negative context": ({"max_position_embeddings": -1}, ["max_position_embeddings=-1"]),
    "no context": ({"max_position_embeddings": 0}, ["max_position_embeddings=0"]),
    "a context of 1e12": ({"max_position_embeddings": 10**12}, ["max_position_embeddings=1000000000000"]),
    "unknown activation": ({"hidden_act": "swishy"}, ["hidden_act='swishy'"]),
    "an activation with weights": ({"hidden_act": "prelu"}, ["hidden_act='prelu' learns parameters (weight)"]),
    "unknown rope_type": (
        {"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}},
        ["rope_type='spiral'"],
    ),
    "NaN rms_norm_eps": ({"rms_norm_eps": NAN}, ["rms_norm_eps=nan"]),
    "negative rope_theta": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}},
        ["rope_theta=-5.0"],
    ),
    # found by a QA run: a factor of 0 made transformers' reference compute NaN, which was blamed on the weights
    "a RoPE scaling factor of 0": (
        {"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0}},
        ["rope_parameters.factor=0.0 must be a positive number"],
    ),
    # found by a QA run: building the model stopped inside torch ("Padding_idx must be within num_embeddings")
    "a pad id past the vocabulary": (
        {"pad_token_id": 5000},
        ["pad_token_id=5000 must be a token id of the vocabulary"],
    ),
    "a RoPE scaling factor given as text": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": "2", "rope_theta": 10000.0}},
        ["rope_parameters.factor='2'"],
    ),
    # found by a QA run: "module 'torch' has no attribute 'float8'", the key unnamed
    "a dtype torch lacks": ({"dtype": "float8"}, ["dtype='float8' is not a dtype torch has"]),
    # found by a QA run: a Thinker folder's layer count as text read "layer_types must list one of ... for each of 2
    # layers; got [two layers]", and a switch as text passed for true (its string annotations went unchecked)
    "a layer count as text": ({"num_hidden_layers": "2"}, ["num_hidden_layers", "'2'"]),
    "a switch as text": ({"tie_word_embeddings": "no"}, ["tie_word_embeddings", "expected bool, got str"]),
}


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({"vocab_size": 100, "pad_token_id": 100}, "pad_token_id=100 must be a token id"),  # one past the last row
        ({"vocab_size": 100, "pad_token_id": 99}, None),
        ({"vocab_size": 100, "pad_token_id": -100}, None),  # torch's Embedding takes -vocab_size too
        ({"rms_norm_eps": 1.0}, "rms_norm_eps=1.0 must be a small positive number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta=0 must be a"),
        ({"hidden_size": 0}, "hidden_size=0 must be a whole number above 0"),
        ({"max_position_embeddings": 2**24}, None),
        ({"max_position_embeddings": 2**24 + 1}, "max_position_embeddings=16777217 is beyond any model's context"),
        # the factor of the default RoPE is read by no scaling: left alone, as transformers leaves it
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "factor": 0}}, None),
    ],
)
def test_config_limits_hold_at_their_edges(config, refused):
    """Each rule of ``config_values`` at its boundary, where an off-by-one would let through what fails later inside
    torch (a pad row one past the embedding) or divide by zero (a RoPE theta of 0), or refuse a usable value."""
    from thinker_common.config_values import config_problem

    problem = config_problem(config)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(refused), problem


@pytest.mark.parametrize(
    ("config", "shown"),
    [
        ({"model_type": "qwen3_vl", "text_config": {"dtype": "float8"}}, "text_config.dtype='float8'"),
        (
            {"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {"torch_dtype": "half8"}}},
            "thinker_config.text_config.torch_dtype='half8'",
        ),
    ],
)
def test_a_nested_configs_dtype_torch_lacks_is_named(config, shown):
    """A vision-language or omni source's dtype lies in its text config too (a review: still "module 'torch' has no
    attribute 'float8'" there)."""
    from converter.families.common import load_hf_config
    from thinker_common.errors import ThinkerError

    with pytest.raises(ThinkerError, match=rf"{re.escape(shown)} is not a dtype torch has"):
        load_hf_config(config, config["model_type"])


@pytest.mark.parametrize("case", BAD_VALUES)
def test_convert_refuses_config_values_no_model_has(case, source_copy, tmp_path):
    changes, fragments = BAD_VALUES[case]
    source = source_copy()
    edit_config(source, **changes)
    output = tmp_path / "out"
    message = assert_error(thinker("convert", source, output), "config.json", *fragments)
    assert "does not match its reference" not in message
    assert_nothing_written(output)


@pytest.mark.parametrize("changes", [{"dtype": "Tensor"}, {"torch_dtype": "float8"}])
def test_a_dtype_torch_lacks_is_named_under_either_key(changes, source_copy, tmp_path):
    """transformers reads the older ``torch_dtype`` too, and looks any name up on torch, where "Tensor" is no dtype
    (a mutation run)."""
    source = source_copy()
    edit_config(source, **changes)
    ((key, value),) = changes.items()
    assert_error(thinker("convert", source, tmp_path / "out"), f"{key}={value!r} is not a dtype torch has")


def test_the_way_back_names_a_dtype_torch_lacks(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, dtype="float8")
    result = thinker("convert", folder, tmp_path / "back", "--to", "qwen3", "--no-verify")
    assert_error(result, str(folder / "config.json"), "dtype='float8' is not a dtype torch has")


def test_a_stale_index_beside_the_whole_file_is_no_refusal(source_copy, tmp_path):
    """transformers reads model.safetensors before any index: a bin index beside it, naming shards long gone, is
    not the metadata check's to refuse (the layer check runs it before any load; a mutation run)."""
    source = source_copy()
    names = list(load_file(source / "model.safetensors"))
    (source / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "gone.bin")}))
    result = thinker("convert", source, tmp_path / "out", "--verify-by-layer")
    assert result.exit_code == 0, result.output


def test_a_failed_fsync_names_the_shard(source_copy, tmp_path, monkeypatch):
    """fsync's error names no file (NFS, a quota found at the flush): the shard's name is put on it (a mutation run)."""
    from converter import shards

    def failing(descriptor):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shards.os, "fsync", failing)
    result = thinker("convert", source_copy(), tmp_path / "out", "--no-verify")
    assert_error(result, "model.safetensors: Input/output error")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", BAD_VALUES)
def test_export_refuses_config_values_no_model_has(case, qwen3_thinker, tmp_path):
    changes, fragments = BAD_VALUES[case]
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, **changes)
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), str(folder / "config.json"), *fragments)
    assert_nothing_written(output)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top_p", 2.0),
        ("temperature", 0),
        ("do_sample", "yes"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("repetition_penalty", 0),
    ],
)
def test_export_refuses_sampling_values_generate_cannot_take(key, value, qwen3_thinker, tmp_path):
    """generation_config.json's sampling keys go into genai_config.json's search (export/genai_config.py), where
    onnxruntime-genai would fail on them at load time: refused by key before the export starts, where generate()
    reads them. Greedy search reads no temperature, top_k or top_p, and generate() runs a file that sets them to
    anything (a QA run: temperature 0 was refused): the defaults go in their place."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    path = folder / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"do_sample": True, key: value}))
    output = tmp_path / "onnx"
    result = thinker("export", folder, output, "--no-verify")
    assert_error(result, str(path), f"{key}={value!r} is not a value generate() takes")
    assert_nothing_written(output)

    if key == "do_sample":
        return
    path.write_text(json.dumps(json.loads(path.read_text()) | {"do_sample": False}))
    result = thinker("export", folder, output, "--no-verify")
    if key == "repetition_penalty":  # greedy search reads it too
        assert_error(result, str(path), f"{key}={value!r} is not a value generate() takes")
    else:
        assert result.exit_code == 0, result.output
        search = json.loads((output / "genai_config.json").read_text())["search"]
        assert search["do_sample"] is False and search[key] == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}[key]


@pytest.mark.parametrize(("key", "value"), [("max_length", 0), ("temperature", -1.0)])
def test_export_of_a_source_names_the_sources_generation_config(key, value, source_copy, tmp_path, monkeypatch):
    """A source the export converts first: its generation_config.json is named, to be corrected in the source, before
    it is converted (the copy in the run's staging folder was named, deleted with it, after the conversion ran)."""
    from converter import convert

    source = source_copy()
    path = source / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"do_sample": True, key: value}))
    converted = []
    monkeypatch.setattr(convert, "write_weights", lambda *args, **kwargs: converted.append(1))
    output = tmp_path / "onnx"
    result = thinker("export", source, output, "--no-verify")
    assert_error(result, f"{path}: {key}={value!r} is not a", "correct it in the source")
    assert not converted
    assert_nothing_written(output)


@pytest.mark.parametrize("short_by", ["most", "one"])
def test_export_refuses_a_context_too_short_to_verify(short_by, qwen3_thinker, tmp_path):
    """Refused before any work, naming config.json; one position short too, where an off-by-one let the export run
    into the runtime's own refusal, which tells the user to shorten a prompt they never gave (a mutation run)."""
    from export.verify import DECODE_STEPS
    from thinker_common.parity_inputs import PROMPT_LENGTHS

    positions = 2 if short_by == "most" else max(PROMPT_LENGTHS) + DECODE_STEPS - 1
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, max_position_embeddings=positions)
    output = tmp_path / "onnx"
    result = thinker("export", folder, output, "--verify")
    said = f"max_position_embeddings={positions}"
    assert_error(result, "config.json", said, "fewer positions than --verify runs", "--no-verify")
    assert_nothing_written(output)
    assert thinker("export", folder, output, "--no-verify").exit_code == 0  # a 2-position model exports as it is


def test_export_verifies_a_context_exactly_as_long_as_the_verify(qwen3_thinker, tmp_path):
    """The other side of the refusal above: a context of exactly the positions --verify runs (its longest prompt and
    decode steps) is exported and verified, not refused (a mutation run refused it)."""
    from export.verify import DECODE_STEPS
    from thinker_common.parity_inputs import PROMPT_LENGTHS

    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, max_position_embeddings=max(PROMPT_LENGTHS) + DECODE_STEPS)
    output = tmp_path / "onnx"
    result = thinker("export", folder, output, "--verify")
    assert result.exit_code == 0, result.output
    assert json.loads((output / "export_report.json").read_text())["verify"]["passed"] is True


def test_export_refuses_a_verify_that_cannot_fit_in_memory(qwen3_thinker, qwen3_source, tmp_path, monkeypatch):
    """--verify holds at least the graph's session and one PyTorch layer (the whole model where it fits, else streamed
    layer by layer: tests/export/test_verify_rejects.py): where not even that fits, the export is refused before it
    starts (not killed once written), and --no-verify still exports. So is a quantized export's."""
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1KB")
    output = tmp_path / "onnx"
    result = thinker("export", qwen3_thinker, output, "--verify")
    assert_error(
        result,
        str(qwen3_thinker),
        "one PyTorch layer",
        "with the graph in float32",
        "than the 1000 B THINKER_VERIFY_MEMORY allows",
        "--no-verify",
    )
    assert_nothing_written(output)
    assert thinker("export", qwen3_thinker, output, "--no-verify").exit_code == 0
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1GB")  # the tiny model's two copies fit
    assert thinker("export", qwen3_thinker, tmp_path / "verified", "--verify").exit_code == 0

    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1KB")
    quantized = thinker("export", qwen3_thinker, tmp_path / "int8", "--verify", "--quantize", "int8")
    assert_error(quantized, "two sessions of the quantized graph and one PyTorch layer", "--no-verify")
    assert_nothing_written(tmp_path / "int8")
    # a source converted on the way lies in a staging folder: the message names the model, not that folder
    on_the_way = thinker("export", qwen3_source, tmp_path / "from-source", "--verify", "--quantize", "int8")
    line = assert_error(on_the_way, "the model converted from SOURCE: --verify holds at least")
    assert ".partial-" not in line
    assert_nothing_written(tmp_path / "from-source")


@pytest.mark.parametrize("value", ["abc", ""])
@pytest.mark.parametrize("name", ["HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"])
def test_a_hub_timeout_that_is_no_number_is_named(name, value, qwen3_source, tmp_path, monkeypatch):
    """huggingface_hub parses these with int() when it is imported, in every command (a local source's too), set
    but empty as well: a ValueError's traceback, before."""
    monkeypatch.setenv(name, value)
    result = run_cli("convert", qwen3_source, tmp_path / "out", "--no-verify")
    assert_process_error(result, f"{name}={value!r} is not a whole number of seconds", "correct or unset it")
    assert_nothing_written(tmp_path / "out")


def test_a_huge_context_is_refused_in_bounded_memory(qwen3_thinker, tmp_path):
    """10^9 positions: the RoPE tables would take 8 GB; refused by key under a 3 GiB address-space cap."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, max_position_embeddings=10**9)
    done = run_cli("export", folder, tmp_path / "onnx", "--no-verify", address_space=3 * 2**30)
    assert_process_error(done, "max_position_embeddings=1000000000")
    assert_nothing_written(tmp_path / "onnx")


# --- what the export checks before writing, with or without --verify (issue 16) ------------------------------------

EDITS = {
    "hidden_size": ({"hidden_size": 40}, ["hidden_size=40"]),
    "intermediate_size": ({"intermediate_size": 40}, ["intermediate_size=40"]),
    "num_key_value_heads": ({"num_key_value_heads": 4}, ["num_key_value_heads=4"]),
    "num_attention_heads": ({"num_attention_heads": 2}, ["num_attention_heads=2"]),
    "head_dim": ({"head_dim": 16}, ["head_dim=16"]),
    "vocab_size": ({"vocab_size": 80}, ["vocab_size=80"]),
}


@pytest.mark.parametrize("verify", ["--no-verify", "--verify"])
@pytest.mark.parametrize("key", EDITS)
def test_export_refuses_a_config_that_does_not_describe_the_weights(key, verify, qwen3_thinker, tmp_path):
    changes, fragments = EDITS[key]
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, **changes)
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, verify), "config.json", *fragments, "the folder holds")
    assert_nothing_written(output)


def test_a_wrong_size_is_blamed_on_its_key_alone(qwen3_thinker, tmp_path):
    """intermediate_size moves only the MLP's inner dimension: hidden_size, which gives the same tensors their other
    (agreeing) dimension, is not named beside it, which sent the user to a key that is right (a mutation run)."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, intermediate_size=40)
    output = tmp_path / "onnx"
    expected = f"config.json: intermediate_size=40 gives {GATE} the shape (40, 32), but the folder holds (48, 32)"
    assert_error(thinker("export", folder, output, "--no-verify"), expected)
    assert_nothing_written(output)


@pytest.mark.parametrize("verify", ["--no-verify", "--verify"])
def test_export_refuses_a_tensor_of_another_shape(verify, qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({DOWN: tensors[DOWN][:, :40].clone()}))
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, verify), DOWN, "(32, 48)", "(32, 40)")
    assert_nothing_written(output)


@pytest.mark.parametrize("verify", ["--no-verify", "--verify"])
def test_export_refuses_integer_weights(verify, qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({DOWN: tensors[DOWN].to(torch.int32)}))
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, verify), DOWN, "int32", "floating point")
    assert_nothing_written(output)


@pytest.mark.parametrize("verify", ["--no-verify", "--verify"])
def test_export_refuses_tying_over_a_trained_head(verify, qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, tie_word_embeddings=True)
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, verify), "tie_word_embeddings", "lm_head.weight", "false")
    assert_nothing_written(output)


# --- a float tensor relabelled as integers (issue 16) --------------------------------------------------------------


def relabel(path: Path, name: str, code: str) -> None:
    """Change one tensor's dtype code in a safetensors header, leaving its bytes (and the header's length) as is."""
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = code
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    data[8 : 8 + length] = text
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_float_tensor_relabelled_i32(command, source_copy, qwen3_thinker, tmp_path):
    folder = source_copy() if command == "convert" else shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    relabel(folder / "model.safetensors", DOWN, "I32")
    output = tmp_path / "out"
    assert_error(thinker(command, folder, output, "--verify"), "model.safetensors", DOWN, "int32")
    assert_nothing_written(output)


# --- pickles: what torch refused, by name (issue 16) ----------------------------------------------------------------


class _Calls:
    def __init__(self, function, argument) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self):
        return self.function, (self.argument,)


@pytest.mark.parametrize(
    "how",
    ["zip", "legacy"],
    ids=["torch.save", "torch.save, pre-1.6 format"],
)
def test_a_pickle_refusal_names_the_blocked_global(how, qwen3_source, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(qwen3_source / "config.json", source)
    marker = tmp_path / "ran"
    payload = {EMBED: torch.zeros(64, 32), "payload": _Calls(os.system, f"touch {marker}")}
    torch.save(payload, source / "pytorch_model.bin", _use_new_zipfile_serialization=how == "zip")
    output = tmp_path / "out"
    message = assert_error(thinker("convert", source, output), "pytorch_model.bin", "posix.system", "never run")
    assert "RuntimeError" not in message and "not tensors" not in message
    assert not marker.exists()
    assert_nothing_written(output)


def test_a_raw_pickle_is_refused_without_torch_warnings(qwen3_source, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(qwen3_source / "config.json", source)
    (source / "model.pt").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))
    assert_error(thinker("convert", source, tmp_path / "out"), "model.pt", "never run")


# --- generate (issue 16) ------------------------------------------------------------------------------------------


def test_generate_with_an_empty_model_onnx(qwen3_onnx, tmp_path):
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    (folder / "model.onnx").write_bytes(b"")
    assert_error(thinker("generate", folder, "-p", "the cat"), str(folder / "model.onnx"), "empty", "export it again")


def test_generate_checks_the_context_of_an_onnx_folder_without_config(qwen3_onnx, tmp_path):
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    (folder / "config.json").unlink()
    result = thinker("generate", folder, "-p", "the cat " * 30, "-n", "40")
    assert_error(result, "--prompt is 60 tokens", "needs 99 positions, beyond the model's 64", "context_length")


def test_generate_checks_the_context_of_an_onnx_folder_without_either_config(qwen3_onnx, tmp_path):
    """Neither config.json nor genai_config.json: the context is the rows of the graph's own RoPE table (was
    onnxruntime's GroupQueryAttention error, with a traceback)."""
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    (folder / "config.json").unlink()
    (folder / "genai_config.json").unlink()
    result = thinker("generate", folder, "-p", "the cat " * 30, "-n", "40")
    assert_error(result, "--prompt is 60 tokens", "needs 99 positions, beyond the model's 64", "RoPE table rows")


@pytest.mark.parametrize(
    "edit",
    [
        {"config.json": {"max_position_embeddings": 1000}},
        {"config.json": None, "genai_config.json": {"model": {"context_length": 1000}}},
        {"config.json": None, "genai_config.json": {"model": {"context_length": "x"}}},
    ],
    ids=["config-longer", "genai-longer", "genai-not-a-number"],
)
def test_a_config_claiming_more_context_than_the_graph_holds(edit, qwen3_onnx, tmp_path):
    """From a QA sweep: a config edited to a longer context than the graph's RoPE table (64 rows) let generation run
    off the table, into onnxruntime's RotaryEmbedding error with a traceback after 62 tokens."""
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    for name, change in edit.items():
        if change is None:
            (folder / name).unlink()
            continue
        config = json.loads((folder / name).read_text())
        for key, value in change.items():
            config[key] = config[key] | value if isinstance(value, dict) else value
        (folder / name).write_text(json.dumps(config))
    result = thinker("generate", folder, "-p", "the cat", "-n", "70")
    assert_error(result, "needs 71 positions, beyond the model's 64", "RoPE table rows of model.onnx")


def test_rope_tables_beyond_the_memory_available(qwen3_thinker, tmp_path, monkeypatch):
    """The tables hold a row per position; a context whose tables would not fit in memory is refused by key."""
    import collections

    import psutil

    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, max_position_embeddings=2**21)  # 2 tables x 2^21 x (head_dim 8 / 2) x 4 bytes = 64 MiB
    memory = collections.namedtuple("memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=32 * 2**20, total=2**30))
    output = tmp_path / "onnx"
    result = thinker("export", folder, output, "--no-verify")
    assert_error(
        result,
        "a context of 2097152 positions (max_position_embeddings)",
        "RoPE tables of 64.0 MiB",
        "than the 32.0 MiB of memory available",
        "memory available",
    )
    assert_nothing_written(output)


def test_export_names_missing_and_extra_tensors(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({"extra.weight": tensors.pop(DOWN)}))
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), f"lacks {DOWN}", "holds extra.weight")
    assert_nothing_written(output)
