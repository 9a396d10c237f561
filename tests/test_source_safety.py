"""The source is never harmed and never leaks (issues 15 and 16): OUTPUT may not be, hold or lie inside the source,
nor be the working directory; a symlink is followed only inside the source folder or the Hub cache holding it;
what is not a regular file (a named pipe, a folder named like a file) is refused instead of read.

Every refusal is one ``error:`` line naming the path, exit 1, the source byte for byte as it was, nothing at OUTPUT.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import pytest
import torch
from cli_helpers import (
    REPO,
    assert_error,
    assert_nothing_written,
    assert_process_error,
    earlier_output,
    run_cli,
    side_by_side,
    thinker,
    thinker_meeting_pipes,
)

from thinker_common.errors import ThinkerError
from thinker_common.source_files import checked_file, hub_caches_of, present

# --- OUTPUT over the source (issue 15) -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, fragments",
    [
        (lambda source: source / "model.safetensors", ["lies inside the source"]),
        (lambda source: source / "config.json", ["lies inside the source"]),
        (lambda source: source / "new-folder", ["lies inside the source"]),
        (lambda source: source, ["is the source"]),
        (lambda source: source.parent, ["holds the source"]),
    ],
    ids=["a weights file", "config.json", "a folder inside", "the source itself", "a folder holding it"],
)
@pytest.mark.parametrize("force", [["--force"], []], ids=["force", "no-force"])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_output_never_replaces_a_source_folder(command, force, where, fragments, source_copy, tmp_path, digest):
    """With or without --force, the same message: without it, "already exists; pass --force" would only lead to
    this refusal."""
    source = source_copy()
    before = digest(tmp_path)
    output = where(source)
    result = thinker(command, source, output, *force, "--no-verify")
    assert_error(result, str(output.absolute()), *fragments, "choose")
    assert digest(tmp_path) == before


@pytest.mark.parametrize("force", [["--force"], []], ids=["force", "no-force"])
def test_export_never_replaces_the_thinker_folder(force, qwen3_thinker, tmp_path, digest):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    before = digest(folder)
    for output in (folder, folder / "onnx", folder / "model.safetensors"):
        assert_error(thinker("export", folder, output, *force, "--no-verify"), str(output), "source")
    assert digest(folder) == before


@pytest.mark.parametrize("command", ["convert", "export"])
def test_output_through_a_bind_mount_of_the_source_is_refused(
    command, bind_mounted, source_copy, qwen3_thinker, digest
):
    """The source's folder reached through a bind mount: with --force it used to be replaced, source and all."""
    real, alias = bind_mounted
    source = shutil.copytree(source_copy() if command == "convert" else qwen3_thinker, real / "source")
    before = digest(real)
    for output, says in [
        (alias / "source", "is the source"),
        (alias, "holds the source"),
        (alias / "source/x", "lies inside"),
    ]:
        result = thinker(command, source, output, "--force", "--no-verify")
        assert_error(result, str(output), says, "reached by another path", "choose")
        assert digest(real) == before


def test_another_path_to_the_same_place_is_refused_by_identity(source_copy, tmp_path, monkeypatch, digest):
    """The same check without a mount: a second folder taken for the source's own place (as another case of its name
    is on a case-insensitive disk), which only the (device, inode) identity can tell."""
    from thinker_common import staging

    source = source_copy()
    alias = tmp_path / "ALIAS"
    alias.mkdir()
    identity = staging._identity
    monkeypatch.setattr(staging, "_identity", lambda path: identity(source if Path(path) == alias else path))
    before = digest(source)
    result = thinker("convert", source, alias, "--force", "--no-verify")
    assert_error(result, str(alias), "is the source", "reached by another path")
    assert digest(source) == before and alias.is_dir()


@pytest.fixture
def weights_file_source(source_copy, tmp_path) -> Path:
    """A source given as one weights file: model.safetensors with its config.json and tokenizer beside it."""
    return source_copy() / "model.safetensors"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_output_never_replaces_a_file_the_source_reads(name, weights_file_source, tmp_path, digest):
    before = digest(tmp_path)
    output = weights_file_source.parent / name
    assert_error(thinker("convert", weights_file_source, output, "--force", "--no-verify"), str(output), "source")
    assert digest(tmp_path) == before


@pytest.mark.parametrize("name", ["vocab.json", "chat_template.jinja"])
def test_output_never_takes_the_name_of_a_side_file_the_source_lacks(name, weights_file_source, tmp_path, digest):
    """Beside a single weights file, OUTPUT may not be named as any file read with it, even one not there yet: a
    folder called vocab.json beside the weights would make that source unreadable to every later run (its tokenizer
    files are read by those names), so the refusal says OUTPUT lies in the source, not that it is merely a file."""
    output = weights_file_source.parent / name
    assert not output.exists()
    before = digest(tmp_path)
    for force in ([], ["--force"]):
        result = thinker("convert", weights_file_source, output, "--no-verify", *force)
        assert_error(result, str(output), "lies inside the source", "choose a folder outside it")
    assert digest(tmp_path) == before


