"""Tests for the survivors of a mutation run (helper-253) on thinker_common's staging.py, source_files.py and
card_format.py: each names the behaviour a surviving mutation changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from thinker_common.errors import ThinkerError
from thinker_common.staging import install, refuse_output_over_source


def _cache(root: Path) -> tuple[Path, Path]:
    """root/cache/models--o--n/{blobs/b, snapshots/c/config.json -> ../../blobs/b}: (cache, snapshot)."""
    repo = root / "cache" / "models--o--n"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "b").write_text("{}")
    snapshot = repo / "snapshots" / "c"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("../../blobs/b"))
    return root / "cache", snapshot


def test_a_file_that_appears_at_output_during_a_force_run_is_refused_by_name(tmp_path):
    """A file put at OUTPUT while a --force run worked: refused at the swap as "a file" (a ThinkerError, not an
    OSError from listing it as a folder), the file and the run's folder as they were."""
    staging, output = tmp_path / ".staging", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    output.write_text("mine")
    with pytest.raises(ThinkerError, match=r"out: not an earlier output of thinker \(a file\)"):
        install(staging, output, force=True)
    assert output.read_text() == "mine" and (staging / "config.json").is_file()


def test_output_reached_through_a_link_into_the_sources_hub_cache_is_refused(tmp_path):
    """OUTPUT named through a link to the Hub cache the source is read from, not yet there: refused as inside the
    cache (only the path with its links resolved shows it)."""
    cache, snapshot = _cache(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(cache, target_is_directory=True)
    with pytest.raises(ThinkerError, match="inside the Hugging Face cache"):
        refuse_output_over_source(alias / "new", snapshot)
    assert not (cache / "new").exists()


def test_output_holding_the_sources_path_is_refused_as_such_though_the_source_lies_elsewhere(tmp_path):
    """SOURCE named through a link kept inside OUTPUT (out/latest -> elsewhere): OUTPUT holds the path typed, which
    replacing OUTPUT would take away, so it is told so by the path comparison (no identity check sees it: the source
    itself lies outside OUTPUT)."""
    real = tmp_path / "elsewhere" / "source"
    real.mkdir(parents=True)
    (real / "config.json").write_text("{}")
    output = tmp_path / "out"
    output.mkdir()
    (output / "latest").symlink_to(real, target_is_directory=True)
    with pytest.raises(ThinkerError, match="OUTPUT holds the source"):
        refuse_output_over_source(output, output / "latest")


def test_a_dead_runs_staging_name_that_is_a_link_goes_and_the_folder_it_leads_to_stays(tmp_path):
    """A leftover at a dead run's staging name that is a link to a folder: the link is removed, never what it leads
    to (removing it as a folder would leave it, and must never empty the folder behind it)."""
    import subprocess

    from thinker_common.staging import _HOST, remove_stale_staging

    child = subprocess.Popen(["true"])
    child.wait()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    link = tmp_path / f".out.partial-{_HOST}-{child.pid}-0123abcd"
    link.symlink_to(theirs, target_is_directory=True)
    assert remove_stale_staging(tmp_path / "out") == [link]
    assert not os.path.lexists(link) and (theirs / "notes.txt").read_text() == "mine"


def test_force_refuses_another_folder_before_the_work_not_after(tmp_path):
    """A folder that is not an earlier output is refused as the staging folder is asked for, before any work (the
    look again at the swap alone would let a whole conversion run first, for nothing), no staging folder made."""
    from thinker_common.staging import work_folder

    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "notes.md").write_text("mine")
    worked = []
    with pytest.raises(ThinkerError, match=r"not an earlier output of thinker \(no README.md model card"):
        with work_folder(documents):
            worked.append(True)
    assert worked == [] and sorted(os.listdir(tmp_path)) == ["documents"]


def test_without_an_atomic_exchange_the_old_output_goes_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    """Where renameat2 is missing, the old OUTPUT is moved aside, the new one renamed into place, and only then is
    the old one deleted: a run stopped between the two renames keeps the old output (at its .old name), which the
    next run's cleanup of staging folders never takes."""
    from thinker_common import staging as staging_module

    staging, output = tmp_path / ".staging", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    output.mkdir()  # an empty folder: --force replaces it
    (tmp_path / "kept.txt").write_text("mine")
    monkeypatch.setattr(staging_module, "_renameat2", lambda first, second, flags: False)
    real_rename = Path.rename

    def stopped_before_the_new_one(path, target):
        if Path(path) == staging:
            raise KeyboardInterrupt
        return real_rename(path, target)

    monkeypatch.setattr(Path, "rename", stopped_before_the_new_one)
    with pytest.raises(KeyboardInterrupt):
        install(staging, output, force=True)
    (old,) = tmp_path.glob(".out.*.old")
    assert old.is_dir() and (staging / "config.json").is_file()


