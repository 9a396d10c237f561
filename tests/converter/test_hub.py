"""converter.hub against a fake Hub (tests/hub_server.py, fixture ``fake_hub``): downloads, cache, offline, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_error, assert_nothing_written, assert_process_error, run_cli, thinker
from huggingface_hub import constants
from safetensors.numpy import save

from converter.hub import pick_conversion_files, resolve_source
from thinker_common.errors import ThinkerError
from thinker_common.sources import SAFETENSORS_INDEX, open_source

REPO = "acme/tiny"
BIG = b"\0" * 200_000  # stands for the multi-GB files a conversion must never fetch


def tiny_repo(hidden_size: int = 4) -> dict[str, bytes]:
    """A small checkpoint plus the kind of extras real repos carry, which must not be downloaded."""
    return {
        "config.json": json.dumps({"model_type": "qwen2", "hidden_size": hidden_size}).encode(),
        "model.safetensors": save({"w": np.arange(hidden_size, dtype=np.float32)}),
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "generation_config.json": b'{"temperature": 0.37, "top_k": 7}',  # sampling defaults a conversion keeps
        "README.md": b"---\nlicense: apache-2.0\n---\n# tiny",
        "LICENSE": b"Apache License 2.0",
        "model.onnx": BIG,
        "pytorch_model.bin": BIG,  # a pickle: skipped because safetensors exist
        "original/consolidated.pth": BIG,
    }


# the card and the license too: the license travels with the weights into OUTPUT
WANTED = {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md", "LICENSE"}


def files_in(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def go_offline(monkeypatch: pytest.MonkeyPatch, how: str = "both") -> None:
    """HF_HUB_OFFLINE=1 as set before huggingface_hub was imported ("constant"), after it ("env"), or both."""
    if how in ("env", "both"):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if how in ("constant", "both"):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_downloads_only_the_files_a_conversion_needs(fake_hub):
    sha = fake_hub.add_repo(REPO, tiny_repo())

    folder = resolve_source(REPO, progress=False)

    assert folder.name == sha and folder.is_relative_to(fake_hub.cache)
    assert files_in(folder) == WANTED
    assert (folder / "model.safetensors").read_bytes() == tiny_repo()["model.safetensors"]
    fetched = {r.path.rsplit(f"/resolve/{sha}/", 1)[-1] for r in fake_hub.file_requests()}
    assert fetched == WANTED


def test_second_resolve_reuses_the_cache(fake_hub):
    fake_hub.add_repo(REPO, tiny_repo())
    first = resolve_source(REPO, progress=False)
    downloads = len(fake_hub.file_requests())

    assert resolve_source(REPO, progress=False) == first
    assert len(fake_hub.file_requests()) == downloads


def test_offline_resolves_from_the_cache_alone(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, tiny_repo())
    online = resolve_source(REPO, progress=False)
    fake_hub.stop()
    go_offline(monkeypatch)

    assert resolve_source(REPO, progress=False) == online
    assert files_in(online) == WANTED


def test_offline_resolves_a_cache_filled_file_by_file(fake_hub, monkeypatch):
    """A cache filled as transformers' from_pretrained fills it, one hf_hub_download per file, keeps no listing of
    the repo: offline, its snapshot's own files stand for one (what that load read), rather than "not in the cache"."""
    from huggingface_hub import hf_hub_download

    fake_hub.add_repo(REPO, tiny_repo())
    for name in ("config.json", "model.safetensors"):
        snapshot = Path(hf_hub_download(REPO, name, cache_dir=fake_hub.cache)).parent
    fake_hub.stop()
    go_offline(monkeypatch)

    assert resolve_source(REPO, progress=False) == snapshot
    assert files_in(snapshot) == {"config.json", "model.safetensors"}


def test_offline_a_gguf_cached_file_by_file_is_named_first(fake_hub, monkeypatch):
    """A GGUF repo of several quantisations, one of them cached file by file (hf_hub_download, as transformers'
    from_pretrained(..., gguf_file=) caches it): online the repo is refused until one is named, and offline the
    snapshot cannot tell whether others exist, so it is refused too, naming the file to pass (found by a QA run:
    the cached one was converted without a word); with --gguf-file it resolves."""
    from huggingface_hub import hf_hub_download

    fake_hub.add_repo("acme/tiny-gguf", GGUF_REPO)
    cached = Path(hf_hub_download("acme/tiny-gguf", "tiny-Q8_0.gguf", cache_dir=fake_hub.cache))
    fake_hub.stop()
    go_offline(monkeypatch)
    with pytest.raises(ThinkerError, match="no listing of the repo's files .*--gguf-file tiny-Q8_0.gguf"):
        resolve_source("acme/tiny-gguf", progress=False)
    assert resolve_source("acme/tiny-gguf", gguf_file="tiny-Q8_0.gguf", progress=False) == cached