def test_output_beside_a_weights_file_is_fine(weights_file_source):
    """A new folder beside a single source file (the usual place for a converted GGUF) harms nothing."""
    output = weights_file_source.parent / "converted"
    result = thinker("convert", weights_file_source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert (output / "model.safetensors").is_file() and (weights_file_source.parent / "config.json").is_file()


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory) -> Path:
    """The real SmolLM2 GGUF, copied where a test may put it (an OUTPUT must be able to hold it)."""
    from converter.families.gguf import smollm2_gguf_path

    folder = tmp_path_factory.mktemp("gguf")
    return Path(shutil.copy(smollm2_gguf_path(), folder))


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("target", ["the file", "its folder"])
def test_output_never_replaces_a_gguf_source(command, target, smollm2_copy, digest):
    before = digest(smollm2_copy.parent)
    output = smollm2_copy if target == "the file" else smollm2_copy.parent
    result = thinker(command, smollm2_copy, output, "--force", "--no-verify")
    assert_error(result, str(output), "source")
    assert digest(smollm2_copy.parent) == before


def test_the_way_back_never_replaces_its_source(qwen3_thinker, tmp_path, digest):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    before = digest(folder)
    for output in (folder, folder / "qwen3", folder / "config.json"):
        for force in (["--force"], []):
            result = thinker("convert", folder, output, "--to", "qwen3", *force, "--no-verify")
            assert_error(result, str(output), "source")
    assert digest(folder) == before


def test_verify_never_writes_into_its_source(qwen3_source, source_copy, tmp_path, digest):
    source = source_copy()
    before = digest(source)
    assert_error(thinker("verify", source, source), str(source), "CONVERTED is the source")
    assert digest(source) == before


def test_the_demo_never_replaces_its_source(smollm2_copy, tmp_path, monkeypatch, digest):
    """The demo's OUTPUT folders are fixed names in --workdir: one of them holding the GGUF is refused."""
    workdir = tmp_path / "work"
    gguf = workdir / "smollm2-135m-thinker" / smollm2_copy.name
    gguf.parent.mkdir(parents=True)
    shutil.copy(smollm2_copy, gguf)
    monkeypatch.setattr("converter.families.gguf.smollm2_gguf_path", lambda: gguf)
    before = digest(workdir)
    assert_error(thinker("demo", "--workdir", workdir), str(gguf.parent), "holds the source")
    assert digest(workdir) == before


# --- OUTPUT and the working directory (issue 16) -------------------------------------------------------------------


@pytest.mark.parametrize("output", [".", "..", "./"])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_output_is_never_the_working_directory(command, output, qwen3_source, qwen3_thinker, tmp_path, monkeypatch):
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    source = qwen3_source if command == "convert" else qwen3_thinker
    result = thinker(command, source, output, "--force", "--no-verify")
    assert_error(result, "the working directory", "choose")
    assert (work / "notes.txt").read_text() == "mine" and sorted(os.listdir(work)) == ["notes.txt"]


@pytest.mark.parametrize("command", ["convert", "export"])
def test_force_replaces_earlier_outputs_only(command, qwen3_source, qwen3_thinker, tmp_path, digest):
    """--force deletes the folder it replaces, so it replaces only an empty folder or one a thinker command wrote
    (known by its model card). A QA run gave the home folder as OUTPUT (the working directory is refused above, that
    folder was not it) and lost every program installed there; a typo could as well name another checkpoint, the
    only copy of someone's fine-tuned weights. Each is refused by name, nothing touched; an earlier output is
    replaced, and so is an earlier output of the other command."""
    source = qwen3_source if command == "convert" else qwen3_thinker
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".bashrc").write_text("mine")
    (home / "config.json").write_text("{}")
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "notes.md").write_text("mine")
    checkpoint = tmp_path / "fine-tuned"
    shutil.copytree(qwen3_source, checkpoint)
    (checkpoint / "README.md").write_text("---\nlicense: apache-2.0\n---\n# my fine-tune\n")
    saved = tmp_path / "saved"  # save_pretrained writes no card
    shutil.copytree(qwen3_thinker, saved, ignore=shutil.ignore_patterns("README.md"))
    linked = tmp_path / "linked"  # a thinker card, but reached through a link: not a folder of plain files
    linked.mkdir()
    (linked / "README.md").symlink_to(qwen3_thinker / "README.md")
    before = digest(tmp_path)
    for folder, held in (
        (home, "holds .bashrc, .cache"),
        (documents, "no README.md model card of thinker's"),
        (checkpoint, "its README.md is not a thinker model card"),
        (saved, "no README.md model card of thinker's"),
        (linked, "holds README.md"),
    ):
        result = thinker(command, source, folder, "--force", "--no-verify")
        assert_error(result, f"{folder}: not an earlier output of thinker ({held})", "choose another OUTPUT")
    assert digest(tmp_path) == before and (home / ".cache").is_dir()
    earlier = tmp_path / "earlier"
    assert thinker(command, source, earlier, "--no-verify").exit_code == 0
    replaced = thinker(command, source, earlier, "--no-verify", "--force")
    assert replaced.exit_code == 0, replaced.output
    other = "export" if command == "convert" else "convert"
    other_source = qwen3_thinker if other == "export" else qwen3_source
    assert thinker(other, other_source, earlier, "--no-verify", "--force").exit_code == 0  # the other command's too


