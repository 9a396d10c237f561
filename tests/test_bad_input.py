"""Bad input (issue 7): every user mistake ends in one line that names the file, tensor or key and says what to do,
exit status 1 (2 for click's usage errors), no traceback, and nothing written: no OUTPUT, no staging folder.
Then safety (nothing unpickled or run that should not be; no file name escapes its folder) and a fuzz test of the
converter. docs/errors.md tabulates the cases.

Every command runs in process through click's runner, on the tiny session-wide Qwen3 checkpoint of conftest.py.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from cli_helpers import (
    as_shard,
    assert_error,
    assert_nothing_written,
    assert_usage_error,
    edit_config,
    edit_tensors,
    thinker,
)
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from converter.cli import convert_command
from converter.convert import convert
from converter.engine import plan_conversion, stream_tensors
from export.providers import cuda_usable
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.sources import open_source

# --- breaking a checkpoint ---------------------------------------------------------------------------------------


def set_value(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name].view(-1)[3] = value

    return change


def truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def truncate_as_bin(folder: Path) -> None:
    """The checkpoint as a pytorch_model.bin (torch.save's zip format) that lost its last 100 bytes."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    path = folder / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:-100])


def garble_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))


def huge_header_length(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**60) + path.read_bytes()[8:])


def index_naming_a_missing_shard(folder: Path) -> None:
    names = list(as_shard(folder))
    weight_map = {name: "model-a.safetensors" for name in names[1:]} | {names[0]: "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def index_misfiling_a_tensor(folder: Path) -> None:
    """Two shards and an index from another download: it names the first shard for the tensor the second holds."""
    tensors = as_shard(folder)
    moved = next(iter(tensors))
    save_file({moved: tensors.pop(moved)}, folder / "model-b.safetensors")
    save_file(tensors, folder / "model-a.safetensors")
    weight_map = {name: "model-a.safetensors" for name in [*tensors, moved]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def shards_sharing_a_tensor(folder: Path) -> None:
    """Two shards that both hold one tensor (a shard of another download beside them), named by the index."""
    tensors = as_shard(folder)
    shared = next(iter(tensors))
    save_file({shared: tensors[shared]}, folder / "model-b.safetensors")
    weight_map = {name: "model-a.safetensors" for name in tensors} | {shared: "model-b.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.pop(name)


def add(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.update({name: torch.zeros(4)})


NAN, INF = float("nan"), float("inf")
EMBED = "model.embed_tokens.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"

# case -> (how to break the source copy, options, fragments the error line must hold)
CONVERT_CASES = {
    "truncated safetensors": (truncate, [], ["model.safetensors", "truncated or corrupt, re-download it"]),
    "truncated pytorch_model.bin": (truncate_as_bin, [], ["pytorch_model.bin", "truncated or corrupt", "re-download"]),
    "corrupt header": (garble_header, [], ["model.safetensors", "truncated or corrupt"]),
    "huge header length": (huge_header_length, [], ["model.safetensors", "truncated or corrupt"]),
    "index names a missing shard": (
        index_naming_a_missing_shard,
        [],
        ["model.safetensors.index.json", "'model-00002-of-00002.safetensors', which is missing"],
    ),
    "index misfiles a tensor": (
        index_misfiling_a_tensor,
        [],
        ["model.safetensors.index.json", "to 'model-a.safetensors', which does not hold it", "re-download"],
    ),
    "shards share a tensor": (
        shards_sharing_a_tensor,
        [],
        ["in both model-a.safetensors and model-b.safetensors", "not all of one checkpoint", "re-download"],
    ),
    "unknown architecture": (
        lambda folder: edit_config(folder, model_type="mamba", architectures=["MambaForCausalLM"]),
        [],
        ["model_type 'mamba'", "is not supported; supported: ", "qwen3"],
    ),
    "unmapped tensor": (
        lambda folder: edit_tensors(folder, add("model.layers.0.mlp.extra.weight")),
        [],
        ["no qwen3 rule maps", "model.layers.0.mlp.extra.weight"],
    ),
    "missing tensor": (lambda folder: edit_tensors(folder, drop(DOWN)), [], ["lacks tensors", DOWN, "incomplete"]),
    "shape disagrees with config": (
        lambda folder: edit_config(folder, intermediate_size=40),
        [],
        ["disagree with the config", "model.layers.0.mlp.gate_proj.weight", "(48, 32), expected (40, 32)"],
    ),
    "tied in config, head in tensors": (
        lambda folder: edit_config(folder, tie_word_embeddings=True),
        [],
        ["tie_word_embeddings=true", "lm_head.weight", "set tie_word_embeddings to false"],
    ),
    "untied in config, no head": (
        lambda folder: edit_tensors(folder, drop("lm_head.weight")),
        [],
        ["tie_word_embeddings=false", "holds no lm_head.weight", "set tie_word_embeddings to true"],
    ),
    "float16 overflow": (
        lambda folder: edit_tensors(folder, set_value(DOWN, 1e5)),
        ["--dtype", "float16"],
        [DOWN, "100000, beyond float16's ±65504", "--dtype bfloat16 or float32"],
    ),
    "NaN in weights": (lambda folder: edit_tensors(folder, set_value(EMBED, NAN)), [], [EMBED, "NaN or Inf"]),
    "Inf in weights": (lambda folder: edit_tensors(folder, set_value(DOWN, INF)), [], [DOWN, "NaN or Inf"]),
    "config.json missing": (lambda folder: (folder / "config.json").unlink(), [], ["no config.json beside"]),
    "config.json not JSON": (
        lambda folder: (folder / "config.json").write_text("{model_type: qwen3"),
        [],
        ["config.json: not readable JSON"],
    ),
    "config key of the wrong type": (
        lambda folder: edit_config(folder, architectures="Qwen3ForCausalLM"),
        [],
        ["'architectures' must be a list of class names"],
    ),
    "negative size": (
        lambda folder: edit_config(folder, intermediate_size=-5),
        [],
        ["config", "-5"],
    ),
    "tokenizer.json cut short": (
        lambda folder: cut_in_half(folder / "tokenizer.json"),
        [],
        ["tokenizer.json: not a readable tokenizer file (JSONDecodeError", "re-download it"],
    ),
    "tokenizer.json not a tokenizer": (
        lambda folder: (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonesuch"}}'),
        [],
        ["tokenizer.json: not a readable tokenizer file (Exception", "re-download it"],
    ),
    "tokenizer_config.json not JSON": (
        lambda folder: (folder / "tokenizer_config.json").write_text('{"model_max_length": '),
        [],
        ["tokenizer_config.json: not a readable tokenizer file (JSONDecodeError"],
    ),
    "chat template that does not compile": (
        lambda folder: (folder / "chat_template.jinja").write_text("{% for message in messages %}{{ message }}"),
        [],
        ["chat_template.jinja: not a readable tokenizer file (TemplateSyntaxError", "'endfor'"],
    ),
    "the last shard of a set missing, no index": (
        lambda folder: (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors"),
        [],
        ["holds shards of a set of 2", "but not model-00002-of-00002.safetensors", "the download is incomplete"],
    ),
    "a billion layers": (
        lambda folder: edit_config(folder, num_hidden_layers=10**9),
        [],
        ["num_hidden_layers=1000000000", "holds only", "does not describe these qwen3 weights"],
    ),
}


@pytest.mark.parametrize("case", CONVERT_CASES)
def test_convert_refuses_a_broken_checkpoint(case, source_copy, tmp_path):
    break_it, options, fragments = CONVERT_CASES[case]
    source = source_copy()
    break_it(source)
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify", *options), *fragments)
    assert_nothing_written(output)


@pytest.mark.parametrize(
    "make",
    [
        lambda folder: folder.mkdir(),
        lambda folder: (folder.mkdir(), (folder / "README.md").write_text("# notes")),
        lambda folder: (folder.mkdir(), (folder / "config.json").write_text('{"model_type": "qwen3"}')),
    ],
    ids=["empty", "a README only", "config without weights"],
)
def test_a_folder_without_a_checkpoint(make, tmp_path):
    make(tmp_path / "folder")
    result = thinker("convert", tmp_path / "folder", tmp_path / "out")
    assert_error(result, str(tmp_path / "folder"), "no checkpoint here", "point SOURCE at a model folder")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_file_beside_the_weights_named_as_source(name, qwen3_source, tmp_path):
    """Not a false alarm about pickled objects (the file was read as a PyTorch checkpoint), but what it is."""
    result = thinker("convert", qwen3_source / name, tmp_path / "out")
    assert_error(result, f"{name}: a .json file of the checkpoint, not its weights; give the folder that holds it")
    assert_nothing_written(tmp_path / "out")


def test_a_path_that_does_not_exist(tmp_path, monkeypatch):
    result = thinker("convert", tmp_path / "nowhere", tmp_path / "out")
    assert_error(result, "nowhere: no such folder, and not a Hub repo id")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for command in ("convert", "export"):  # not the working directory, also with OUTPUT inside it
        for output in (tmp_path / "out", Path("out")):
            empty = thinker(command, "", output)
            assert_error(empty, "SOURCE is empty; give a model folder, a weights file or a Hub repo id")
            assert_nothing_written(output)


def test_converting_a_thinker_folder_says_what_it_is(qwen3_thinker, tmp_path):
    """A Thinker's save_pretrained (a Trainer's output) given to convert: not "model_type 'thinker' is not
    supported", but what the folder is and the commands that take it."""
    output = tmp_path / "out"
    result = thinker("convert", qwen3_thinker, output)
    assert_error(result, "already a Thinker folder", "`thinker export`", "--to FAMILY")
    assert_nothing_written(output)


def test_the_thinker_convert_script_reports_the_same_way(source_copy, tmp_path):
    source = source_copy()
    truncate(source)
    assert_error(thinker(source, tmp_path / "out", command=convert_command), "truncated or corrupt")


def test_debug_shows_the_traceback(source_copy, tmp_path):
    source = source_copy()
    truncate(source)
    result = thinker("convert", source, tmp_path / "out", "--debug")
    assert result.exit_code == 1 and isinstance(result.exception, ThinkerError)


# --- OUTPUT ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_an_existing_output_is_left_untouched(command, kind, qwen3_source, qwen3_thinker, tmp_path, digest):
    output = tmp_path / "out"
    if kind == "folder":
        output.mkdir()
        (output / "model.safetensors").write_bytes(b"precious")
    else:
        output.write_text("precious")
    before = digest(output)
    source = qwen3_source if command == "convert" else qwen3_thinker
    if kind == "folder":  # not thinker's: --force does not take it, so without --force it is not sent there either
        for force in ([], ["--force"]):
            result = thinker(command, source, output, "--no-verify", *force)
            assert_error(result, str(output), "not an earlier output of thinker", "choose another OUTPUT")
    else:  # a file at OUTPUT is more likely a mistyped path than an old output: --force does not take it either
        for force in ([], ["--force"]):
            result = thinker(command, source, output, "--no-verify", *force)
            assert_error(result, str(output), "is a file", "--force replaces folders")
    assert digest(output) == before


def test_output_where_no_folder_can_be(qwen3_source, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = thinker("convert", qwen3_source, tmp_path / "a-file" / "out", "--no-verify")
    assert_error(result, f"{tmp_path / 'a-file'}: a file, not a folder, so out cannot be created in it")
    deeper = thinker("convert", qwen3_source, tmp_path / "a-file" / "deeper" / "out", "--no-verify")
    assert_error(deeper, f"{tmp_path / 'a-file'}: a file, not a folder, so deeper/out cannot be created in it")


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_file_at_output_is_named_a_file_before_any_download(force, tmp_path, monkeypatch):
    """A Hub id as SOURCE is no local path, so no check against the source runs before the download: the look at
    OUTPUT alone must still call a file there a file (a mistyped path), not "not an earlier output of thinker", and
    with --force too, before the download (after it, the file was refused all the same: gigabytes for nothing)."""
    import converter.convert

    def download(*args, **kwargs):
        raise AssertionError("the download started")

    monkeypatch.setattr(converter.convert, "resolve_source", download)
    (tmp_path / "out").write_text("notes")
    with pytest.raises(ThinkerError, match="out is a file, and OUTPUT is a folder: choose another path"):
        converter.convert.convert("Qwen/Qwen3-0.6B", tmp_path / "out", force=force, verify=False, progress=False)
    assert (tmp_path / "out").read_text() == "notes"


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_refused_run_leaves_no_parent_folders(command, qwen3_source, qwen3_thinker, tmp_path):
    """OUTPUT's missing parents are made for the run; one that ends in an error takes them away again."""
    folder = shutil.copytree(qwen3_source if command == "convert" else qwen3_thinker, tmp_path / "model")
    edit_config(folder, intermediate_size=100)  # not the weights' shape: refused before a byte is written
    result = thinker(command, folder, tmp_path / "new" / "nested" / "out", "--no-verify")
    assert_error(result, "does not describe these weights")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]


def test_disk_full_while_writing_weights(qwen3_source, tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    # Every byte of every shard goes through one of the two: written from memory, or copied by the kernel.
    monkeypatch.setattr("converter.shards._write_all", no_space)
    monkeypatch.setattr("os.copy_file_range", no_space)
    output = tmp_path / "out"
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert_error(result, f"the disk is full at {tmp_path}: writing OUTPUT needs more than the ", "MiB free there")
    assert_nothing_written(output)


def test_disk_full_before_writing(qwen3_source, tmp_path, monkeypatch):
    monkeypatch.setattr("thinker_common.staging.free_bytes", lambda folder: 1000)
    output = tmp_path / "out"
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert_error(result, f"the disk is full at {tmp_path}", "needs about 0.1 MiB, 0.0 MiB free")
    assert_nothing_written(output)


def test_disk_full_before_a_scaled_export_counts_its_graph_too(qwen3_thinker, tmp_path, monkeypatch):
    """A quantized export with the activation-aware scales stages the model in float32 and writes the graph beside
    it, every weight at least its bits: room for the copy alone is refused up front, by the sum (it was let through
    and then ran out, saying "needs more than the ... of its weights" with more than that free; helper-242)."""
    import torch

    from export.exporter import weights_size

    staged = weights_size(qwen3_thinker, torch.float32)
    monkeypatch.setattr("thinker_common.staging.free_bytes", lambda folder: staged)
    output = tmp_path / "onnx"
    result = thinker("export", qwen3_thinker, output, "--quantize", "int8", "--no-verify")
    expected = f"needs about {(staged + staged // 4) / 2**20:.1f} MiB, {staged / 2**20:.1f} MiB free"
    assert_error(result, f"the disk is full at {tmp_path}", expected)
    assert_nothing_written(output)


def test_disk_full_while_exporting(qwen3_thinker, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("export.graph_builder.WeightFile._append", no_space)
    output = tmp_path / "onnx"
    result = thinker("export", qwen3_thinker, output, "--no-verify")
    assert_error(result, f"the disk is full at {tmp_path}: writing OUTPUT needs more than the ", "of its weights")
    assert_nothing_written(output)


def test_a_disk_full_message_names_no_staging_folder(tmp_path):
    """An export converting on the way writes into its own staging folder; the message names where OUTPUT goes."""
    from thinker_common.staging import outside_staging, staging_path

    assert outside_staging(staging_path(tmp_path / "out") / "thinker" / "model.safetensors") == tmp_path
    assert outside_staging(tmp_path / "out") == tmp_path / "out"


@pytest.mark.parametrize(
    "code, advice", [(errno.ENOSPC, "(No space left on device); free some space"), (errno.EROFS, "make the folder")]
)
def test_verify_that_cannot_write_its_report(code, advice, qwen3_source, qwen3_thinker, tmp_path, monkeypatch):
    """`thinker verify` writes parity.json into a finished folder: a full disk or a read-only folder is one line,
    and leaves neither a partial report nor a changed folder."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    (folder / "parity.json").write_text("the report before")
    before = sorted(path.name for path in folder.iterdir())

    def cannot(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("thinker_common.staging.os.replace", cannot)
    assert_error(thinker("verify", qwen3_source, folder), f"{folder}: cannot write parity.json there", advice)
    assert sorted(path.name for path in folder.iterdir()) == before
    assert (folder / "parity.json").read_text() == "the report before"


# --- dtype and device --------------------------------------------------------------------------------------------


def test_unsupported_dtypes(qwen3_source, qwen3_thinker, tmp_path):
    result = thinker("convert", qwen3_source, tmp_path / "out", "--dtype", "int8")
    assert_usage_error(result, "Invalid value for '--dtype': 'int8' is not one of 'auto', 'float32'")
    result = thinker("export", qwen3_thinker, tmp_path / "out", "--dtype", "int8")
    assert_usage_error(result, "Invalid value for '--dtype': 'int8'")
    with pytest.raises(ThinkerError, match="--dtype 'int8' is not one of auto, float32, bfloat16, float16"):
        convert(qwen3_source, tmp_path / "out", dtype="int8", verify=False, progress=False)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.skipif(cuda_usable() or torch.cuda.is_available(), reason="CUDA is here")
@pytest.mark.parametrize("model", ["onnx", "thinker"])
def test_cuda_asked_for_where_none_is(model, qwen3_onnx, qwen3_thinker):
    folder = qwen3_onnx if model == "onnx" else qwen3_thinker
    result = thinker("generate", folder, "--prompt", "the cat", "--provider", "cuda")
    assert_error(result, "--provider cuda: CUDA asked for where none is", "use --provider cpu")


def test_an_unknown_provider(qwen3_onnx):
    assert_usage_error(thinker("generate", qwen3_onnx, "-p", "the cat", "--provider", "tpu"), "'--provider'")


@pytest.mark.parametrize("command", ["generate", "export"])
def test_threads_beyond_any_machine_are_refused(command, qwen3_onnx, qwen3_thinker, tmp_path):
    """onnxruntime makes every thread it is asked for: a hundred thousand took 17 GB before the first token."""
    args = [qwen3_onnx, "-p", "the cat"] if command == "generate" else [qwen3_thinker, tmp_path / "out"]
    assert_usage_error(thinker(command, *args, "--threads", "100000"), "'--threads'", "1<=x<=1024")
    assert not (tmp_path / "out").exists()


# --- generate ----------------------------------------------------------------------------------------------------


def test_prompt_from_stdin(qwen3_onnx):
    """``--prompt -`` reads stdin, less its final newline: the same continuation as the text given inline."""
    inline = CliRunner().invoke(main, ["generate", str(qwen3_onnx), "-p", "the cat sat", "-n", "4"])
    piped = CliRunner().invoke(main, ["generate", str(qwen3_onnx), "-p", "-", "-n", "4"], input="the cat sat\n")
    assert inline.exit_code == 0 and piped.exit_code == 0, piped.output
    assert piped.stdout == inline.stdout and inline.stdout.strip()
    assert_error(
        CliRunner().invoke(main, ["generate", str(qwen3_onnx), "-p", "-"], input="\n"),
        "--prompt -: stdin gave no text",
    )


def test_bad_prompts(qwen3_onnx, tmp_path):
    assert_error(thinker("generate", qwen3_onnx, "--prompt", ""), "--prompt tokenizes to nothing; give some text")
    result = thinker("generate", qwen3_onnx, "--prompt", "the cat sat", "--max-new-tokens", "63")
    assert_error(result, "--prompt is 3 tokens, and with --max-new-tokens 63 that needs 65 positions", "model's 64")
    fits = thinker("generate", qwen3_onnx, "--prompt", "the cat sat", "--max-new-tokens", "62")  # the last is not fed
    assert fits.exit_code == 0, fits.output

    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    edit_config(folder, vocab_size=8)  # as if the tokenizer came from another model
    result = thinker("generate", folder, "--prompt", "the cat sat")
    assert_error(result, "the tokenizer gives token id 8 for --prompt, beyond the model's vocabulary of 8")


def same_size_foreign_weights(folder: Path) -> None:
    """Another export's weights of the same size (the same config, other weights): every byte differs, the size
    stamp agrees, and only the fingerprint of the contents tells them apart."""
    data = folder / "model.onnx.data"
    data.write_bytes(bytes(byte ^ 0x5A for byte in data.read_bytes()))


def another_exports_weights(folder: Path) -> None:
    """A weights file larger than the graph reads, as another export's beside this graph: it would run, over the
    wrong bytes, had the export not stamped its weights file's size in the graph."""
    with open(folder / "model.onnx.data", "ab") as data:
        data.write(bytes(4096))


@pytest.mark.parametrize(
    "damage, fragments",
    [
        (lambda f: (f / "model.onnx.data").unlink(), ["model.onnx.data missing beside model.onnx", "incomplete"]),
        (  # from a QA run: taken for a Thinker folder (its config.json) and refused as weights config.json lacks
            lambda f: (f / "model.onnx").unlink(),
            ["model.onnx missing beside model.onnx.data", "genai_config.json", "the ONNX folder is incomplete"],
        ),
        (lambda f: (f / "model.onnx").write_bytes(b"\x08\x07\x12\xff"), ["model.onnx", "export it again"]),
        (lambda f: (f / "model.onnx.data").write_bytes(b"short"), ["model.onnx.data: 5 bytes", "is truncated"]),
        (lambda f: (f / "tokenizer.json").unlink(), ["no usable tokenizer"]),
        (another_exports_weights, ["model.onnx.data", "bytes, but model.onnx was exported with", "another export"]),
        (same_size_foreign_weights, ["model.onnx.data: not the weights model.onnx was exported with", "another"]),
        (  # from a QA sweep: was "missing", as was a link to /dev/zero
            lambda f: ((f / "model.onnx.data").unlink(), os.mkfifo(f / "model.onnx.data")),
            ["model.onnx.data: a named pipe", "not a regular file; an ONNX folder's model and weights are plain files"],
        ),
        (
            lambda f: ((f / "model.onnx.data").unlink(), (f / "model.onnx.data").symlink_to(f / "gone")),
            ["model.onnx.data: a broken symlink", "restore the file it points to"],
        ),
    ],
    ids=[
        "no model.onnx.data",
        "no model.onnx",
        "corrupt model.onnx",
        "truncated model.onnx.data",
        "no tokenizer",
        "foreign weights",
        "foreign weights of the same size",
        "a named pipe for model.onnx.data",
        "a broken link for model.onnx.data",
    ],
)
def test_generate_with_an_incomplete_onnx_folder(damage, fragments, qwen3_onnx, tmp_path):
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    damage(folder)
    assert_error(thinker("generate", folder, "--prompt", "the cat"), str(folder), *fragments)


def test_a_damaged_model_onnx_is_an_error_naming_it(qwen3_onnx, tmp_path, capsys):
    """Bytes changed inside model.onnx (it may still parse: a string field no longer UTF-8, an external-data entry
    garbled) load, or fail with a ThinkerError naming the file: never another exception, nor onnxruntime's banner."""
    from export.runtime import OnnxDecoder

    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    intact = (qwen3_onnx / "model.onnx").read_bytes()
    for seed in range(60):
        draw, damaged = random.Random(seed), bytearray(intact)
        start = draw.randrange(len(damaged))
        damaged[start : start + 8] = bytes(draw.randrange(256) for _ in range(8))
        (folder / "model.onnx").write_bytes(damaged)
        try:
            OnnxDecoder(folder, provider="cpu")
        except ThinkerError as err:
            assert str(folder / "model.onnx") in str(err), (seed, err)
    assert "EP Error" not in capsys.readouterr().out


def test_generate_takes_one_prompt(qwen3_onnx):
    """click keeps the last of a repeated option: the first prompt was dropped without a word."""
    assert_usage_error(thinker("generate", qwen3_onnx, "-p", "the cat", "-p", "a dog"), "'--prompt'", "given 2 times")


def test_generate_with_a_folder_that_is_no_model(tmp_path, qwen3_onnx, monkeypatch):
    message = assert_error(thinker("generate", tmp_path / "nowhere", "-p", "the cat"), "nowhere: no such folder")
    assert message.endswith("nowhere: no such folder")  # a local path: no word of the Hub
    monkeypatch.chdir(tmp_path)  # a Hub repo id, whose owner is no folder here: how to fetch it (generate runs folders)
    assert_error(
        thinker("generate", "acme/model-onnx", "-p", "the cat"),
        "acme/model-onnx: no such folder; generate runs a folder on this machine: for a Hub repo, download it (hf "
        "download acme/model-onnx --local-dir DIR) and pass DIR",
    )
    (tmp_path / "acme").mkdir()  # now a mistyped local path
    assert assert_error(thinker("generate", "acme/model-onnx", "-p", "x"), "no such folder").endswith("no such folder")
    model = qwen3_onnx / "model.onnx"
    assert_error(thinker("generate", model, "-p", "the cat"), f"{model}: a file; give the folder that holds it")
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_onnx / name, folder)
    assert_error(thinker("generate", folder, "-p", "the cat"), "neither an ONNX folder", "nor a Thinker folder")


# --- export and verify -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, options, fragments",
    [(NAN, [], ["holds NaN or Inf", "the folder is corrupt"]), (1e5, ["--dtype", "float16"], ["beyond float16"])],
    ids=["NaN", "float16 overflow"],
)
def test_export_refuses_bad_weights(value, options, fragments, qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, set_value(DOWN, value))
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify", *options), f"tensor '{DOWN}'", *fragments)
    assert_nothing_written(output)


def test_export_of_a_broken_source_stops_at_the_conversion(source_copy, tmp_path):
    source = source_copy()
    edit_config(source, model_type="mamba", architectures=["MambaForCausalLM"])
    output = tmp_path / "onnx"
    assert_error(thinker("export", source, output, "--no-verify"), "model_type 'mamba'", "is not supported")
    assert_nothing_written(output)


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_export_refuses_a_tokenizer_cut_short(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    cut_in_half(folder / "tokenizer.json")
    output = tmp_path / "onnx"
    advice = "convert its source again (thinker-convert wrote this folder)"
    assert_error(thinker("export", folder, output, "--no-verify"), "tokenizer.json: not a readable tokenizer", advice)
    assert_nothing_written(output)


def test_a_thinker_folder_without_its_weights(qwen3_thinker, qwen3_onnx, tmp_path):
    """From a QA run: both commands listed every tensor as lacking and sent the user to config.json's sizes."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    weightless = [str(folder), "a Thinker folder without its weights (no *.safetensors); convert it again"]
    assert_error(thinker("generate", folder, "--prompt", "the cat"), *weightless)
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), *weightless)
    assert_nothing_written(output)
    export = shutil.copytree(qwen3_onnx, tmp_path / "export")
    (export / "model.onnx").unlink()  # what is left is still an export's, not a Thinker folder
    assert_error(thinker("export", export, output, "--no-verify"), "is an ONNX export already")
    assert_nothing_written(output)


def test_export_of_a_corrupt_thinker_folder(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    truncate(folder)
    output = tmp_path / "onnx"
    # made locally by thinker-convert, so not downloaded again: converted again
    advice = "truncated or corrupt, convert its source again (thinker-convert wrote this folder)"
    assert_error(thinker("export", folder, output, "--no-verify"), "model.safetensors", advice)
    assert_nothing_written(output)


def test_verify_refuses_what_is_not_a_conversion(qwen3_source, qwen3_thinker, source_copy, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_error(thinker("verify", qwen3_source, tmp_path / "empty"), "not a converted model folder")
    source = source_copy()
    edit_config(source, model_type="mamba", architectures=["MambaForCausalLM"])
    assert_error(thinker("verify", source, qwen3_thinker), "model_type 'mamba'", "not supported")
    assert_usage_error(thinker("verify", qwen3_source, tmp_path / "nowhere"), "does not exist")
    edited = shutil.copytree(qwen3_thinker, tmp_path / "edited")
    edit_config(edited, max_position_embeddings=100000)  # beyond the fixed prompts' reach, still another model
    assert_error(
        thinker("verify", qwen3_source, edited),
        f"config.json is not the config {qwen3_source} translates to: max_position_embeddings (64 -> 100000)",
        "check that SOURCE (and --revision, --subfolder) name the checkpoint it was converted from",
    )
    # keys beyond the model's fields: which class the Auto API and pipelines build, a key added by hand (a QA run
    # found both passed)
    relabelled = shutil.copytree(qwen3_thinker, tmp_path / "architectures")
    edit_config(relabelled, architectures=["ThinkerForSequenceClassification"], foo_bar=1)
    assert_error(
        thinker("verify", qwen3_source, relabelled),
        "architectures (['ThinkerForCausalLM'] -> ['ThinkerForSequenceClassification']), foo_bar (None -> 1)",
    )
    # the dtype from_pretrained(dtype="auto") loads in, which the parity check (each dtype loaded explicitly) never
    # reads; a QA run found it passed, and the report then said the folder stored bfloat16
    relabelled = shutil.copytree(qwen3_thinker, tmp_path / "relabelled")
    edit_config(relabelled, dtype="bfloat16")
    assert_error(
        thinker("verify", qwen3_source, relabelled),
        "config.json: dtype 'bfloat16', but the folder's weights are stored in float32",
        "set dtype to 'float32'",
    )
    swapped = thinker("verify", qwen3_thinker, qwen3_source)
    assert_error(swapped, f"{qwen3_thinker}: SOURCE is a Thinker folder", "order is `thinker verify SOURCE CONVERTED`")
    # the stop token generate() runs with, which no parity prompt reads (found by a QA run: it passed)
    stops = shutil.copytree(qwen3_thinker, tmp_path / "stops")
    path = stops / "generation_config.json"
    eos = json.loads(path.read_text())["eos_token_id"]
    path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": 5}))
    assert_error(
        thinker("verify", qwen3_source, stops),
        f"generation_config.json is not the generation config {qwen3_source} gives: eos_token_id ({eos!r} -> 5)",
    )
    path.unlink()
    assert_error(thinker("verify", qwen3_source, stops), "lacks generation_config.json")


def test_verify_takes_what_an_auto_conversion_writes(source_copy, tmp_path):
    """float32 weights under a config declaring bfloat16 (what DeepSpeed's zero_to_fp32 leaves): the conversion
    keeps every tensor as stored and the config's dtype, as the source loads, and its own verify refused that folder
    (found by a QA run: its dtype rule took the dtype holding most bytes). A relabelled dtype is still refused."""
    source = source_copy()
    edit_config(source, dtype="bfloat16")
    output = tmp_path / "thinker"
    converted = thinker("convert", source, output)
    assert converted.exit_code == 0, converted.output
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"
    # said so, where it said "of bfloat16 weights (25 tensors kept in float32 ...)" with no bfloat16 weight at all
    assert "of float32 weights, as the source stores them (config.json's dtype: bfloat16" in converted.output
    verified = thinker("verify", source, output)
    assert verified.exit_code == 0 and "parity holds" in verified.output, verified.output
    edit_config(output, dtype="float16")
    assert_error(thinker("verify", source, output), "config.json: dtype 'float16', but the folder's weights")


# --- the Hub -----------------------------------------------------------------------------------------------------


def test_a_hub_id_while_offline_and_not_cached(fake_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "out")
    assert_error(result, "tiny-org/tiny-qwen3@main is not in the cache", "HF_HUB_OFFLINE=1; run once online")
    assert_nothing_written(tmp_path / "out")
    assert not fake_hub.requests


def test_verify_against_another_revision_names_it(fake_hub, qwen3_thinker, source_copy):
    """A Thinker folder checked against a Hub repo at another revision than it was converted from: the message
    names the repo at that revision, which is what differs."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", source_copy("main"))
    longer = source_copy("v2")
    edit_config(longer, max_position_embeddings=128)
    fake_hub.add_repo("tiny-org/tiny-qwen3", longer, revision="v2")
    result = thinker("verify", "tiny-org/tiny-qwen3", qwen3_thinker, "--revision", "v2")
    assert_error(result, "is not the config tiny-org/tiny-qwen3@v2 translates to: max_position_embeddings (128 -> 64)")


def test_a_hub_id_that_does_not_exist(fake_hub, tmp_path):
    result = thinker("convert", "tiny-org/no-such-model", tmp_path / "out")
    assert_error(result, "tiny-org/no-such-model@main: repo not found on", "check the repo id")
    assert_nothing_written(tmp_path / "out")


# --- safety ------------------------------------------------------------------------------------------------------


class _RunsCode:
    """Pickles to a call of ``exec``: what a malicious checkpoint hides in a .bin or .pth file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pth"])
def test_a_pickle_that_would_run_code_is_refused(name, qwen3_source, tmp_path):
    marker = tmp_path / "code-ran"
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(qwen3_source / "config.json", source)
    torch.save({EMBED: torch.zeros(64, 32), "payload": _RunsCode(marker)}, source / name)
    result = thinker("convert", source, tmp_path / "out")
    assert_error(result, str(source / name), "pickled Python objects besides tensors (e.g. ", "never run")
    assert not marker.exists()
    assert_nothing_written(tmp_path / "out")


EVIL_MODULE = "open({marker!r}, 'w').write('ran')\n"


def test_no_remote_code_from_a_source(source_copy, tmp_path):
    """auto_map in config.json and tokenizer_config.json points at code beside the weights: never imported."""
    marker = tmp_path / "code-ran"
    source = source_copy()
    (source / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    auto_map = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model", "AutoTokenizer": ["evil.Tok", None]}
    edit_config(source, auto_map=auto_map)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"auto_map": auto_map}))

    result = thinker("convert", source, tmp_path / "out", "--verify")  # the reference: transformers' Qwen3 class
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "out" / "evil.py").exists()  # tokenizer files are copied by their known names only
    result = thinker("generate", tmp_path / "out", "--prompt", "the cat", "-n", "2")
    assert result.exit_code == 0, result.output

    # A model_type transformers does not know: the folder's auto_map is all there is to build a reference from.
    edit_config(source, model_type="evil")
    result = thinker("convert", source, tmp_path / "out2", "--verify")
    assert_error(result, "model_type 'evil' is not one transformers knows", "auto_map, is never run", "--no-verify")
    edit_config(source, architectures=["EvilForCausalLM"])
    assert_error(thinker("convert", source, tmp_path / "out2"), "model_type 'evil'", "is not supported")
    assert not marker.exists()


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors"])
def test_index_shard_names_cannot_leave_the_checkpoint(shard, source_copy, tmp_path):
    source = source_copy()
    as_shard(source)
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {EMBED: shard}}))
    result = thinker("convert", source, tmp_path / "out")
    assert_error(result, "model.safetensors.index.json", f"shard name {shard!r} points outside", "refusing")


def test_hub_file_names_cannot_leave_the_cache(fake_hub, qwen3_source, tmp_path):
    # the only weights the repo lists are hostile names, so they are the ones a conversion would fetch
    files = {path.name: path.read_bytes() for path in qwen3_source.iterdir() if path.suffix != ".safetensors"}
    hostile = {"..\\escape.safetensors": b"{}", "sub/../../escape.safetensors": b"{}"}
    fake_hub.add_repo("tiny-org/escape", files | hostile)
    result = thinker("convert", "tiny-org/escape", tmp_path / "out")
    assert_error(result, "repo file name '..\\\\escape.safetensors' would escape the download folder")
    assert not list(tmp_path.rglob("*escape.safetensors"))


def test_onnx_external_data_cannot_leave_the_folder(qwen3_onnx, tmp_path):
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../../etc/passwd"
    onnx.save_model(model, str(folder / "model.onnx"))
    assert_error(thinker("generate", folder, "-p", "the cat"), "names weights outside its folder")


# --- fuzz: the converter ends in success or ThinkerError, never in another exception ------------------------------

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE_CODES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "U16", "U64", "BOOL", "F8_E4M3", "F4", "C64", "?"]
SIZES = st.sampled_from([-1, 0, 1, 2, 3, 8, 32, 48, 64, 2**31, 2**40, 2**63 - 1])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | SIZES | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def plan_and_stream(folder: Path, config: dict | None = None) -> None:
    """Plan the conversion of ``folder`` (with ``config`` or its own config.json) and, if it plans, stream every
    tensor through the checks: the whole converter short of writing."""
    source = open_source(folder)
    try:
        if config is None:
            config = json.loads((folder / "config.json").read_text())
        plan = plan_conversion(source, config)
        for _ in stream_tensors(plan, source):
            pass
    finally:
        source.close()


def mutated_header(data: st.DataObject, header: dict) -> dict:
    header = json.loads(json.dumps(header))
    names = sorted(name for name in header if name != "__metadata__")
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(names))
        entry = header.get(name)
        kind = data.draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "junk"]))
        if kind == "drop" or not isinstance(entry, dict):
            header.pop(name, None)
        elif kind == "dtype":
            entry["dtype"] = data.draw(st.sampled_from(DTYPE_CODES) | JSON_VALUES)
        elif kind == "shape":
            entry["shape"] = data.draw(st.lists(SIZES, max_size=3) | JSON_VALUES)
        elif kind == "offsets":
            entry["data_offsets"] = data.draw(st.lists(SIZES | st.integers(0, 20000), min_size=2, max_size=2))
        elif kind == "rename":
            header[data.draw(st.text(max_size=12))] = header.pop(name)
        else:
            header[name] = data.draw(JSON_VALUES)
    return header


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_headers(data, qwen3_source):
    raw = (qwen3_source / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, body = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    form = data.draw(st.sampled_from(["mutated", "random JSON", "truncated", "length prefix"]))
    if form == "mutated":
        text = json.dumps(mutated_header(data, header)).encode()
    elif form == "random JSON":
        text = json.dumps(data.draw(JSON_VALUES)).encode()
    else:
        text = json.dumps(header).encode()
    prefix = struct.pack("<Q", len(text))
    if form == "length prefix":
        prefix = struct.pack("<Q", data.draw(st.sampled_from([0, 1, len(text) - 1, len(text) + 1, 2**63, 2**64 - 1])))
    if form == "truncated" or data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body)))]
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(qwen3_source / "config.json", folder)
        Path(folder, "model.safetensors").write_bytes(prefix + text + body)
        try:
            plan_and_stream(Path(folder))
        except ThinkerError:
            pass


CONFIG_KEYS = [
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "attention_bias", "layer_types",
    "use_sliding_window", "num_experts", "dtype", "torch_dtype", "eos_token_id",
]  # fmt: skip


def mutated_config(data: st.DataObject, config: dict) -> dict:
    config = dict(config)
    for _ in range(data.draw(st.integers(1, 4))):
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        if data.draw(st.booleans()):
            config.pop(key, None)
        else:
            config[key] = data.draw(SIZES | JSON_VALUES)
    return config


@FUZZ
@given(data=st.data())
def test_fuzz_config(data, qwen3_source):
    config = mutated_config(data, json.loads((qwen3_source / "config.json").read_text()))
    try:
        plan_and_stream(qwen3_source, config)
    except ThinkerError:
        pass


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_the_command_line(data, qwen3_source):
    """A few random configs through `thinker convert` itself: success or one error line, never a traceback."""
    config = mutated_config(data, json.loads((qwen3_source / "config.json").read_text()))
    with tempfile.TemporaryDirectory() as folder:
        source = Path(shutil.copytree(qwen3_source, Path(folder) / "source"))
        (source / "config.json").write_text(json.dumps(config))
        result = thinker("convert", source, Path(folder) / "out", "--no-verify")
        if result.exit_code == 0:
            return
        assert_error(result)
        assert_nothing_written(Path(folder) / "out")


@pytest.mark.parametrize("check", [[], ["--verify-by-layer"]])
def test_a_whole_file_beside_an_index_is_what_converts(check, source_copy, tmp_path):
    """A folder holding model.safetensors and, beside it, an index with shards of other weights (a whole copy
    uploaded beside an older sharded set): transformers loads model.safetensors, before any index, so the converter
    converts that file and its check vouches for it. Reading the shards instead converts other weights, and the
    check, against transformers' model, fails."""
    source = source_copy()
    tensors = load_file(source / "model.safetensors")
    stale = {name: tensor + 1 for name, tensor in tensors.items()}
    names = list(stale)
    save_file({name: stale[name] for name in names[:3]}, source / "model-00001-of-00002.safetensors")
    save_file({name: stale[name] for name in names[3:]}, source / "model-00002-of-00002.safetensors")
    weight_map = {name: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, name in enumerate(names)}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    output = tmp_path / "out"
    result = thinker("convert", source, output, *check)
    assert result.exit_code == 0, result.output
    converted = load_file(output / "model.safetensors")
    assert torch.equal(converted[EMBED], tensors[EMBED])


@pytest.mark.parametrize("beside", ["model.fp16.safetensors", "consolidated.safetensors", "unindexed shards"])
@pytest.mark.parametrize("check", [[], ["--verify-by-layer"]])
def test_a_pytorch_model_bin_beside_other_safetensors_is_what_converts(beside, check, source_copy, tmp_path):
    """pytorch_model.bin beside safetensors files transformers does not read (a variant, a consolidated copy,
    numbered shards without their index): transformers loads the .bin, so the converter converts it. Reading the
    safetensors converted other weights, which the layer check (reading the same files) vouched for."""
    source = source_copy()
    tensors = load_file(source / "model.safetensors")
    torch.save(tensors, source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    stale = {name: tensor + 1 for name, tensor in tensors.items()}
    if beside == "unindexed shards":
        names = list(stale)
        save_file({name: stale[name] for name in names[:3]}, source / "model-00001-of-00002.safetensors")
        save_file({name: stale[name] for name in names[3:]}, source / "model-00002-of-00002.safetensors")
    else:
        save_file(stale, source / beside)
    output = tmp_path / "out"
    result = thinker("convert", source, output, *check)
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(output / "model.safetensors")[EMBED], tensors[EMBED])


@pytest.mark.parametrize("layout", ["lone variant", "unindexed shards"])
def test_the_layer_check_refuses_what_transformers_cannot_load(layout, source_copy, tmp_path):
    """A folder whose weights transformers finds under none of its names: the whole-model check has no reference,
    and the layer check, which reads the converter's own files, must not stand in for one."""
    source = source_copy()
    tensors = as_shard(source)
    (source / "model-a.safetensors").unlink()
    if layout == "lone variant":
        save_file(tensors, source / "model.fp16.safetensors")
        expected = "transformers finds none of model.safetensors, pytorch_model.bin or their indexes here"
    else:
        names = list(tensors)
        save_file({name: tensors[name] for name in names[:3]}, source / "model-00001-of-00002.safetensors")
        save_file({name: tensors[name] for name in names[3:]}, source / "model-00002-of-00002.safetensors")
        expected = "have no model.safetensors.index.json, which transformers needs to load them"
    for check in ([], ["--verify-by-layer"]):
        output = tmp_path / f"out{len(check)}"
        assert_error(thinker("convert", source, output, *check), expected, "no reference to verify against")
        assert_nothing_written(output)
    assert thinker("convert", source, tmp_path / "unchecked", "--no-verify").exit_code == 0


def test_a_config_naming_its_weights_file_is_refused(source_copy, tmp_path):
    """transformers 5 loads the file a config's transformers_weights names instead of model.safetensors; the
    converter reads only the standard names, so it says so rather than convert the other file."""
    source = source_copy()
    edit_config(source, transformers_weights="other.safetensors")
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output), "names its weights file 'other.safetensors'", "rename the file")
    assert_nothing_written(output)


@pytest.mark.parametrize("check", [[], ["--verify-by-layer"]])
def test_a_weights_file_transformers_does_not_load_is_refused_as_source(check, source_copy, tmp_path):
    """SOURCE naming one weights file: the check's reference is transformers' load of its folder, so a file other
    than the one transformers loads there has none (the whole-model check compared other weights and failed; the
    layer check, reading the file, passed weights transformers never runs). The file it loads converts."""
    source = source_copy()
    tensors = load_file(source / "model.safetensors")
    torch.save({name: tensor + 1 for name, tensor in tensors.items()}, source / "pytorch_model.bin")
    output = tmp_path / "out"
    refused = thinker("convert", source / "pytorch_model.bin", output, *check)
    assert_error(refused, "pytorch_model.bin: transformers loads model.safetensors from", "give the folder as SOURCE")
    assert_nothing_written(output)
    assert thinker("convert", source / "model.safetensors", output, *check).exit_code == 0

    variant = source_copy("variant")
    (variant / "model.safetensors").rename(variant / "model.fp16.safetensors")
    refused = thinker("convert", variant / "model.fp16.safetensors", tmp_path / "out2", *check)
    assert_error(refused, "transformers finds none of model.safetensors, pytorch_model.bin or their indexes")


def test_the_only_shard_an_index_names_converts_as_source(source_copy, tmp_path):
    """A checkpoint saved as a set of one shard with its index: that shard named as SOURCE is the whole model, so it
    converts; only a part of several is refused as one shard (below)."""
    source = source_copy()
    shard = source / "model-00001-of-00001.safetensors"
    (source / "model.safetensors").rename(shard)
    weight_map = dict.fromkeys(load_file(shard), shard.name)
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = thinker("convert", shard, tmp_path / "out", "--no-verify")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["convert", "export"])
def test_one_shard_as_source_is_named_as_a_shard(command, qwen3_source, tmp_path):
    """SOURCE naming one shard of a checkpoint whose index lies beside it was refused as an incomplete checkpoint,
    the tensors the other shards hold listed as missing (a QA run): it is named as one of the index's shards."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(qwen3_source).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    output = tmp_path / "out"
    refused = thinker(command, shards[1], output, "--no-verify")
    assert_error(refused, f"{shards[1]}: one of the {len(shards)} shards model.safetensors.index.json names")
    assert_nothing_written(output)


def test_export_no_verify_skips_the_conversion_on_the_ways_check_too(qwen3_source, tmp_path, monkeypatch):
    """A SOURCE converted on the way was checked against its reference whatever export's --no-verify said, and a
    source without a reference was refused with advice to "convert with --no-verify" (helper-248)."""

    def no_check(*args, **kwargs):
        raise AssertionError("the conversion's parity check ran")

    monkeypatch.setattr("converter.convert.parity_gate", no_check)
    output = tmp_path / "onnx"
    result = thinker("export", qwen3_source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert (output / "model.onnx").is_file()


def test_a_conversion_on_the_way_that_fails_its_check_names_the_source(qwen3_source, tmp_path, monkeypatch):
    """Not the export's staging folder, gone by the time the message is read (helper-248)."""
    from converter.parity import ParityFailed

    def failing(root, staging, family, report, failure, *args, **kwargs):
        raise ParityFailed(failure, None)

    monkeypatch.setattr("converter.convert.parity_gate", failing)
    result = thinker("export", qwen3_source, tmp_path / "onnx")
    assert_error(result, f"{qwen3_source}: does not match its reference; nothing written")
    assert ".partial" not in result.output