@pytest.mark.parametrize("how", ["env", "constant"])
def test_offline_and_not_cached(fake_hub, monkeypatch, how):
    fake_hub.add_repo(REPO, tiny_repo())
    go_offline(monkeypatch, how)

    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, progress=False)
    message = str(err.value)
    assert f"{REPO}@main is not in the cache at" in message and "\n" not in message
    if how == "env":
        assert "and HF_HUB_OFFLINE=1; run once online or unset HF_HUB_OFFLINE" in message
    else:  # read by huggingface_hub at import, unset since: unsetting it now would change nothing
        assert "set when huggingface_hub was imported; run once online or start Python again without it" in message
    assert fake_hub.requests == []


def test_offline_with_a_partial_cache(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, tiny_repo())
    folder = resolve_source(REPO, progress=False)
    (folder / "model.safetensors").unlink()  # as after an interrupted download
    go_offline(monkeypatch)

    # the files named: the snapshot folder alone left the user to compare it with the repo's listing (a QA run)
    with pytest.raises(
        ThinkerError, match=r"@main: the cached snapshot at .* is missing files \(model.safetensors\)"
    ) as err:
        resolve_source(REPO, progress=False)
    assert "HF_HUB_OFFLINE=1" in str(err.value)


def test_missing_repo(fake_hub):
    with pytest.raises(ThinkerError, match="acme/nope@main: repo not found") as err:
        resolve_source("acme/nope", progress=False)
    assert "HF_TOKEN" in str(err.value)


@pytest.mark.parametrize("offline", [False, True], ids=["hub-answers-404", "offline"])
def test_a_mistyped_local_path_is_named_with_the_folder_meant(fake_hub, monkeypatch, tmp_path, offline):
    """A SOURCE that is no local path is tried as a Hub id; when the Hub (or the cache) has nothing either, the
    message says no local path of that name exists and names the entries here spelled closest to it."""
    (tmp_path / "qwen3-0.6b-thinker").mkdir()
    (tmp_path / "unrelated").mkdir()
    monkeypatch.chdir(tmp_path)
    if offline:
        go_offline(monkeypatch)
    with pytest.raises(ThinkerError, match="no local path 'qwen3-06b-thinker' exists either") as err:
        resolve_source("qwen3-06b-thinker", progress=False)
    assert str(err.value).endswith("(did you mean ./qwen3-0.6b-thinker?)")
    with pytest.raises(ThinkerError, match="no local path 'acme/nope' exists either$"):
        resolve_source("acme/nope", progress=False)  # nothing spelled like it: no guess


def test_missing_revision(fake_hub):
    fake_hub.add_repo(REPO, tiny_repo())
    with pytest.raises(ThinkerError, match="acme/tiny@v9: revision not found"):
        resolve_source(REPO, revision="v9", progress=False)


def test_gated_repo_without_token(fake_hub):
    fake_hub.add_repo(REPO, tiny_repo(), gated=True)
    with pytest.raises(ThinkerError, match="gated") as err:
        resolve_source(REPO, progress=False)
    assert REPO in str(err.value) and "HF_TOKEN" in str(err.value)
    assert {r.authorization for r in fake_hub.requests} == {None}


@pytest.mark.parametrize("how", ["HF_TOKEN", "argument"])
def test_token_is_sent(fake_hub, monkeypatch, how):
    fake_hub.add_repo(REPO, tiny_repo(), gated=True)
    if how == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", fake_hub.TOKEN)
        folder = resolve_source(REPO, progress=False)
    else:
        folder = resolve_source(REPO, token=fake_hub.TOKEN, progress=False)

    assert files_in(folder) == WANTED
    # every request, the listing's too: a private repo's listing asked without it is "not found" (a mutation run)
    assert {r.authorization for r in fake_hub.requests} == {f"Bearer {fake_hub.TOKEN}"}


def test_the_endpoint_is_read_when_resolving(fake_hub, monkeypatch):
    """HF_ENDPOINT set after huggingface_hub was imported is the one asked (its constants keep the value at import):
    the fixture's endpoint in the environment alone, the constants pointing at a closed port."""
    fake_hub.add_repo(REPO, tiny_repo())
    closed = "http://127.0.0.1:9"
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", closed + "/{repo_id}/resolve/{revision}/{filename}")
    assert files_in(resolve_source(REPO, progress=False)) == WANTED