def test_force_keeps_what_was_saved_into_an_earlier_output(qwen3_source, tmp_path, digest):
    """An earlier output someone wrote into since (a fine-tune saved in place with save_pretrained, which keeps the
    card; a note added) is theirs now: --force refuses it by the changed file (a QA run lost such a fine-tune).
    thinker's own later writes, ``thinker verify``'s report and card, keep an unchanged folder replaceable."""
    import torch

    from thinker import ThinkerForCausalLM

    tuned = tmp_path / "tuned"
    assert thinker("convert", qwen3_source, tuned, "--no-verify").exit_code == 0
    model = ThinkerForCausalLM.from_pretrained(tuned)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    model.save_pretrained(tuned)
    noted = tmp_path / "noted"
    assert thinker("convert", qwen3_source, noted, "--no-verify").exit_code == 0
    (noted / "notes.md").write_text("mine")
    # neither a note on the card (its own change time moves past the fine-tune's), nor thinker verify, which passes
    # a folder with a note added and rewrites the card's checks, hides the change (both found by a QA run)
    with (tuned / "README.md").open("a") as card:
        card.write("Fine-tuned on my data.\n")
    (tuned / "README.md").chmod(0o600)
    assert thinker("verify", qwen3_source, noted).exit_code == 0
    before = digest(tmp_path)
    for folder, changed in ((tuned, "model.safetensors"), (noted, "notes.md")):
        result = thinker("convert", qwen3_source, folder, "--no-verify", "--force")
        assert_error(result, f"{folder}: not an earlier output of thinker (", changed, "changed after thinker wrote")
    assert digest(tmp_path) == before
    # a killed verify's half-written report is thinker's; a folder named like one is not
    stale = tmp_path / "stale"
    assert thinker("convert", qwen3_source, stale, "--no-verify").exit_code == 0
    (stale / ".parity.json.partial-999999").write_text("{")
    assert thinker("convert", qwen3_source, stale, "--no-verify", "--force").exit_code == 0
    (stale / ".notes.partial-999999").mkdir()
    result = thinker("convert", qwen3_source, stale, "--no-verify", "--force")
    assert_error(result, f"{stale}: not an earlier output of thinker (holds .notes.partial-999999)")

    verified = tmp_path / "verified"
    assert thinker("convert", qwen3_source, verified, "--no-verify").exit_code == 0
    assert thinker("verify", qwen3_source, verified).exit_code == 0  # writes parity.json and the card's checks
    assert (verified / "parity.json").is_file()
    replaced = thinker("convert", qwen3_source, verified, "--no-verify", "--force")
    assert replaced.exit_code == 0, replaced.output


def test_force_sees_a_card_note_a_file_added_in_the_same_tick_and_a_change_during_verify(
    qwen3_source, tmp_path, monkeypatch
):
    """Ways a QA run found past a change-time check alone: a note added to the card (deleted without a word); a file
    added in the tick thinker finished on a file system of whole seconds (no later time, but a name thinker did not
    write); a file saved into the folder while ``thinker verify`` ran (then recorded as thinker's). And a folder
    verified through a link stays replaceable."""
    import converter.convert as convert_module
    from thinker_common.card_format import Record, card_text, read_record, with_record
    from thinker_common.staging import not_an_earlier_output

    def output(name: str) -> Path:
        folder = tmp_path / name
        assert thinker("convert", qwen3_source, folder, "--no-verify").exit_code == 0
        assert not_an_earlier_output(folder) is None
        return folder

    noted = output("noted")
    with (noted / "README.md").open("a") as card:
        card.write("\n## My evaluation notes\n")
    assert "its README.md was edited after thinker wrote it" in not_an_earlier_output(noted)
    under_the_table = output("under-the-table")  # inside the checks section, where a note under the table lands
    card = (under_the_table / "README.md").read_text()
    end = "<!-- /thinker: checks -->"
    (under_the_table / "README.md").write_text(card.replace(end, f"Approved.\n{end}"))
    assert "its README.md was edited after thinker wrote it" in not_an_earlier_output(under_the_table)
    left = output("left")  # a killed verify's half-written report is thinker's: a verify after it records its own
    (left / ".parity.json.partial-999999").write_text("{")
    assert thinker("verify", qwen3_source, left).exit_code == 0 and not_an_earlier_output(left) is None
    (left / "parity.json").write_text("{}")  # as a verify killed before it recorded its report leaves it
    assert not_an_earlier_output(left) is None  # thinker's own report, never the user's: not a change

    same_tick = output("same-tick")
    (same_tick / "train_args.json").write_text("{}")
    record = read_record(same_tick)  # as on a file system of whole seconds: the new file no later than the record
    tick = Record(os.stat(same_tick / "train_args.json").st_ctime_ns, record.files, record.card)
    (same_tick / "README.md").write_text(with_record(card_text(same_tick), tick))
    assert "files added or removed after thinker wrote the folder" in not_an_earlier_output(same_tick)

    raced = output("raced")
    gate = convert_module.parity_gate

    def saving_meanwhile(*args, **kwargs):
        (raced / "notes.txt").write_text("mine")  # another terminal, while the check runs
        return gate(*args, **kwargs)

    monkeypatch.setattr(convert_module, "parity_gate", saving_meanwhile)
    assert thinker("verify", qwen3_source, raced).exit_code == 0
    monkeypatch.setattr(convert_module, "parity_gate", gate)
    assert "notes.txt changed after thinker wrote the folder" in not_an_earlier_output(raced)

    linked = output("linked")
    (tmp_path / "latest").symlink_to(linked, target_is_directory=True)
    assert thinker("verify", qwen3_source, tmp_path / "latest").exit_code == 0
    assert (linked / "parity.json").is_file() and not_an_earlier_output(linked) is None


