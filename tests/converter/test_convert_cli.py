"""``thinker-convert`` and ``thinker verify`` as users run them: click's runner, a real subprocess, a Hub repo id."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from convert_helpers import QWEN2
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import Qwen3Config

from converter.cli import CONVERT_HELP, convert_command, verify_command
from converter.parity_report import IDENTICAL
from thinker_common.errors import ThinkerError

QWEN3 = Qwen3Config(**QWEN2, head_dim=8)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def source(save_reference) -> Path:
    return save_reference(QWEN3)[1]


def test_convert_prints_the_parity_table(source, tmp_path):
    result = CliRunner().invoke(convert_command, [str(source), str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert "parity (whole-model): ThinkerForCausalLM vs Qwen3ForCausalLM" in result.stdout
    assert "float32" in result.stdout and "pass" in result.stdout
    assert json.loads((tmp_path / "out" / "parity.json").read_text())["passed"] is True
    assert "as the folder stores them" not in result.stdout  # float32: the rows compare the weights as stored


def test_the_cards_parity_table_shows_each_figure_in_its_column():
    """The card's row puts max |Δlogit| before mean |Δlogit|, as its header does: swapped, the smaller mean passed
    for the max (tiny float32 conversions give 0 for both, so the figures here are planted and distinct)."""
    from converter.model_card import parity_section
    from converter.parity_report import DtypeParity, ParityReport

    result = DtypeParity("float32", 3e-5, 1e-6, 10.0, 1e-3, 1.0, 4, 4, 1.0, passed=True)
    card = parity_section(ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [result]), "")
    lines = card.splitlines()
    header = next(line for line in lines if line.startswith("| dtype"))
    row = next(line for line in lines if line.startswith("| float32"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert header.startswith(r"| dtype | max \|Δlogit\| | mean \|Δlogit\| | tolerance |"), header
    assert cells[:4] == ["float32", "3e-05", "1e-06", "0.001"], cells


def test_an_eos_id_outside_the_vocabulary_is_said(save_reference, tmp_path):
    """A stop id no model of the vocabulary can produce converts (the configs are the source's) with a note, since
    generation would never stop at it; ids inside the vocabulary get none."""
    fine = CliRunner().invoke(convert_command, [str(save_reference(QWEN3, "fine")[1]), str(tmp_path / "fine-out")])
    assert fine.exit_code == 0 and "outside its vocabulary" not in fine.stderr, fine.output
    config = Qwen3Config(**{**QWEN3.to_dict(), "eos_token_id": [3, 64], "bos_token_id": 1})
    result = CliRunner().invoke(convert_command, [str(save_reference(config, "past")[1]), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "the source's eos_token_id 64 is outside its vocabulary of 64 ids, where the model never produces it" in (
        " ".join(result.stderr.split())
    )


def test_a_half_precision_conversion_says_what_its_rows_compare(source, tmp_path):
    """Both sides hold the weights rounded to the folder's dtype, so a float32 row at 0 proves the mapping, not a
    lossless cast: the table, parity.json and the card say so."""
    from huggingface_hub import ModelCard

    output = tmp_path / "out"
    result = CliRunner().invoke(convert_command, [str(source), str(output), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    note = (
        "Both models hold the weights as the folder stores them, in bfloat16 (or wider, where it stores a tensor "
        "wider): the float32 row proves the mapping"
    )
    assert note in result.stdout
    assert json.loads((output / "parity.json").read_text())["rounding_note"].startswith(note)
    assert note in ModelCard.load(output / "README.md").text


def test_user_errors_are_one_red_line_and_exit_1(source, tmp_path):
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(convert_command, [str(source), str(tmp_path / "out")], color=True)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "already exists; pass --force" in lines[0]
    assert lines[0].startswith("\x1b[31m")  # red
    assert "Traceback" not in result.output


def test_debug_shows_the_exception(source, tmp_path):
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(convert_command, [str(source), str(tmp_path / "out"), "--debug"])
    assert result.exit_code == 1 and isinstance(result.exception, ThinkerError)


@pytest.mark.parametrize(
    "options", [["--dtype", "float8"], ["--max-shard-size", "huge"], []], ids=["dtype", "shard-size", "no-output"]
)
def test_usage_errors_exit_2(source, tmp_path, options):
    arguments = [str(source)] + ([str(tmp_path / "out")] if options else []) + options
    assert CliRunner().invoke(convert_command, arguments).exit_code == 2


def test_help_teaches(tmp_path):
    text = CliRunner().invoke(convert_command, ["--help"]).output
    for expected in ("Examples:", "Qwen/Qwen3-0.6B", "--max-shard-size", "--no-verify", "available", "--force"):
        assert expected in text, expected
    assert "parity.json" in CliRunner().invoke(verify_command, ["--help"]).output


def test_the_module_runs_as_the_console_script(tmp_path):
    """``python -m converter.cli`` is ``thinker-convert``: it printed nothing and exited 0, a run that converts
    nothing passing for one that did (a QA run)."""
    run = [sys.executable, "-m", "converter.cli"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "Examples:" in shown.stdout
    missing = subprocess.run(
        [*run, str(tmp_path / "nowhere"), str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode != 0 and "nowhere" in missing.stderr and not (tmp_path / "out").exists()


def test_help_lists_every_registered_family():
    """The help's family list is written out (so that --help imports no family table) and held to the registry
    here: a family added without its line, or a line left behind, fails. The GGUF families share one line."""
    from converter.families import FAMILIES

    section = CONVERT_HELP.split("Supported families:")[1].split("The last two")[0]
    listed = {line.split()[0] for line in section.splitlines() if re.match(r"  \S", line)}
    flat = " ".join(section.split())
    names = {"gguf-*" if family.name.startswith("gguf-") else family.name for family in FAMILIES}
    assert listed == names
    for family in FAMILIES:
        description = family.description.split(", ")[0] if family.name.startswith("gguf-") else family.description
        assert description in flat, f"{family.name}: {description!r} is not in thinker-convert --help"


def test_real_subprocess_with_sharded_output_and_dtype(source, tmp_path):
    command = [sys.executable, "-c", "from converter.cli import convert_command; convert_command()"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path / "hf-home")}
    output = tmp_path / "out"
    arguments = [str(source), str(output), "--dtype", "bfloat16", "--max-shard-size", "10KB", "--no-verify"]
    done = subprocess.run(command + arguments, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "converted" in done.stdout and "bfloat16" in done.stdout
    assert (output / "model.safetensors.index.json").is_file()

    failed = subprocess.run(command + arguments, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines() == [
        f"error: {output} already exists; pass --force to replace it once the new conversion is complete"
    ]


def test_verify_standalone_passes_then_names_the_broken_layer(source, tmp_path):
    runner = CliRunner()
    converted = tmp_path / "out"
    assert runner.invoke(convert_command, [str(source), str(converted), "--no-verify"]).exit_code == 0
    assert not (converted / "parity.json").exists()

    result = runner.invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 0, result.output
    assert "parity holds" in result.stdout and (converted / "parity.json").is_file()

    weights = load_file(converted / "model.safetensors")
    original = dict(weights)
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"] * 1.5
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 1
    assert "FAIL (first divergence: layer 1)" in result.stdout
    assert "does not match its reference" in result.stderr
    assert "the report is in parity.failed.json, and parity.json is kept as it was" in result.stderr
    # the failing report beside the passing one, which stays the record of the check that passed
    assert json.loads((converted / "parity.failed.json").read_text())["passed"] is False
    assert json.loads((converted / "parity.json").read_text())["passed"] is True

    save_file(original, converted / "model.safetensors", metadata={"format": "pt"})  # repaired: the record follows
    assert runner.invoke(verify_command, [str(source), str(converted)]).exit_code == 0
    assert json.loads((converted / "parity.json").read_text())["passed"] is True
    assert not (converted / "parity.failed.json").exists()


def test_verify_names_a_weight_edited_below_the_parity_tolerance(source, tmp_path):
    """From a QA sweep at size: one row scaled by 1.0001 moved the logits by a tenth of the tolerance and passed
    ``thinker verify``. The exact check compares every tensor with what converting the source writes, bit for bit:
    the row is named, the report fails with the logits passing, and parity.json stays the record it was. The edit is
    one value moved by one float32 step, which no cast to a narrower dtype keeps (a check comparing bytes after
    such a cast passed a whole row scaled by 1.0001, a mutation run)."""
    runner = CliRunner()
    converted = tmp_path / "out"
    assert runner.invoke(convert_command, [str(source), str(converted)]).exit_code == 0
    name = "model.layers.1.mlp.down_proj.weight"
    weights = load_file(converted / "model.safetensors")
    weights[name][3, 0] = torch.nextafter(weights[name][3, 0], torch.tensor(float("inf")))
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 1, result.output
    assert f"tensor {name!r} is not what converting {source} writes (row 3 of" in result.stderr, result.stderr
    assert "FAIL" not in result.stdout and "weights: " in result.stdout  # the logits agree within the tolerance
    failed = json.loads((converted / "parity.failed.json").read_text())
    assert failed["passed"] is False and all(row["passed"] for row in failed["results"]), failed
    assert "row 3 of" in failed["weights"]
    assert json.loads((converted / "parity.json").read_text())["weights"] is None  # the conversion's own record


def test_verify_takes_a_folder_converted_to_a_narrower_dtype(source, tmp_path):
    """``--dtype bfloat16`` from a float32 source: the exact check compares the folder with converting the source at
    the dtype the folder stores, not at auto's float32, so a correct folder passes with its weights identical."""
    runner = CliRunner()
    converted = tmp_path / "out"
    arguments = [str(source), str(converted), "--dtype", "bfloat16", "--no-verify"]
    assert runner.invoke(convert_command, arguments).exit_code == 0
    result = runner.invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 0, result.output
    assert json.loads((converted / "parity.json").read_text())["weights"] == IDENTICAL


def folder_state(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(folder.iterdir())}


def test_verify_with_report_leaves_the_folder_as_it_was(source, tmp_path, monkeypatch):
    """``--report PATH``: the report, passing or failing, goes to PATH alone and CONVERTED is only read; a folder
    that is not writable, without it, is refused before the check runs, naming the option."""
    import converter.convert

    runner = CliRunner()
    converted = tmp_path / "out"
    assert runner.invoke(convert_command, [str(source), str(converted), "--no-verify"]).exit_code == 0
    before = folder_state(converted)

    result = runner.invoke(verify_command, [str(source), str(converted), "--report", str(tmp_path / "passed.json")])
    assert result.exit_code == 0, result.output
    assert f"parity holds; wrote {tmp_path / 'passed.json'}" in result.stdout
    assert json.loads((tmp_path / "passed.json").read_text())["passed"] is True
    assert folder_state(converted) == before

    again = runner.invoke(verify_command, [str(source), str(converted), "--report", str(tmp_path / "passed.json")])
    assert again.exit_code == 1 and "passed.json: exists, and a report is never written over" in again.stderr
    empty = runner.invoke(verify_command, [str(source), str(converted), "--report", ""])  # not the working directory
    assert empty.exit_code == 2 and "'--report': an empty path; name a new JSON file" in empty.stderr
    nowhere = runner.invoke(verify_command, [str(source), str(converted), "--report", str(tmp_path / "no/r.json")])
    assert nowhere.exit_code == 1 and f"{tmp_path / 'no'} is not a folder" in nowhere.stderr

    broken = shutil.copytree(converted, tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 1.5
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    before = folder_state(broken)
    result = runner.invoke(verify_command, [str(source), str(broken), "--report", str(tmp_path / "failed.json")])
    assert result.exit_code == 1
    assert f"the report is in {tmp_path / 'failed.json'}" in result.stderr
    assert json.loads((tmp_path / "failed.json").read_text())["passed"] is False
    assert folder_state(broken) == before

    # Not writable (a read-only mount; as root the mode bits would not stop a write, so os.access says it here).
    checked = []
    monkeypatch.setattr(converter.convert, "parity_gate", lambda *args, **kwargs: checked.append(args))
    access = os.access
    monkeypatch.setattr(
        converter.convert.os,
        "access",
        lambda path, mode: access(path, mode) and not (mode & os.W_OK and path == converted),
    )
    result = runner.invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 1 and not checked
    assert result.stderr.strip() == (
        f"error: {converted}: not writable, and thinker verify writes its report (parity.json) there; give --report "
        "PATH to write it elsewhere and leave the folder as it is"
    )


def test_verify_refuses_a_folder_it_would_not_prove(source, tmp_path):
    """What the parity check cannot see is refused before it runs: a renamed tensor (transformers would load the
    folder with that weight freshly initialised, a norm's ones equal to the source's, so the check passed), modeling
    code other than the installed Thinker's (which the check runs, not the folder's), a folder without weights, a
    Hugging Face checkpoint in CONVERTED's place, tokenizer files other than the source's."""
    import shutil

    runner = CliRunner()
    source = shutil.copytree(source, tmp_path / "with-tokenizer")
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    converted = tmp_path / "out"
    assert runner.invoke(convert_command, [str(source), str(converted), "--no-verify"]).exit_code == 0

    def verify(folder: Path) -> str:
        result = runner.invoke(verify_command, [str(source), str(folder)])
        assert result.exit_code == 1 and not (folder / "parity.json").exists(), result.output
        return result.stderr

    renamed = shutil.copytree(converted, tmp_path / "renamed")
    weights = load_file(renamed / "model.safetensors")
    norm = "model.layers.0.input_layernorm.weight"
    weights[f"{norm}_renamed"] = weights.pop(norm)
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    assert f"the folder lacks {norm}" in verify(renamed)

    edited = shutil.copytree(converted, tmp_path / "edited")
    (edited / "modeling_thinker.py").write_text((edited / "modeling_thinker.py").read_text() + "\n# edited\n")
    assert "modeling_thinker.py: not the installed Thinker's modeling_thinker.py" in verify(edited)
    (edited / "modeling_thinker.py").unlink()  # a pass before: the folder then loads only where thinker is installed
    assert "lacks modeling_thinker.py, which trust_remote_code=True loads" in verify(edited)

    retokenized = shutil.copytree(converted, tmp_path / "retokenized")  # the parity check feeds ids, not text
    (retokenized / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    assert "tokenizer_config.json: not the source's tokenizer_config.json" in verify(retokenized)
    (retokenized / "tokenizer_config.json").unlink()
    assert "lacks tokenizer_config.json, which its source gives" in verify(retokenized)
    templated = shutil.copytree(converted, tmp_path / "templated")  # a file beside the source's (found by a QA run)
    (templated / "chat_template.jinja").write_text("{{ messages }}")
    assert "chat_template.jinja: a tokenizer file its source does not give" in verify(templated)
    (templated / "chat_template.jinja").unlink()  # a named template too, in the folder transformers reads it from
    (templated / "additional_chat_templates").mkdir()
    (templated / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert "tool_use.jinja: a tokenizer file its source does not give" in verify(templated)

    empty = shutil.copytree(converted, tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    assert "a Thinker folder without its weights (no *.safetensors); convert it again" in verify(empty)

    assert "a qwen3 checkpoint, not a Thinker folder" in verify(shutil.copytree(source, tmp_path / "a copy"))

    exported = shutil.copytree(empty, tmp_path / "exported")  # an ONNX export's folder: the Thinker's config.json
    (exported / "model.onnx").write_bytes(b"")
    assert "an ONNX export, not a Thinker folder" in verify(exported)

    assert runner.invoke(verify_command, [str(source), str(converted)]).exit_code == 0  # the folder as written


def test_hub_repo_id_through_a_local_endpoint(fake_hub, save_reference, tmp_path):
    _, folder = save_reference(QWEN3, name="hub-source")
    (folder / "tokenizer.json").write_text(Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str())
    fake_hub.add_repo("tiny-org/tiny-qwen3", folder)
    result = CliRunner().invoke(convert_command, ["tiny-org/tiny-qwen3", str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert any(request.path.endswith("model.safetensors") for request in fake_hub.file_requests("GET"))


def test_convert_from_python_takes_a_torch_dtype(qwen3_source, tmp_path):
    """``convert`` and ``load_thinker`` name the dtype as transformers' ``dtype=`` does, a torch.dtype too."""
    import torch

    from converter.convert import convert
    from converter.load import load_thinker

    result = convert(qwen3_source, tmp_path / "out", dtype=torch.bfloat16, verify=False, progress=False)
    assert result.dtype == "bfloat16"
    assert load_thinker(qwen3_source, dtype=torch.float16).dtype == torch.float16


def test_the_model_card_says_where_the_weights_came_from_and_what_was_checked(fake_hub, save_reference, tmp_path):
    """The Thinker folder's README.md: huggingface_hub's card metadata (base_model the Hub repo, the source card's
    license carried, the source's LICENSE file copied), and the parity figures of parity.json; a --no-verify
    conversion's card says it was not checked, and a later passing `thinker verify` writes the figures into it."""
    from huggingface_hub import ModelCard

    _, folder = save_reference(QWEN3, name="hub-card")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# Tiny Qwen3\n")
    (folder / "LICENSE").write_text("Apache License, Version 2.0")
    (folder / "NOTICE").write_text("Copyright the authors")  # Apache-2.0 4(d): it travels with the weights too
    fake_hub.add_repo("tiny-org/tiny-qwen3", folder)
    output = tmp_path / "out"
    assert CliRunner().invoke(convert_command, ["tiny-org/tiny-qwen3", str(output)]).exit_code == 0
    card = ModelCard.load(output / "README.md")
    assert card.data.base_model == "tiny-org/tiny-qwen3" and card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.language == ["en"]
    assert set(card.data.tags) == {"thinker", "qwen3"}
    assert (output / "LICENSE").read_text() == "Apache License, Version 2.0"
    assert (output / "NOTICE").read_text() == "Copyright the authors"
    (result,) = json.loads((output / "parity.json").read_text())["results"]
    figures = f"{result['max_abs_diff']:.3g} | {result['mean_abs_diff']:.3g} | {result['tolerance']:.2g}"
    row = f"| float32 | {figures} | 100.0% | 4/4 | pass |"
    assert row in card.text, card.text
    assert 'from_pretrained("out"' in card.text and "[`tiny-org/tiny-qwen3`](https://huggingface.co/" in card.text

    unchecked = tmp_path / "unchecked"
    assert CliRunner().invoke(convert_command, ["tiny-org/tiny-qwen3", str(unchecked), "--no-verify"]).exit_code == 0
    assert "Not checked: converted with --no-verify" in (unchecked / "README.md").read_text()
    assert CliRunner().invoke(verify_command, ["tiny-org/tiny-qwen3", str(unchecked)]).exit_code == 0
    text = (unchecked / "README.md").read_text()
    assert "Not checked" not in text and row in text
    assert ModelCard.load(unchecked / "README.md").data.license == "apache-2.0"  # the rest of the card as it was


@pytest.mark.parametrize("tokenizer", ["tokenizer", "weights-only", "template-only"])
def test_the_cards_usage_snippet_runs_as_written(tokenizer, save_reference, tmp_path, monkeypatch):
    """The card's Python snippet, run from the folder holding the conversion: with the source's tokenizer it loads
    both; a weights-only source's card shows no tokenizer (it showed AutoTokenizer, which then failed, a QA run
    found) and says so, as does one whose tokenizer files hold no vocabulary (a chat template alone)."""
    from cli_helpers import save_word_tokenizer

    _, source = save_reference(QWEN3, name="source")
    with_tokenizer = tokenizer == "tokenizer"
    if with_tokenizer:
        save_word_tokenizer(source, QWEN3.vocab_size)
    elif tokenizer == "template-only":
        (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    result = CliRunner().invoke(convert_command, [str(source), str(tmp_path / "out"), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert ("the source has no tokenizer (no tokenizer.json, " in result.output) is not with_tokenizer
    card = (tmp_path / "out" / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    assert ("AutoTokenizer" in snippet) is with_tokenizer
    assert ("carries no tokenizer" in card) is not with_tokenizer
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(snippet, names)  # the card's own words
    assert names["model"].config.model_type == "thinker"
    if with_tokenizer:
        assert names["tokenizer"]("the cat").input_ids


def test_verify_without_a_reference_does_not_advise_converting(save_reference, run_convert, tmp_path, monkeypatch):
    """Where transformers cannot load the reference, the conversion's advice is to convert with --no-verify; thinker
    verify, on a folder already so converted, says the folder stays unverified (it repeated the conversion's words,
    a QA run found, on a GGUF of F64 tensors)."""
    from converter import parity

    _, source = save_reference(QWEN3, name="source")
    converted = run_convert(source, verify=False).output

    def unloadable(*args, **kwargs):
        raise NotImplementedError("Dequantization for F64 is not yet implemented")

    monkeypatch.setattr(parity.AutoModelForCausalLM, "from_pretrained", unloadable)
    result = CliRunner().invoke(verify_command, [str(source), str(converted)])
    assert result.exit_code == 1, result.output
    assert "the reference model does not load with transformers" in result.output, result.output
    assert f"leave {converted} unverified" in result.output and "--no-verify" not in result.output, result.output