def test_a_local_folder_named_like_a_repo_id_is_read_where_it_is(fake_hub, tmp_path, monkeypatch):
    """A relative path spelled as a repo id (acme/tiny) or a one-word name is the folder there when it exists, as
    transformers' from_pretrained takes it; the Hub is not asked."""
    monkeypatch.chdir(tmp_path)
    for name in ("acme/tiny", "tinyq"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.json").write_text("{}")
        assert resolve_source(name, progress=False) == Path(name)
    assert fake_hub.requests == []


def test_revision_picks_its_commit(fake_hub):
    main = fake_hub.add_repo(REPO, tiny_repo(hidden_size=4))
    tagged = fake_hub.add_repo(REPO, tiny_repo(hidden_size=8), revision="v2")

    for revision, sha, size in [(None, main, 4), ("v2", tagged, 8), (main, main, 4), (tagged[:7], tagged, 8)]:
        folder = resolve_source(REPO, revision=revision, progress=False)
        assert folder.name == sha
        assert json.loads((folder / "config.json").read_text())["hidden_size"] == size


def test_a_short_commit_hash_is_taken_and_found_offline(fake_hub, monkeypatch):
    """The Hub resolves a commit hash's prefix; the download asks for the whole hash it names, and the prefix is
    recorded as a ref (as huggingface_hub records one), so the same --revision works offline."""
    sha = fake_hub.add_repo(REPO, tiny_repo())
    folder = resolve_source(REPO, revision=sha[:10], progress=False)
    assert folder.name == sha
    assert all(f"/resolve/{sha}/" in r.path for r in fake_hub.file_requests())
    go_offline(monkeypatch)
    assert resolve_source(REPO, revision=sha[:10], progress=False) == folder
    # a prefix never used online: matched against the cached snapshots, as the Hub would match it
    assert resolve_source(REPO, revision=sha[:8], progress=False) == folder
    with pytest.raises(ThinkerError, match=f"{REPO}@0000000 is not in the cache"):
        resolve_source(REPO, revision="0000000", progress=False)
    # the ref recorded whole, no temporary file of its writing left beside it
    assert [ref.name for ref in (folder.parent.parent / "refs").iterdir()] == [sha[:10]]
    # two cached snapshots the prefix matches: neither is taken for it, and the message says why
    twin = folder.parent / (sha[:8] + "f" * 32)
    twin.mkdir()
    with pytest.raises(ThinkerError, match=f"^{REPO}@{sha[:8]} matches 2 cached commits .*; give more of the commit"):
        resolve_source(REPO, revision=sha[:8], progress=False)


def test_unreachable_hub_falls_back_to_the_cache(fake_hub):
    fake_hub.add_repo(REPO, tiny_repo())
    cached = resolve_source(REPO, progress=False)
    fake_hub.stop()

    assert resolve_source(REPO, progress=False) == cached
    with pytest.raises(ThinkerError, match="cannot reach the Hub at .*acme/other@main") as err:
        resolve_source("acme/other", progress=False)
    assert "HF_ENDPOINT" in str(err.value) and "\n" not in str(err.value)


def test_a_stalled_hub_times_out_to_the_cache(fake_hub, monkeypatch):
    """An endpoint that takes the connection and never answers (a stalled proxy) ends the listing's wait after
    HF_HUB_ETAG_TIMEOUT as an unreachable Hub: the cached snapshot is used, an uncached repo is one line. Without
    the timeout huggingface_hub's client waits forever."""
    fake_hub.add_repo(REPO, tiny_repo())
    cached = resolve_source(REPO, progress=False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
    fake_hub.stall_api_seconds = 30
    assert resolve_source(REPO, progress=False) == cached
    with pytest.raises(ThinkerError, match=r"cannot reach the Hub at .*acme/other@main \(\w*Timeout"):
        resolve_source("acme/other", progress=False)


def test_a_stalled_download_says_which_timeout_to_raise(fake_hub, monkeypatch):
    """A download whose bytes stop coming for HF_HUB_DOWNLOAD_TIMEOUT seconds (a slow link or mirror) fails on
    huggingface_hub's read timeout: the message says to raise that variable, and by how much it is set now."""
    fake_hub.add_repo(REPO, tiny_repo())
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.2)
    fake_hub.stall_body_seconds = 1
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, progress=False)
    assert "dropped during the download (" in str(err.value) and "Timeout" in str(err.value)
    assert str(err.value).endswith("(a slow link or mirror: raise HF_HUB_DOWNLOAD_TIMEOUT, now 0.2 s)")


def test_a_listed_file_the_hub_does_not_serve_is_named(fake_hub):
    fake_hub.add_repo(REPO, tiny_repo())
    fake_hub.unserved.add("tokenizer.json")
    with pytest.raises(ThinkerError, match=r"acme/tiny@main: a listed file is missing on .* \(tokenizer\.json\)"):
        resolve_source(REPO, progress=False)


