"""The model cards (converter/model_card.py, thinker_common/model_card.py) where a planted bug passed the other tests:
the parity section's figures and rules for what the report holds, the local source's name, the way back's card, the
GGUF's own license and languages, the Hub repo a folder is, and the checks section a later ``thinker verify`` finds."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from converter.model_card import (
    gguf_card_metadata,
    parity_criteria,
    parity_section,
    update_parity,
    write_thinker_card,
    write_way_back_card,
)
from converter.parity_report import (
    BY_LAYER,
    GREEDY_TOKENS,
    LAYER_DECODE_STEPS,
    WHOLE_MODEL,
    DtypeParity,
    ParityReport,
)
from thinker_common.model_card import hub_repo_of, in_hub_snapshot, write_card


def passing(dtype: str, greedy: int | None = 4) -> DtypeParity:
    """A passing row with distinct planted figures (``greedy``: prompts whose continuation agreed, of 4)."""
    prompts = None if greedy is None else 4
    return DtypeParity(dtype, 3e-5, 1e-6, 10.0, 1e-3, 0.95, greedy, prompts, None, passed=True)


def report(*results: DtypeParity, mode: str = WHOLE_MODEL) -> ParityReport:
    return ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], list(results), mode=mode)


def row(card: str, dtype: str) -> list[str]:
    line = next(line for line in card.splitlines() if line.startswith(f"| {dtype} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_half_precision_row_whose_continuations_all_differ_shows_none_agreed():
    """A half-precision check passes on its top-1 agreement alone, so its greedy continuations may all differ: the
    card shows 0/4 for them, and a dash only where none ran (layer by layer), not a dash for the 0."""
    card = parity_section(report(passing("float32"), passing("bfloat16", greedy=0)), "")
    assert row(card, "float32")[5:] == ["4/4", "pass"]
    assert row(card, "bfloat16")[5:] == ["0/4", "pass"]
    by_layer = parity_section(report(passing("float32", greedy=None), mode=BY_LAYER), "")
    assert row(by_layer, "float32")[5:] == ["—", "pass"]


def test_the_table_has_a_delimiter_cell_for_every_column():
    """A Markdown table whose delimiter row has fewer cells than its header is no table on the Hub's page."""
    lines = parity_section(report(passing("float32")), "").splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| dtype |"))
    columns = len(re.findall(r"(?<!\\)\|", lines[header])) - 1  # a cell's escaped \| is no column's edge
    assert columns == 7 and lines[header + 1] == "|" + "---|" * columns


def test_the_rules_name_every_dtype_checked_and_the_whole_models_continuation_length():
    """Whole-model: every dtype of the report gets its own rule (a half-precision conversion is checked in float32
    and in its dtype), the greedy continuations are GREEDY_TOKENS long (parity.json's greedy_tokens), and no stage is
    compared."""
    whole = parity_criteria(report(passing("float32"), passing("bfloat16")), "the reference")
    assert whole.startswith("Checked against the reference, the two models side by side, on fixed prompts ")
    assert (
        f"Passing takes, in float32, max |Δlogit| ≤ 0.0001 × max(1, the logit scale) (the prompts' and each decode "
        f"step's alike) and every greedy continuation ({GREEDY_TOKENS} tokens) identical; in bfloat16, max |Δlogit| "
        "≤ 0.02 × max(1, the logit scale) (the prompts' and each decode step's alike) and top-1 agreement ≥ 90%. "
        "The figures in full are in `parity.json`."
    ) in whole
    assert GREEDY_TOKENS != LAYER_DECODE_STEPS and "stage" not in whole


def test_the_layer_by_layer_rules_hold_each_stage_and_run_no_continuation():
    layer = parity_criteria(report(passing("float16", greedy=None), mode=BY_LAYER), "the reference")
    assert f"but {LAYER_DECODE_STEPS} decode steps, both models fed the reference's greedy token" in layer
    assert (
        "in float16, max |Δlogit| ≤ 0.01 × max(1, the logit scale) (the prompts' and each decode step's alike) and "
        "top-1 agreement ≥ 90%, and each stage within the same factor × max(1, the reference's output of it). "
    ) in layer
    assert "greedy continuation (" not in layer