def test_force_refuses_a_link_and_a_name_ending_in_dotdot(qwen3_source, qwen3_thinker, tmp_path, digest):
    """OUTPUT a link to an earlier output: --force would have put the new folder in the link's place and left the
    old output where the link led, silently. OUTPUT ending in '..' was found out only after the whole run, with a
    message about a folder the run had made itself. Both refused before any work, nothing touched."""
    real = tmp_path / "real"
    assert thinker("convert", qwen3_source, real, "--no-verify").exit_code == 0
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    before = digest(tmp_path)
    result = thinker("convert", qwen3_source, f"{link}/", "--no-verify", "--force")
    assert_error(result, f"{link}: not an earlier output of thinker (a link to {real}, which --force would replace")
    result = thinker("export", qwen3_thinker, tmp_path / "new" / "..", "--no-verify")
    assert_error(result, "OUTPUT ends in '..'; name the folder itself", str(tmp_path))
    assert digest(tmp_path) == before and link.is_symlink() and not (tmp_path / "new").exists()


def test_verify_report_never_lands_in_source_or_converted(qwen3_source, tmp_path, digest):
    """``--report`` named a file inside SOURCE (a report as its chat_template.jinja, which the next conversion copied)
    or inside CONVERTED, which it promises to leave as it is; and a folder where parity.json goes was found out after
    the whole check. Each refused before the check, nothing written."""
    source = tmp_path / "source"
    shutil.copytree(qwen3_source, source)
    converted = tmp_path / "converted"
    assert thinker("convert", source, converted, "--no-verify").exit_code == 0
    before = digest(tmp_path)
    for report, fragment in (
        (source / "chat_template.jinja", "--report lies inside the source"),
        (converted / "report.json", "inside CONVERTED"),
    ):
        assert_error(thinker("verify", source, converted, "--report", report), fragment)
    assert digest(tmp_path) == before
    (converted / "parity.json").mkdir()
    assert_error(thinker("verify", source, converted), "parity.json: a folder, where thinker verify writes")


def test_verify_keeps_a_card_that_is_not_utf8(qwen3_source, tmp_path):
    """A card edited in another encoding made ``thinker verify`` stop with a UnicodeDecodeError after it had
    rewritten parity.json: the checks section is replaced, every other byte kept."""
    converted = tmp_path / "converted"
    assert thinker("convert", qwen3_source, converted, "--no-verify").exit_code == 0
    card = converted / "README.md"
    card.write_bytes(card.read_bytes() + b"\nCaf\xe9 notes (latin-1)\n")
    result = thinker("verify", qwen3_source, converted)
    assert result.exit_code == 0, result.output
    text = card.read_bytes()
    assert text.endswith(b"Caf\xe9 notes (latin-1)\n") and b"converted with --no-verify" not in text


def test_force_looks_again_before_it_replaces(tmp_path):
    """What OUTPUT holds is checked again at the swap, after the work: a folder that took other contents meanwhile
    is refused there, both folders as they were."""
    from thinker_common.errors import ThinkerError
    from thinker_common.staging import install

    staging, output = tmp_path / ".staging", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    (output / "projects").mkdir(parents=True)
    (output / "config.json").write_text("{}")
    with pytest.raises(ThinkerError, match=r"out: not an earlier output of thinker \(holds projects\)"):
        install(staging, output, force=True)
    assert sorted(os.listdir(output)) == ["config.json", "projects"] and (staging / "config.json").is_file()


def test_a_250_character_output_name(qwen3_source, tmp_path):
    """The staging folder's name must stay within the file system's 255 bytes although OUTPUT's nearly fills them."""
    output = tmp_path / ("o" * 250)
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert (output / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == [output.name]
    result = thinker("convert", qwen3_source, output, "--no-verify", "--force")  # replacing it, too
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["convert", "export", "generate"])
def test_a_name_too_long_for_the_file_system(command, qwen3_source, tmp_path):
    """A 256-byte name (as OUTPUT, or as the folder to generate with): one line naming it and saying what to do,
    not the traceback of the OSError that the first look at it raises."""
    long = tmp_path / ("x" * 256)
    arguments = [long, "-p", "the cat"] if command == "generate" else [qwen3_source, long, "--no-verify"]
    result = thinker(command, *arguments)
    assert_error(result, "x" * 256, "File name too long; a name is longer than the file system takes")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("limit", ["half the weights", "less than the header", "a quarter, cast"])