def test_a_download_cut_off_midway_is_one_line_and_resumes(fake_hub, qwen3_source, tmp_path):
    """The connection drops before the weights' body on every try: huggingface_hub retries (its warnings kept out of
    the user's terminal), then one line says what happened; what was fetched stays cached, and the next run, with the
    Hub well again, completes the snapshot."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    fake_hub.cut_downloads_after = 0
    output = tmp_path / "out"
    done = run_cli("convert", "tiny-org/tiny-qwen3", output, "--no-verify")
    assert_process_error(done, "tiny-org/tiny-qwen3@main", "dropped during the download", "fetches the rest")
    assert "resume" not in done.stderr.lower()  # huggingface_hub's retry notices
    assert_nothing_written(output)
    # cut, retried, cut again: the error came after huggingface_hub's own tries
    assert len(fake_hub.file_requests("GET")) > 1
    fake_hub.cut_downloads_after = None
    assert (resolve_source("tiny-org/tiny-qwen3", progress=False) / "model.safetensors").is_file()


def test_a_download_cut_on_every_try_past_the_recursion_limit_is_one_line(fake_hub, monkeypatch):
    """huggingface_hub retries a cut download by calling itself and resets its count of retries with every chunk,
    so an endpoint that cuts each try after some bytes (a proxy that ignores Range; about 500 tries over 9 minutes
    in QA) ends in RecursionError: the same line as any dropped connection."""
    import converter.hub as hub

    fake_hub.add_repo(REPO, tiny_repo())

    def recursing(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded in comparison")

    monkeypatch.setattr(hub, "snapshot_download", recursing)
    with pytest.raises(ThinkerError, match=r"acme/tiny@main: .* dropped during the download \(cut on every try\)"):
        resolve_source(REPO, progress=False)


def test_a_corrupt_cached_file_says_which_copy_to_delete(fake_hub, qwen3_source, tmp_path):
    """Every run takes huggingface_hub's cached copy as it is, so "re-download it" must say how: delete the blob."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    weights = resolve_source("tiny-org/tiny-qwen3", progress=False) / "model.safetensors"
    blob = weights.resolve()
    blob.write_bytes(blob.read_bytes()[:100])
    message = assert_error(thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "out", "--no-verify"), str(weights))
    assert f"delete the cached copy {blob} and run again" in message
    blob.unlink()
    result = thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "out", "--no-verify")
    assert result.exit_code == 0, result.output

    # a file broken in the repo itself downloads whole, its sha256 the Hub's: deleting it would fetch it broken again
    broken = {path.name: path.read_bytes() for path in qwen3_source.iterdir() if path.is_file()}
    broken["model.safetensors"] = broken["model.safetensors"][:100]
    fake_hub.add_repo("tiny-org/broken", broken)
    weights = resolve_source("tiny-org/broken", progress=False) / "model.safetensors"
    message = assert_error(thinker("convert", "tiny-org/broken", tmp_path / "out2", "--no-verify"), str(weights))
    assert "its cached copy is what the repo holds" in message and "the file in the repo is itself damaged" in message
    assert "delete the cached copy" not in message


def test_a_snapshot_is_read_as_the_hub_caches_only(tmp_path):
    """A local folder named snapshots/ is not the Hub's cache: its sub-folder is no commit (an export of
    /data/snapshots/my-model recorded the commit "my-model": a review)."""
    from thinker_common.model_card import in_hub_snapshot

    commit = "9f230a7f5c62ad4ca871291a636eeabd0ac2f0ba"
    cached = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / commit / "Q8" / "tiny-Q8_0.gguf"
    assert in_hub_snapshot(cached) == (commit, "Q8/tiny-Q8_0.gguf")
    assert in_hub_snapshot(tmp_path / "data" / "snapshots" / "my-model") == (None, "my-model")
    assert in_hub_snapshot(tmp_path / "snapshots" / "2024-06" / "my-model") == (None, "my-model")


def test_local_paths_and_bad_sources(tmp_path):
    assert resolve_source(str(tmp_path)) == tmp_path
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_source(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"
    with pytest.raises(ThinkerError, match="no such folder, and not a Hub repo id"):
        resolve_source(str(tmp_path / "missing" / "model"))
    with pytest.raises(ThinkerError, match="only applies to Hub repo ids"):
        resolve_source(str(tmp_path), revision="main")
    # the form the tool's own messages name a revision in (acme/tiny@v2: revision not found ...)
    with pytest.raises(ThinkerError, match="^acme/tiny@v2: give the revision as an option: acme/tiny --revision v2$"):
        resolve_source("acme/tiny@v2")


def test_file_names_cannot_escape_the_download_folder(fake_hub):
    weightless = {name: content for name, content in tiny_repo().items() if not name.endswith((".safetensors", ".bin"))}
    fake_hub.add_repo(REPO, {**weightless, "..\\escape.safetensors": b"{}"})  # the only weights: picked
    with pytest.raises(ThinkerError, match="would escape the download folder"):
        resolve_source(REPO, progress=False)
    assert fake_hub.file_requests() == []


def test_cached_file_leading_out_of_the_cache_is_refused(fake_hub, tmp_path):
    fake_hub.add_repo(REPO, tiny_repo())
    folder = resolve_source(REPO, progress=False)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (folder / "config.json").unlink()
    os.symlink(outside, folder / "config.json")

    with pytest.raises(ThinkerError, match="points outside the cache"):
        resolve_source(REPO, progress=False)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            ["config.json", "model.safetensors", "pytorch_model.bin", "onnx/model.onnx"],
            ["config.json", "model.safetensors"],
        ),
        (["config.json", "pytorch_model.bin", "training_args.bin"], ["config.json", "pytorch_model.bin"]),
        (
            [
                "config.json",
                "consolidated.safetensors",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
                "tokenizer.model",
                "merges.txt",
            ],
            [
                "config.json",
                "merges.txt",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
                "tokenizer.model",
            ],
        ),
        (["README.md", "qwen-q8_0.gguf"], ["README.md", "qwen-q8_0.gguf"]),
        (  # beside a GGUF (config and tokenizer in its metadata) only what its conversion reads or carries
            ["LICENSE", "README.md", "config.json", "generation_config.json", "qwen-q8_0.gguf", "tokenizer.json"],
            ["LICENSE", "README.md", "generation_config.json", "qwen-q8_0.gguf"],
        ),
        (  # the whole safetensors file beside a bin index and its shards: the file alone, no index to follow
            [
                "config.json",
                "model.safetensors",
                "pytorch_model-00001-of-00001.bin",
                "pytorch_model.bin",
                "pytorch_model.bin.index.json",
            ],
            ["config.json", "model.safetensors"],
        ),
        (  # a variant or a copy beside pytorch_model.bin: transformers loads the .bin, before those names
            ["config.json", "consolidated.safetensors", "model.fp16.safetensors", "pytorch_model.bin"],
            ["config.json", "pytorch_model.bin"],
        ),
        (  # numbered shards without their index beside a bin index and its shards: the indexed .bin set
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "pytorch_model-00001-of-00001.bin",
                "pytorch_model.bin.index.json",
            ],
            ["config.json", "pytorch_model-00001-of-00001.bin", "pytorch_model.bin.index.json"],
        ),
        (  # a whole copy beside the shards: transformers reads it, before the index, and so does the converter
            [
                "config.json",
                "model.safetensors",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
            ],
            ["config.json", "model.safetensors"],
        ),
        (  # an index naming the single file: the file is read whole, as transformers reads it
            ["config.json", "model.safetensors", "model.safetensors.index.json"],
            ["config.json", "model.safetensors"],
        ),
        (
            [
                "config.json",
                "pytorch_model.bin",
                "pytorch_model-00001-of-00002.bin",
                "pytorch_model-00002-of-00002.bin",
                "pytorch_model.bin.index.json",
            ],
            ["config.json", "pytorch_model.bin"],
        ),
    ],
)
def test_pick_conversion_files(files, expected):
    assert pick_conversion_files(files, "r@main") == expected