def folder(path: Path, files: dict[str, str] | None = None) -> Path:
    path.mkdir(parents=True)
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def test_a_local_source_is_named_by_its_folders_name_not_its_path(tmp_path):
    """The card names a local checkpoint as the folder it is (its path is the converting machine's, no reader's)."""
    source = folder(tmp_path / "src")
    out = folder(tmp_path / "out")
    assert write_thinker_card(out, str(source), source, "qwen3", "float32", None) == ["README.md"]
    card = (out / "README.md").read_text()
    assert "The weights of `src` (a local checkpoint), family `qwen3`, converted by `thinker-convert` " in card
    assert str(tmp_path) not in card
    assert ModelCard.load(out / "README.md").data.base_model is None


def test_a_local_folder_at_a_path_shaped_like_a_repo_id_is_no_hub_repo(tmp_path, monkeypatch):
    """SOURCE ``models/tiny`` that exists is the local folder, as the conversion read it, not a Hub repo
    ``models/tiny``: the card neither links it nor names it as base_model."""
    folder(tmp_path / "models" / "tiny")
    out = folder(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    assert hub_repo_of("models/tiny", Path("models/tiny")) is None
    write_thinker_card(out, "models/tiny", Path("models/tiny"), "qwen3", "float32", None)
    card = (out / "README.md").read_text()
    assert "The weights of `tiny` (a local checkpoint)" in card and "huggingface.co" not in card
    assert ModelCard.load(out / "README.md").data.base_model is None


def test_a_snapshot_path_in_the_hub_cache_is_named_as_its_repo(tmp_path):
    """SOURCE given as the path of a cached snapshot (``models--owner--name/snapshots/COMMIT``): the card's base model
    is ``owner/name`` and its commit is the snapshot's."""
    snapshot = folder(tmp_path / "hub" / "models--tiny-org--tiny-qwen3" / "snapshots" / "0123abcd")
    out = folder(tmp_path / "out")
    assert hub_repo_of(str(snapshot), snapshot) == "tiny-org/tiny-qwen3"
    assert in_hub_snapshot(snapshot / "q8" / "tiny.gguf") == ("0123abcd", "q8/tiny.gguf")
    write_thinker_card(out, str(snapshot), snapshot, "qwen3", "float32", None)
    assert ModelCard.load(out / "README.md").data.base_model == "tiny-org/tiny-qwen3"
    card = (out / "README.md").read_text()
    assert "[`tiny-org/tiny-qwen3`](https://huggingface.co/tiny-org/tiny-qwen3) at commit `0123abcd`" in card


def test_a_ggufs_own_license_and_languages_yield_to_the_source_folders_card(tmp_path):
    """A GGUF records its license and languages (``gguf_card_metadata``); the card of the folder it lies in says
    more surely what the weights are under, and wins where both say something."""
    assert gguf_card_metadata(
        {"general.license": "mit", "general.languages": ["en", "fr"], "general.name": "tiny", "general.tags": ["x"]}
    ) == {"license": "mit", "language": ["en", "fr"]}
    ggufs = folder(tmp_path / "ggufs", {"README.md": "---\nlicense: apache-2.0\n---\n# Tiny\n", "tiny.gguf": "GGUF"})
    out = folder(tmp_path / "out")
    recorded = gguf_card_metadata({"general.license": "mit", "general.languages": ["fr"]})
    write_thinker_card(out, str(ggufs / "tiny.gguf"), ggufs / "tiny.gguf", "qwen3", "float32", None, recorded=recorded)
    data = ModelCard.load(out / "README.md").data
    assert (data.license, data.language) == ("apache-2.0", ["fr"])


def test_a_source_card_whose_yaml_does_not_parse_costs_its_metadata_not_the_card(tmp_path):
    """A source card with a broken YAML header (yaml's ParserError, no ValueError) is documentation: the Thinker
    folder's card is written without the source's metadata."""
    source = folder(tmp_path / "src", {"README.md": "---\nlicense: [apache-2.0\n---\n# Tiny\n"})
    out = folder(tmp_path / "out")
    assert write_thinker_card(out, str(source), source, "qwen3", "float32", None) == ["README.md"]
    data = ModelCard.load(out / "README.md").data
    assert data.license is None and data.tags == ["thinker", "qwen3"]


def test_a_license_linked_from_outside_the_source_is_refused_not_copied(qwen3_source, tmp_path):
    """LICENSE is copied as tokenizer files are, each checked: a link to a file outside SOURCE would put that file
    into OUTPUT, so the conversion refuses it, naming the link, and writes nothing."""
    from converter.convert import convert
    from thinker_common.errors import ThinkerError

    source = shutil.copytree(qwen3_source, tmp_path / "source")
    (tmp_path / "secret.txt").write_text("not the model's")
    (source / "LICENSE").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ThinkerError) as refused:
        convert(source, tmp_path / "out", verify=False, progress=False)
    assert str(refused.value).startswith(f"{source / 'LICENSE'}: a symlink to {tmp_path / 'secret.txt'}, outside ")
    assert not (tmp_path / "out").exists()