def test_a_file_larger_than_the_file_system_takes(limit, qwen3_source, tmp_path):
    """A shard past the file-size limit (RLIMIT_FSIZE here, as FAT32's 4 GiB): one line naming the shard and what to
    do, nothing left. A limit the shard's header alone passes failed at its first write, whose error named no file
    ("File too large" and nothing more: a QA run)."""
    weights = sum(path.stat().st_size for path in qwen3_source.glob("*.safetensors"))
    file_size = {"half the weights": weights // 2, "less than the header": 100}.get(limit, weights // 4)
    cast = (
        ["--dtype", "bfloat16"] if limit == "a quarter, cast" else []
    )  # written from memory, not copied by the kernel
    result = run_cli("convert", qwen3_source, tmp_path / "out", "--no-verify", *cast, file_size=file_size)
    line = assert_process_error(result, "model.safetensors: File too large", "write to another file system")
    assert line.endswith("write to another file system, or with a smaller --max-shard-size")
    assert sorted(os.listdir(tmp_path)) == []


def test_an_export_larger_than_the_file_system_takes(qwen3_thinker, tmp_path):
    """The same for ``thinker export``: its weights file is named (a write's error names no file; it said only
    "File too large")."""
    weights = sum(path.stat().st_size for path in qwen3_thinker.glob("*.safetensors"))
    result = run_cli("export", qwen3_thinker, tmp_path / "out", "--no-verify", file_size=weights // 2)
    line = assert_process_error(result, "model.onnx.data: File too large", "write to another file system")
    assert "--max-shard-size" not in line  # a shard's remedy, no export option
    assert sorted(os.listdir(tmp_path)) == []


def test_an_exports_own_shards_past_the_limit_are_not_advised_a_shard_size(tmp_path):
    """The activation-aware scales stage a float32 copy of the weights in .safetensors shards: past the limit, the
    advice is the file system alone, as ``thinker export`` takes no --max-shard-size (a review: it advised one)."""
    from cli_helpers import save_word_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from converter.convert import convert

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "source")
    save_word_tokenizer(tmp_path / "source", config.vocab_size)
    thinker = convert(tmp_path / "source", tmp_path / "thinker", verify=False, progress=False).output
    weights = sum(path.stat().st_size for path in thinker.glob("*.safetensors"))  # bfloat16: half the staged copy
    options = ["--quantize", "int4", "--awq", "--no-verify"]
    result = run_cli("export", thinker, tmp_path / "onnx", *options, file_size=weights * 3 // 2)
    line = assert_process_error(result, "model.safetensors: File too large", "write to another file system")
    assert "--max-shard-size" not in line
    assert not (tmp_path / "onnx").exists()


def test_a_source_path_that_is_not_utf8(qwen3_source, tmp_path):
    """A folder name of bytes that are not UTF-8 (which Linux allows and safetensors cannot open) is named as the
    path's fault, not taken for a corrupt file to download again."""
    source = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/src\xff"))
    shutil.copytree(qwen3_source, source)
    result = thinker("convert", source, tmp_path / "out", "--no-verify")
    assert_error(result, "its path is not valid UTF-8, which safetensors cannot open; rename the folder")


def test_an_output_that_cannot_be_replaced_is_named(qwen3_source, tmp_path, monkeypatch):
    """--force onto an OUTPUT the swap cannot move (a mount point: EBUSY; an immutable folder: EPERM): one line
    naming OUTPUT, the old folder as it was, no staging folder left."""
    import errno

    import thinker_common.staging as staging

    output = earlier_output(tmp_path / "out", {"mine.txt": "kept"})  # which --force may replace

    def busy(first, second):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(second))

    monkeypatch.setattr(staging, "_exchange", busy)
    result = thinker("convert", qwen3_source, output, "--no-verify", "--force")
    assert_error(result, str(output), "cannot replace it (Device or resource busy)", "write to another path")
    assert sorted(os.listdir(output)) == ["README.md", "config.json", "mine.txt"] and sorted(os.listdir(tmp_path)) == [
        "out"
    ]


@pytest.mark.parametrize("force", [["--force"], []], ids=["force", "no-force"])
def test_an_output_that_is_a_mount_point_is_refused_as_such(force, qwen3_source, tmp_path, monkeypatch):
    """An empty folder that is a mount point: the same line with or without --force (without it, "pass --force"
    only led to this refusal), before any work."""
    output = tmp_path / "out"
    output.mkdir()
    mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == output or mount(path))
    result = thinker("convert", qwen3_source, output, "--no-verify", *force)
    assert_error(result, f"{output}: OUTPUT is a mount point, which cannot be replaced", "write into a folder inside")
    assert sorted(os.listdir(tmp_path)) == ["out"] and not os.listdir(output)