@pytest.mark.parametrize(
    ("files", "expected"),
    [  # from a QA sweep of Hub layouts
        (  # a dtype variant beside the checkpoint: both were fetched, and their tensors clashed
            ["config.json", "model.safetensors", "model.fp16.safetensors"],
            ["config.json", "model.safetensors"],
        ),
        (  # numbered shards beside the whole file without an index: transformers reads the whole file
            [
                "config.json",
                "model.safetensors",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ],
            ["config.json", "model.safetensors"],
        ),
        (["README.md", "tiny-Q8_0.gguf", "imatrix.bin"], ["README.md", "tiny-Q8_0.gguf"]),  # the .bin is no checkpoint
        (  # the side files a conversion reads or carries, a chat template too, and no training records
            ["config.json", "model.safetensors", "chat_template.jinja", "trainer_state.json", "train_log.txt"],
            ["chat_template.jinja", "config.json", "model.safetensors"],
        ),
        (  # a named chat template in its own folder (transformers' additional_chat_templates/), and nothing else there
            [
                "config.json",
                "model.safetensors",
                "additional_chat_templates/tool_use.jinja",
                "additional_chat_templates/notes.txt",
                "additional_chat_templates/old/rag.jinja",
                "extra/tool_use.jinja",
                "extra/x.tiktoken",
            ],
            ["additional_chat_templates/tool_use.jinja", "config.json", "model.safetensors"],
        ),
    ],
)
def test_pick_conversion_files_as_transformers_reads_a_repo(files, expected):
    assert pick_conversion_files(files, "r@main") == expected


def test_the_shards_the_index_names_alone_are_fetched(fake_hub):
    """The index first: a stale set of shards beside the current one is not downloaded, and an index naming a shard
    the repo lacks (an upload left incomplete) is refused before any shard, as no retry would mend it."""
    stale = {f"model-0000{i}-of-00003.safetensors": BIG for i in (1, 2, 3)}
    current = {
        "model-00001-of-00002.safetensors": save({"a": np.zeros(2, np.float32)}),
        "model-00002-of-00002.safetensors": save({"b": np.zeros(2, np.float32)}),
    }
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    config = json.dumps({"model_type": "qwen2"}).encode()
    files = {"config.json": config, **stale, **current, SAFETENSORS_INDEX: json.dumps({"weight_map": index}).encode()}
    fake_hub.add_repo(REPO, files)
    path = resolve_source(REPO, progress=False)
    assert files_in(path) == {"config.json", SAFETENSORS_INDEX, *current}
    broken_index = {"weight_map": {**index, "c": "model-00003-of-00004.safetensors"}}
    fake_hub.add_repo("acme/broken", {**files, SAFETENSORS_INDEX: json.dumps(broken_index).encode()})
    with pytest.raises(ThinkerError, match="names shard 'model-00003-of-00004.safetensors', which the repo does not"):
        resolve_source("acme/broken", progress=False)
    assert not [r for r in fake_hub.file_requests() if "acme/broken" in r.path and r.path.endswith(".safetensors")]