def test_a_folder_name_that_is_not_utf8_is_shown_with_a_replacement_character(tmp_path):
    """Linux allows a folder name of bytes that are not UTF-8; the card, UTF-8 text, shows them replaced."""
    source = folder(tmp_path / "src")
    out = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff"))
    out.mkdir()
    assert write_thinker_card(out, str(source), source, "qwen3", "float32", None) == ["README.md"]
    assert 'from_pretrained("out?", dtype="auto")' in (out / "README.md").read_text(encoding="utf-8")


def test_the_way_backs_card_carries_the_thinkers_base_model_and_says_how_to_check_it(tmp_path):
    """The way back's card: the Thinker card's license and base model carried (and named beside the Thinker
    folder's name, not its path), its LICENSE copied, and, written unchecked, the command that checks it."""
    thinker_folder = folder(
        tmp_path / "thinker",
        {"README.md": "---\nlicense: apache-2.0\nbase_model: tiny-org/tiny-qwen3\n---\n# x\n", "LICENSE": "terms"},
    )
    out = folder(tmp_path / "back")
    files = write_way_back_card(out, thinker_folder, "qwen3", "Qwen3ForCausalLM", None, "my-qwen3")
    assert files == ["README.md", "LICENSE"] and (out / "LICENSE").read_text() == "terms"
    data = ModelCard.load(out / "README.md").data
    assert (data.base_model, data.license, data.tags) == ("tiny-org/tiny-qwen3", "apache-2.0", ["qwen3"])
    card = " ".join((out / "README.md").read_text().split())
    assert (
        "Written back from the Thinker folder `thinker` (the weights of [`tiny-org/tiny-qwen3`]"
        "(https://huggingface.co/tiny-org/tiny-qwen3)) by `thinker-convert --to qwen3` "
    ) in card
    assert str(tmp_path) not in card
    assert (
        "Not checked: written back with --no-verify. `thinker convert thinker OUTPUT --to qwen3` without --no-verify "
        "checks what it writes."
    ) in card


def test_verify_leaves_a_linked_card_and_one_without_the_checks_section_as_they_are(tmp_path):
    """``thinker verify``'s figures go only into a card of this tool's: a README.md that is a link (to a card of
    thinker's elsewhere) is neither written through nor replaced by a file, and one without the checks markers is
    not rewritten."""
    figures = report(passing("float32"))
    written = folder(tmp_path / "written")
    write_card(written, {}, "# an earlier output", "Not checked.")
    text = (written / "README.md").read_text()
    linked = folder(tmp_path / "linked")
    (linked / "README.md").symlink_to(written / "README.md")
    assert update_parity(linked, figures) is False
    assert (linked / "README.md").is_symlink() and (written / "README.md").read_text() == text
    other = folder(tmp_path / "other", {"README.md": "# someone's card\n"})
    before = os.stat(other / "README.md")
    assert update_parity(other, figures) is False
    after = os.stat(other / "README.md")
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    assert update_parity(written, figures) is True
    assert (
        "Not checked." not in (written / "README.md").read_text()
        and "| float32 |" in (written / "README.md").read_text()
    )