# --- symlinks (issue 16) -------------------------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside every checkpoint that must never reach an OUTPUT."""
    path = tmp_path / "home" / ".ssh" / "id_rsa"
    path.parent.mkdir(parents=True)
    path.write_text("-----BEGIN OPENSSH PRIVATE KEY----- not to be published\n")
    return path


def assert_secret_absent(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert b"PRIVATE KEY" not in path.read_bytes() or ".ssh" in path.parts, path


@pytest.mark.parametrize("name", ["merges.txt", "vocab.txt", "tokenizer.json"])
def test_convert_refuses_a_tokenizer_file_linking_outside(name, source_copy, secret, tmp_path):
    source = source_copy()
    (source / name).unlink(missing_ok=True)
    (source / name).symlink_to(secret)
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify"), str(source / name), "outside", str(source))
    assert_nothing_written(output)
    assert_secret_absent(tmp_path)


def test_export_refuses_a_side_file_linking_outside(qwen3_thinker, secret, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    (folder / "merges.txt").symlink_to(secret)
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), str(folder / "merges.txt"), "outside")
    assert_nothing_written(output)
    assert_secret_absent(tmp_path)


def test_weights_linking_outside_are_refused(source_copy, tmp_path):
    source = source_copy()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(source / "model.safetensors", elsewhere / "model.safetensors")
    (source / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify"), str(source / "model.safetensors"), "outside")
    assert_nothing_written(output)


def test_a_shard_folder_linking_outside_is_refused(source_copy, tmp_path):
    source = source_copy()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(source / "model.safetensors", elsewhere / "model.safetensors")
    (source / "shards").symlink_to(elsewhere, target_is_directory=True)
    from safetensors import safe_open

    with safe_open(elsewhere / "model.safetensors", "pt") as handle:
        names = list(handle.keys())
    index = {"weight_map": {name: "shards/model.safetensors" for name in names}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    output = tmp_path / "out"
    assert_error(thinker("convert", source, output, "--no-verify"), "shards/model.safetensors", "outside")
    assert_nothing_written(output)


def test_symlinks_inside_the_folder_are_followed(source_copy, tmp_path):
    source = source_copy()
    (source / "files").mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.move(source / name, source / "files" / name)
        (source / name).symlink_to(Path("files") / name)  # relative, as the Hub cache writes them
    output = tmp_path / "out"
    result = thinker("convert", source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert (output / "tokenizer.json").is_file() and not (output / "tokenizer.json").is_symlink()


def test_the_hub_cache_layout_keeps_working(fake_hub, qwen3_source, tmp_path):
    """A snapshot's files are symlinks into the cache's blobs/: through the repo id and through the folder path."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    result = thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "by-id", "--no-verify")
    assert result.exit_code == 0, result.output
    (snapshot,) = (fake_hub.cache / "models--tiny-org--tiny-qwen3" / "snapshots").iterdir()
    assert (snapshot / "model.safetensors").is_symlink()
    for command in ("convert", "export"):
        result = thinker(command, snapshot, tmp_path / f"by-path-{command}", "--no-verify")
        assert result.exit_code == 0, result.output
    assert (tmp_path / "by-path-convert" / "tokenizer.json").is_file()


def test_a_repo_folder_kept_elsewhere_by_a_symlink(fake_hub, qwen3_source, tmp_path):
    """A cached repo folder moved to another disk and linked back (``models--owner--name`` a symlink): its snapshot
    links lead into the moved folder's blobs/, which are the repo's own, so the folder path converts, whichever
    order the process's hashing gives (the check once took either form of the path at random); OUTPUT inside the
    moved repo folder is refused as inside the cache."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    assert thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "first", "--no-verify").exit_code == 0
    repo = fake_hub.cache / "models--tiny-org--tiny-qwen3"
    moved = tmp_path / "big-disk" / repo.name
    moved.parent.mkdir()
    shutil.move(repo, moved)
    repo.symlink_to(moved, target_is_directory=True)
    (snapshot,) = (repo / "snapshots").iterdir()
    result = thinker("convert", snapshot, tmp_path / "by-path", "--no-verify")
    assert result.exit_code == 0, result.output
    code = (
        "import sys; from pathlib import Path; from thinker_common.source_files import checked_file\n"
        "checked_file(Path(sys.argv[1]) / 'model.safetensors', Path(sys.argv[1]))"
    )
    for seed in range(4):  # the former check passed or failed by the set order of two paths, so by hash seed
        done = subprocess.run(
            [sys.executable, "-c", code, str(snapshot)],
            env={**os.environ, "PYTHONHASHSEED": str(seed)}, cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    inside = moved / "out"
    assert_error(thinker("convert", snapshot, inside, "--no-verify"), str(inside), "inside the Hugging Face cache")


@pytest.mark.parametrize("command", ["convert", "export"])
def test_output_never_lies_in_the_hub_cache_of_its_source(command, fake_hub, qwen3_source, tmp_path, digest):
    """A Hub source's bytes live in the cache's blobs/, outside the snapshot folder its links sit in: OUTPUT there,
    even with --force, would delete them (and leave every snapshot of the repo dangling)."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    assert thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "first", "--no-verify").exit_code == 0
    blobs = fake_hub.cache / "models--tiny-org--tiny-qwen3" / "blobs"
    (snapshot,) = (blobs.parent / "snapshots").iterdir()
    source = "tiny-org/tiny-qwen3" if command == "convert" else snapshot
    before = digest(fake_hub.cache)
    for output in (blobs, blobs / "new-folder", blobs.parent / "refs", fake_hub.cache / "another"):
        assert_error(
            thinker(command, source, output, "--no-verify", "--force"), str(output), "inside the Hugging Face cache"
        )
    assert digest(fake_hub.cache) == before


def test_a_snapshot_linking_outside_its_cache_is_refused(fake_hub, qwen3_source, secret, tmp_path):
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    assert thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "first", "--no-verify").exit_code == 0
    (snapshot,) = (fake_hub.cache / "models--tiny-org--tiny-qwen3" / "snapshots").iterdir()
    (snapshot / "merges.txt").symlink_to(secret)
    output = tmp_path / "out"
    assert_error(thinker("convert", snapshot, output, "--no-verify"), "merges.txt", "outside")
    assert_nothing_written(output)


def test_a_folder_laid_out_like_a_cache_reaches_no_file_beside_its_blob_stores(source_copy, secret, tmp_path):
    """A snapshot's links are followed into its cache's blob stores only, not into the whole folder above
    ``models--owner--name``: a stranger's folder laid out like a cache, extracted into the home folder, linked
    ``merges.txt`` to ``~/.ssh/id_rsa`` and the key was converted into OUTPUT (helper-253). Its own blobs/ serve."""
    home = secret.parent.parent
    snapshot = home / "models--stranger--tiny" / "snapshots" / "main"
    shutil.copytree(source_copy(), snapshot)
    (snapshot / "merges.txt").unlink(missing_ok=True)
    (snapshot / "merges.txt").symlink_to(Path("..", "..", "..", ".ssh", "id_rsa"))
    output = tmp_path / "out"
    assert_error(thinker("convert", snapshot, output, "--no-verify"), "merges.txt", "outside")
    assert_nothing_written(output)
    assert_secret_absent(tmp_path)

    (snapshot / "merges.txt").unlink()  # the same file through the repo's blob store, as huggingface_hub links it
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir()
    (snapshot / "tokenizer.json").rename(blobs / "0123abcd")
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", "0123abcd"))
    result = thinker("convert", snapshot, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert (output / "tokenizer.json").is_file() and not (output / "tokenizer.json").is_symlink()


# --- what is not a regular file (issues 15 and 16) ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_named_pipe_is_refused_not_read(name, source_copy, tmp_path):
    """Reading a named pipe blocks until someone writes to it: the run would hang forever."""
    source = source_copy()
    (source / name).unlink()
    os.mkfifo(source / name)
    output = tmp_path / "out"
    result = thinker_meeting_pipes("convert", source, output, "--no-verify", pipes=[source / name])
    assert_error(result, str(source / name), "pipe")
    assert_nothing_written(output)


# safetensors opens a file in Rust without releasing the GIL: a run that opened a pipe as weights would stop this
# process's every thread, the watchdog's too, so these two run the command in a real process; the two processes are
# started at once (``cli_helpers.side_by_side``), each on folders of its own.
@pytest.fixture(scope="module")
def pipe_runs(qwen3_source, tmp_path_factory) -> dict[str, tuple[Future, Path, Path]]:
    """Name -> (the run, the named pipe it was given, its OUTPUT)."""
    weights = tmp_path_factory.mktemp("pipe-as-weights")
    source = shutil.copytree(qwen3_source, weights / "source")
    (source / "model.safetensors").unlink()
    os.mkfifo(source / "model.safetensors")
    given = tmp_path_factory.mktemp("pipe-as-source")
    os.mkfifo(given / "model.safetensors")
    runs = {
        "as weights": (source / "model.safetensors", ["convert", source, weights / "out", "--no-verify"]),
        "as source": (given / "model.safetensors", ["convert", given / "model.safetensors", given / "out"]),
    }
    jobs = {name: partial(run_cli, *args, timeout=120) for name, (_, args) in runs.items()}
    with side_by_side(jobs) as started:
        yield {name: (started[name], pipe, Path(args[2])) for name, (pipe, args) in runs.items()}


def test_a_named_pipe_as_weights_is_refused_not_read(pipe_runs):
    started, pipe, output = pipe_runs["as weights"]
    done = started.result()
    assert_process_error(done, str(pipe), "pipe")
    assert_nothing_written(output)


def test_a_named_pipe_given_as_source_is_refused(pipe_runs):
    started, _, _ = pipe_runs["as source"]
    done = started.result()
    assert_process_error(done, "model.safetensors", "pipe")


def test_a_folder_named_like_the_weights(source_copy, tmp_path):
    source = source_copy()
    (source / "model.safetensors").unlink()
    (source / "model.safetensors").mkdir()
    result = thinker("convert", source, tmp_path / "out", "--no-verify")
    message = assert_error(result, str(source / "model.safetensors"), "a folder, not a regular file")
    assert "truncated" not in message


def test_a_broken_symlink_is_named(source_copy, tmp_path):
    source = source_copy()
    (source / "vocab.json").symlink_to(source / "nowhere.json")
    assert_error(thinker("convert", source, tmp_path / "out", "--no-verify"), str(source / "vocab.json"), "broken")


def test_a_fifo_config_in_a_thinker_folder(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    pipe = folder / "generation_config.json"
    pipe.unlink()
    os.mkfifo(pipe)
    result = thinker_meeting_pipes("export", folder, tmp_path / "onnx", "--no-verify", pipes=[pipe])
    assert_error(result, "generation_config.json", "pipe")


def test_a_path_too_long_whose_names_all_fit(qwen3_source, tmp_path):
    """From a QA sweep: every name under 255 bytes, the whole path past Linux's 4096: the advice blamed a name."""
    long = tmp_path.joinpath(*["d" * 200] * 22, "out")
    result = thinker("convert", qwen3_source, long, "--no-verify")
    assert_error(result, "File name too long; the whole path is longer than the system takes (4096 bytes)")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_source_cut_short_during_the_run_is_named_as_such(source_copy, tmp_path, monkeypatch):
    """A source file truncated after the converter read it and before the reference loads it (a re-download racing
    the run): the file is named as cut short, to download again; it was "the reference model does not load with
    transformers ... convert with --no-verify", advice a rerun then refused anyway."""
    from converter import convert

    source = source_copy()
    checked = convert.parity_gate

    def cut_first(*args, **kwargs):
        weights = source / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        return checked(*args, **kwargs)

    monkeypatch.setattr(convert, "parity_gate", cut_first)
    result = thinker("convert", source, tmp_path / "out")
    assert_error(result, f"{source / 'model.safetensors'}: not a readable safetensors file", "truncated", "re-download")
    assert_nothing_written(tmp_path / "out")


def test_force_without_an_atomic_exchange_leaves_only_the_new_output(qwen3_source, tmp_path, monkeypatch):
    """Where renameat2 is missing (another OS, an old kernel, a file system without it), --force moves the old
    OUTPUT aside, renames the new one into place, then removes the old: OUTPUT is the new conversion and nothing
    else is left beside it (a mutation that kept the moved-aside folder passed every test)."""
    import thinker_common.staging as staging

    output = earlier_output(tmp_path / "out", {"mine.txt": "replaced"})
    monkeypatch.setattr(staging, "_exchange", lambda first, second: False)
    monkeypatch.setattr(staging, "_renameat2", lambda first, second, flags: False)
    result = thinker("convert", qwen3_source, output, "--no-verify", "--force")
    assert result.exit_code == 0, result.output
    assert "mine.txt" not in os.listdir(output) and (output / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]


# --- what a folder's links may reach (helper-244) -------------------------------------------------------------------


def fake_cache(root: Path) -> tuple[Path, Path]:
    """root/cache/models--o--n/{blobs/b, snapshots/c/config.json -> ../../blobs/b}: (cache, snapshot)."""
    repo = root / "cache" / "models--o--n"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "b").write_text("{}")
    snapshot = repo / "snapshots" / "c"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("../../blobs/b"))
    return root / "cache", snapshot


def test_a_folder_named_snapshots_outside_a_cache_grants_nothing(tmp_path):
    """Only a models--/datasets--/spaces-- repo folder makes a Hub cache whose blobs a snapshot's links may reach:
    /data/mine/snapshots/v1 is a plain folder, and a link out of it is refused (a pattern taking any name passed every
    test: helper-244)."""
    (tmp_path / "secret.txt").write_text("key")
    folder = tmp_path / "mine" / "snapshots" / "v1"
    folder.mkdir(parents=True)
    (folder / "merges.txt").symlink_to(tmp_path / "secret.txt")
    assert hub_caches_of(folder) == []
    with pytest.raises(ThinkerError, match="outside"):
        checked_file(folder / "merges.txt", folder)


def test_an_optional_file_that_is_a_broken_symlink_is_an_error(tmp_path):
    """An optional file that is a broken link is named, not taken for absent."""
    (tmp_path / "generation_config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(ThinkerError, match="broken symlink"):
        present(tmp_path / "generation_config.json", tmp_path)


def test_a_symlink_to_a_snapshot_reads_the_snapshots_blobs(tmp_path):
    """SOURCE named through a link to a Hub snapshot (~/qwen -> cache/.../snapshots/c) still reads its blobs."""
    cache, snapshot = fake_cache(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(snapshot)
    assert hub_caches_of(alias) == [cache.resolve()]
    assert checked_file(alias / "config.json", alias) == alias / "config.json"