def test_a_push_during_the_download_does_not_mix_two_commits(fake_hub, monkeypatch):
    """The listing names a commit and every download asks for that one: a push to the branch right after the
    listing (new shard names, a new config) used to reach the index download, whose shards the listing lacked. The
    branch's ref is recorded, so the snapshot is found offline by name; the next run online takes the push."""

    def sharded(width: int, shards: int) -> dict[str, bytes]:
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        weights = {f"w{i}": np.full(width, i, np.float32) for i in range(shards)}
        index = {"weight_map": {f"w{i}": name for i, name in enumerate(names)}}
        return {
            "config.json": json.dumps({"model_type": "qwen2", "hidden_size": width}).encode(),
            SAFETENSORS_INDEX: json.dumps(index).encode(),
            **{name: save({f"w{i}": weights[f"w{i}"]}) for i, name in enumerate(names)},
        }

    listed = fake_hub.add_repo(REPO, sharded(4, 2))
    fake_hub.after_next_info = lambda: fake_hub.add_repo(REPO, sharded(8, 3))

    folder = resolve_source(REPO, progress=False)
    assert folder.name == listed
    assert files_in(folder) == set(sharded(4, 2))
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 4
    assert all(f"/resolve/{listed}/" in r.path for r in fake_hub.file_requests())

    with monkeypatch.context() as offline:
        go_offline(offline)
        assert resolve_source(REPO, progress=False) == folder
    assert files_in(resolve_source(REPO, progress=False)) == set(sharded(8, 3))


def test_a_file_refused_is_named_as_a_refusal_not_as_the_network(fake_hub):
    """huggingface_hub wraps a file's 403 as "not found locally" when the file is not cached either: the message
    said to check the network."""
    fake_hub.add_repo(REPO, tiny_repo())
    fake_hub.forbidden.add("model.safetensors")
    with pytest.raises(ThinkerError, match=r"acme/tiny@main: the token has no access to acme/tiny \(HTTP 403\)"):
        resolve_source(REPO, progress=False)


def test_the_hubs_own_failure_is_the_reason_given(fake_hub, monkeypatch):
    """With the API failing (500) the files are sought in the cache; where they are not, the 500 is the reason
    given (huggingface_hub's own error there advises local_files_only)."""
    fake_hub.add_repo(REPO, tiny_repo())
    fake_hub.unserved.add("model.safetensors")  # a first attempt fails midway: the listing is cached, not the weights
    with pytest.raises(ThinkerError, match="a listed file is missing"):
        resolve_source(REPO, progress=False)
    fake_hub.unserved.clear()
    fake_hub.api_down = True
    with pytest.raises(
        ThinkerError,
        match=r"missing files \(model.safetensors\) and the Hub at .* cannot be reached \(HfHubHTTPError: .*500",
    ):
        resolve_source(REPO, progress=False)


def test_a_cached_branch_used_while_the_hub_fails_is_said_to_be_possibly_stale(fake_hub, caplog):
    """With the API failing (500) a cached ``main`` is converted, as transformers would, but not in silence: the
    branch may have moved on the Hub since. A commit hash cannot move, so it is used without a word."""
    sha = fake_hub.add_repo(REPO, tiny_repo())
    cached = resolve_source(REPO, progress=False)
    assert resolve_source(REPO, revision=sha, progress=False) == cached
    fake_hub.api_down = True
    with caplog.at_level("WARNING", logger="converter.hub"):
        assert resolve_source(REPO, progress=False) == cached
    (record,) = caplog.records
    said = record.getMessage()
    assert said.startswith(f"{REPO}@main: the Hub at {fake_hub.endpoint} cannot be reached (")
    assert f"using the cached snapshot, commit {sha[:12]}, which may be older than what main names" in said
    caplog.clear()
    with caplog.at_level("WARNING", logger="converter.hub"):
        assert resolve_source(REPO, revision=sha, progress=False) == cached
    assert not caplog.records


def test_pick_conversion_files_refuses_ambiguous_or_missing_weights():
    with pytest.raises(ThinkerError, match="2 GGUF files"):
        pick_conversion_files(["a-q4.gguf", "a-q8.gguf"], "acme/a@main")
    # every GGUF of the repo counted and listed, a quantisation's folder's too (it said 2 of 3, a QA run found)
    with pytest.raises(ThinkerError, match="3 GGUF files; pick one with --gguf-file: .*Q4_0/a-q4_0.gguf"):
        pick_conversion_files(["a-q4.gguf", "a-q8.gguf", "Q4_0/a-q4_0.gguf"], "acme/a@main")
    with pytest.raises(ThinkerError, match="no .safetensors, .bin or .gguf weights .*; check the repo id"):
        pick_conversion_files(["config.json", "original/model.pth"], "acme/a@main")
    # no config.json: refused from the listing, before the weights are downloaded (they were, a QA run found)
    with pytest.raises(ThinkerError, match=r"acme/a@main has no config.json .*\(model.safetensors\) belong to"):
        pick_conversion_files(["model.safetensors", "tokenizer.json"], "acme/a@main")