def _earlier_output(folder: Path) -> Path:
    """A folder as a thinker command leaves it: plain files and a card of thinker's recording them."""
    from thinker_common.card_format import CHECK_END, CHECK_START, Record, stamped_card
    from thinker_common.staging import not_an_earlier_output, write_atomically

    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / "config.json").write_text("{}")
    card = f"# model\n{CHECK_START}\nconverted with --no-verify\n{CHECK_END}\n\n{Record().line()}\n"  # as write_card
    (folder / "README.md").write_text(card)
    write_atomically(folder / "README.md", stamped_card(folder))
    assert not_an_earlier_output(folder) is None
    return folder


def test_a_file_changed_while_verify_ran_is_never_recorded_as_thinkers(tmp_path):
    """A weights file saved over while ``thinker verify`` checked the folder (same names, same card): verify must not
    record the folder as unchanged, or --force would then delete the fine-tune."""
    import time

    from thinker_common.card_format import card_after_verify, card_text, read_record

    folder = _earlier_output(tmp_path / "out")
    before, card_before = read_record(folder), card_text(folder)
    time.sleep(0.05)  # past the clock tick of a change time
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # a fine-tune saved meanwhile
    (folder / "parity.json").write_text("{}")  # verify's own report
    assert card_after_verify(folder, before, card_before) is None


def test_a_folder_named_like_a_killed_verifys_report_is_the_users(tmp_path):
    """Only a file named like a half-written report (``.parity.json.partial-PID``, its process gone) is thinker's: a
    folder of that name is the user's, which --force must not delete with the output."""
    import subprocess

    from thinker_common.staging import not_an_earlier_output

    child = subprocess.Popen(["true"])
    child.wait()
    folder = _earlier_output(tmp_path / "out")
    (folder / f".parity.json.partial-{child.pid}").mkdir()
    (folder / f".parity.json.partial-{child.pid}" / "notes.txt").write_text("mine")
    assert "holds .parity.json.partial-" in (not_an_earlier_output(folder) or "")


def test_a_link_into_a_sibling_folder_whose_name_extends_the_sources_is_refused(tmp_path):
    """``source`` and ``source-private`` share a prefix, not a folder: a link from one into the other leads outside
    (a comparison of the paths as text would let it through)."""
    from thinker_common.source_files import checked_file

    source, private = tmp_path / "source", tmp_path / "source-private"
    source.mkdir()
    private.mkdir()
    (private / "id_rsa").write_text("key")
    (source / "merges.txt").symlink_to(private / "id_rsa")
    with pytest.raises(ThinkerError, match="outside"):
        checked_file(source / "merges.txt", source)


def test_a_dangling_link_at_output_is_refused_before_the_work(tmp_path):
    """A link at OUTPUT to nothing (yet) exists as a name, which the rename into place would not replace: refused
    before any work, not found out at the end of it."""
    from thinker_common.staging import refuse_existing_output

    output = tmp_path / "out"
    output.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    with pytest.raises(ThinkerError, match="a link to"):
        refuse_existing_output(output, force=False)
    assert output.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_card_without_a_record_line_is_stamped_as_it_will_read_back(tmp_path):
    """A card of thinker's whose record line is missing (typed over by hand, before the folder was stamped) gains the
    line with a blank line before it: the card's digest must be taken of the card so laid out, or the stamped folder
    reads as edited and --force refuses thinker's own output. A card holding the line keeps the digest it always had,
    so the folders written before read as they did."""
    from thinker_common.card_format import (
        CHECK_END,
        CHECK_START,
        Record,
        _card_digest,
        changes_since_written,
        read_record,
        stamped_card,
    )
    from thinker_common.staging import write_atomically

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    (bare / "README.md").write_text(f"# model\n{CHECK_START}\nno checks\n{CHECK_END}\n")
    write_atomically(bare / "README.md", stamped_card(bare))
    assert read_record(bare) is not None
    assert changes_since_written(bare, os.listdir(bare)) is None

    placed = tmp_path / "placed"
    placed.mkdir()
    (placed / "config.json").write_text("{}")
    card = f"# model\n{CHECK_START}\nno checks\n{CHECK_END}\n\n{Record().line()}\n"
    (placed / "README.md").write_text(card)
    write_atomically(placed / "README.md", stamped_card(placed))
    assert read_record(placed).card == _card_digest(card.encode())
    assert changes_since_written(placed, os.listdir(placed)) is None