def test_weights_held_only_in_folders_are_named():
    """A repo whose weights sit only in folders is refused (only top-level files are taken), naming the folders
    that hold them and how to convert one; GGUF folders by file, for --gguf-file. A listing given as a generator
    (read twice) is named too."""
    listing = ["config.json", "original/model.safetensors", "text/model-00001-of-00002.safetensors", "a/b/c.bin"]
    with pytest.raises(ThinkerError) as err:
        pick_conversion_files(iter(listing), "acme/a@v2")
    assert str(err.value) == (
        "acme/a@v2 has no .safetensors, .bin or .gguf weights at its top level; its folders a/b/, original/, text/ "
        "hold weights: name the one to convert with --subfolder a/b"
    )
    ggufs = ["README.md", "Q8_0/tiny-Q8_0.gguf", "Q4_K_M/tiny-Q4_K_M.gguf"]
    with pytest.raises(ThinkerError, match=r"its folders hold Q4_K_M/tiny-Q4_K_M.gguf, Q8_0/tiny-Q8_0.gguf: name one "):
        pick_conversion_files(ggufs, "acme/g@main")


def test_a_local_folder_with_its_weights_in_a_folder_names_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "model.safetensors").write_bytes(save({"w": np.zeros(2, np.float32)}))
    with pytest.raises(ThinkerError, match=r"no checkpoint at its top level; its folders hold weights: pass one as "):
        open_source(tmp_path)
    assert open_source(tmp_path / "original").names() == ["w"]


def test_gguf_only_repo_downloads_its_single_file(fake_hub):
    fake_hub.add_repo("acme/tiny-gguf", {"README.md": b"#", "tiny-q8_0.gguf": b"GGUF" + bytes(60)})
    assert files_in(resolve_source("acme/tiny-gguf", progress=False)) == {"README.md", "tiny-q8_0.gguf"}


GGUF_REPO = {
    "README.md": b"#",
    "tiny-Q4_K_M.gguf": b"GGUF" + bytes(60),
    "tiny-Q8_0.gguf": b"GGUF" + bytes(61),
    "mmproj-F16.gguf": b"GGUF" + bytes(62),
}


def test_gguf_file_picks_one_of_a_repos_quantisations(fake_hub):
    sha = fake_hub.add_repo("acme/tiny-gguf", GGUF_REPO)
    path = resolve_source("acme/tiny-gguf", gguf_file="tiny-Q8_0.gguf", progress=False)
    assert path.name == "tiny-Q8_0.gguf" and path.parent.name == sha and path.read_bytes() == GGUF_REPO[path.name]
    assert files_in(path.parent) == {"README.md", "tiny-Q8_0.gguf"}  # the other quantisations are not downloaded
    with pytest.raises(ThinkerError, match=r"no GGUF file 'tiny-Q5.gguf'.*tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"):
        resolve_source("acme/tiny-gguf", gguf_file="tiny-Q5.gguf", progress=False)
    with pytest.raises(ThinkerError, match="holds 3 GGUF files; pick one with --gguf-file: .*mmproj-F16.gguf"):
        resolve_source("acme/tiny-gguf", progress=False)


def test_gguf_file_in_a_local_folder(tmp_path):
    for name, content in GGUF_REPO.items():
        (tmp_path / name).write_bytes(content)
    assert resolve_source(str(tmp_path), gguf_file="tiny-Q4_K_M.gguf") == tmp_path / "tiny-Q4_K_M.gguf"
    with pytest.raises(ThinkerError, match="no GGUF file 'q2.gguf' in .*the GGUF files there: mmproj-F16.gguf"):
        resolve_source(str(tmp_path), gguf_file="q2.gguf")
    with pytest.raises(ThinkerError, match="SOURCE is already a file"):
        resolve_source(str(tmp_path / "tiny-Q8_0.gguf"), gguf_file="tiny-Q8_0.gguf")
    for bad in ("../tiny-Q8_0.gguf", "sub/../../tiny.gguf", "/tmp/tiny.gguf", "tiny.safetensors", ".hidden.gguf"):
        with pytest.raises(ThinkerError, match="give a .gguf file's name, or its path inside SOURCE"):
            resolve_source(str(tmp_path), gguf_file=bad)


def test_gguf_file_naming_a_link_out_of_the_folder_is_refused(tmp_path):
    """--gguf-file reads by the rule for every file of a source folder: a link to a file outside it is refused, as
    it was when the folder's only GGUF was found without --gguf-file (helper-251: named, the same link was read);
    a link inside the folder is followed."""
    elsewhere, folder = tmp_path / "elsewhere", tmp_path / "repo"
    elsewhere.mkdir()
    folder.mkdir()
    (elsewhere / "tiny-Q8_0.gguf").write_bytes(GGUF_REPO["tiny-Q8_0.gguf"])
    (folder / "a.gguf").symlink_to(elsewhere / "tiny-Q8_0.gguf")
    with pytest.raises(
        ThinkerError, match=r"a\.gguf: a symlink to .*tiny-Q8_0\.gguf, outside .*repo; refusing to read"
    ):
        resolve_source(str(folder), gguf_file="a.gguf")
    (folder / "b.gguf").write_bytes(GGUF_REPO["tiny-Q8_0.gguf"])
    (folder / "c.gguf").symlink_to("b.gguf")
    assert resolve_source(str(folder), gguf_file="c.gguf") == folder / "c.gguf"


def test_gguf_file_as_a_path_inside_the_source(fake_hub, tmp_path):
    """GGUF repos often keep each quantisation in a folder of its own: --gguf-file takes the path in the repo."""
    in_folders = {"README.md": b"#", **{f"{name[5:-5]}/{name}": content for name, content in GGUF_REPO.items()}}
    fake_hub.add_repo("acme/gguf-folders", in_folders)
    path = resolve_source("acme/gguf-folders", gguf_file="Q8_0/tiny-Q8_0.gguf", progress=False)
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == GGUF_REPO["tiny-Q8_0.gguf"]
    assert files_in(path.parent.parent) == {"README.md", "Q8_0/tiny-Q8_0.gguf"}  # and the repo's card alone
    with pytest.raises(ThinkerError, match="no GGUF file 'Q5/tiny-Q5.gguf'; the GGUF files there: Q4_K_M/tiny-Q4_K_M"):
        resolve_source("acme/gguf-folders", gguf_file="Q5/tiny-Q5.gguf", progress=False)
    (tmp_path / "Q4_K_M").mkdir()
    (tmp_path / "Q4_K_M" / "tiny-Q4_K_M.gguf").write_bytes(GGUF_REPO["tiny-Q4_K_M.gguf"])
    assert resolve_source(str(tmp_path), gguf_file="Q4_K_M/tiny-Q4_K_M.gguf") == tmp_path / "Q4_K_M/tiny-Q4_K_M.gguf"
    with pytest.raises(ThinkerError, match="no GGUF file 'typo.gguf' .*the GGUF files there: Q4_K_M/tiny-Q4_K_M.gguf"):
        resolve_source(str(tmp_path), gguf_file="typo.gguf")
    with pytest.raises(ThinkerError, match="no checkpoint at its top level; its folders hold Q4_K_M/tiny-Q4_K_M.gguf"):
        open_source(tmp_path)


def test_a_local_folder_is_read_as_transformers_reads_it(tmp_path):
    """A folder's weights without an index: the checkpoint transformers reads, not a dtype variant beside it (their
    tensors clashed) or a Trainer's training_args.bin (a pickle of its arguments, which failed the whole folder)."""
    import torch

    variant = tmp_path / "variant"
    variant.mkdir()
    (variant / "config.json").write_text("{}")
    (variant / "model.safetensors").write_bytes(save({"w": np.zeros(2, np.float32)}))
    (variant / "model.fp16.safetensors").write_bytes(save({"w": np.zeros(2, np.float16)}))
    assert open_source(variant).names() == ["w"]
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, trained / "pytorch_model.bin")
    torch.save({"learning_rate": 1e-4, "args": ThinkerError("a pickled object")}, trained / "training_args.bin")
    assert open_source(trained).names() == ["w"]


@pytest.mark.parametrize("where", ["HF_HOME", "HF_HUB_CACHE", "cache_dir"])
def test_a_file_where_huggingface_hub_wants_a_folder_is_named_by_its_variable(where, monkeypatch, tmp_path):
    """HF_HOME set to a file (or a path under one) failed as "HF_HOME/token: Not a directory", naming neither the
    variable nor the file (a QA run)."""
    (tmp_path / "a-file").write_text("")
    value = str(tmp_path / "a-file" / "hub")
    options = {}
    if where == "cache_dir":
        options["cache_dir"] = value
    else:
        monkeypatch.setenv(where, value)
    with pytest.raises(ThinkerError, match=rf"^{where}=.*a-file is a file, .*point {where} at a folder"):
        resolve_source("acme/a", **options)


@pytest.mark.parametrize(
    "name", ["additional_chat_templates", "x.tiktoken/vocab", "additional_chat_templates/a.jinja/b"]
)
def test_a_tokenizer_pattern_matches_whole_folder_levels_only(name):
    """A folder named as a pattern's file, or a file below one, is no tokenizer file (a mutation run)."""
    from thinker_common.side_files import is_tokenizer_file

    assert not is_tokenizer_file(name)


def test_a_named_chat_template_comes_down_with_the_tokenizer(fake_hub):
    """transformers keeps a tokenizer's named chat templates in ``additional_chat_templates/``: fetched with the
    tokenizer, where a file of another folder is not."""
    config = json.dumps({"model_type": "qwen2"}).encode()
    files = {
        "config.json": config,
        "model.safetensors": save({"a": np.zeros(2, np.float32)}),
        "additional_chat_templates/tool_use.jinja": b"TOOL {{ messages }}",
        "extra/rag.jinja": b"{{ messages }}",
    }
    fake_hub.add_repo(REPO, files)
    path = resolve_source(REPO, progress=False)
    assert files_in(path) == {"config.json", "model.safetensors", "additional_chat_templates/tool_use.jinja"}
