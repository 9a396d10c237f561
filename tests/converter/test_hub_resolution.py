"""How ``converter.hub.resolve_source`` turns SOURCE, ``subfolder``, ``gguf_file`` and the offline switches into the
files it reads, against the fake Hub (tests/hub_server.py, fixture ``fake_hub``): cases a mutation run found
untested (tests/converter/test_hub.py holds the rest)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save

from converter.hub import resolve_source
from thinker_common.errors import ThinkerError

REPO = "acme/tiny"


def checkpoint(hidden_size: int = 4) -> dict[str, bytes]:
    return {
        "config.json": json.dumps({"model_type": "qwen2", "hidden_size": hidden_size}).encode(),
        "model.safetensors": save({"w": np.arange(hidden_size, dtype=np.float32)}),
    }


def files_in(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("subfolder", ["weights", "weights/", "/weights/"])
def test_a_subfolder_is_found_however_its_slashes_are_written(fake_hub, subfolder):
    """``subfolder="weights/"`` (as a shell completes a folder name) names the same folder of the repo as
    ``"weights"``: its files alone are fetched (and the repo's card, which covers them), and the folder returned is
    that one in the snapshot."""
    files = {
        "README.md": b"# top",
        "other/model.safetensors": b"x",
        **{f"weights/{k}": v for k, v in checkpoint().items()},
    }
    sha = fake_hub.add_repo(REPO, files)
    folder = resolve_source(REPO, subfolder=subfolder, progress=False)
    assert folder.name == "weights" and folder.parent.name == sha
    assert files_in(folder.parent) == {"README.md", "weights/config.json", "weights/model.safetensors"}


def test_a_gguf_files_folder_lies_under_the_subfolder(fake_hub):
    """``--gguf-file Q8_0/x.gguf`` with ``subfolder="quant"`` is the repo's quant/Q8_0/x.gguf, not Q8_0/quant/x.gguf
    (both exist here, of different sizes, so the one taken is told apart by its bytes)."""
    meant, other = b"GGUF" + bytes(60), b"GGUF" + bytes(70)
    fake_hub.add_repo(REPO, {"quant/Q8_0/tiny-Q8_0.gguf": meant, "Q8_0/quant/tiny-Q8_0.gguf": other})
    path = resolve_source(REPO, subfolder="quant", gguf_file="Q8_0/tiny-Q8_0.gguf", progress=False)
    assert path.parent.parent.name == "quant" and path.read_bytes() == meant
    assert files_in(path.parents[2]) == {"quant/Q8_0/tiny-Q8_0.gguf"}


def test_a_local_folder_without_the_subfolder_named_is_refused(tmp_path):
    """A local SOURCE with a subfolder it lacks is refused by name, not returned as a path that does not exist."""
    (tmp_path / "weights").mkdir()
    assert resolve_source(str(tmp_path), subfolder="weights") == tmp_path / "weights"
    with pytest.raises(ThinkerError) as err:
        resolve_source(str(tmp_path), subfolder="weigths")
    assert str(err.value) == f"{tmp_path}: no subfolder 'weigths' in {tmp_path}; check the subfolder name"


def test_a_rate_limited_hub_falls_back_to_the_cache(fake_hub, caplog):
    """HTTP 429 (too many requests) is the Hub overloaded, not refusing: a cached snapshot is used, as for a 500, and
    the warning says the branch may have moved."""
    fake_hub.add_repo(REPO, checkpoint())
    cached = resolve_source(REPO, progress=False)
    handler = fake_hub._server.RequestHandlerClass
    send_error = handler._send_error

    def rate_limited(self, status, code, message, extra=None):  # the API's 500 (api_down) sent as 429
        send_error(self, 429 if status == 500 else status, code, "Too Many Requests" if status == 500 else message)

    handler._send_error = rate_limited
    try:
        fake_hub.api_down = True
        with caplog.at_level("WARNING", logger="converter.hub"):
            assert resolve_source(REPO, progress=False) == cached
    finally:
        handler._send_error = send_error
    (record,) = caplog.records
    assert "cannot be reached (HfHubHTTPError: 429" in record.getMessage()


def test_transformers_offline_set_after_import_keeps_the_hub_unasked(fake_hub, monkeypatch):
    """TRANSFORMERS_OFFLINE=1, which huggingface_hub reads as HF_HUB_OFFLINE, set after import: the cached snapshot
    is used without a request, and an uncached repo is refused as not in the cache, the Hub never asked."""
    fake_hub.add_repo(REPO, checkpoint())
    cached = resolve_source(REPO, progress=False)
    asked = len(fake_hub.requests)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert resolve_source(REPO, progress=False) == cached
    with pytest.raises(ThinkerError, match=r"^acme/other@main is not in the cache at "):
        resolve_source("acme/other", progress=False)
    assert len(fake_hub.requests) == asked


def test_a_short_mistyped_local_path_is_named_with_the_folder_meant(fake_hub, monkeypatch, tmp_path):
    """The example of converter.hub._not_local itself: "qwen3-06b" for ./qwen3-0.6b (one character left out of ten)
    is named as the folder meant, once the Hub has answered that no such repo exists; "qwen-0.6b" too."""
    (tmp_path / "qwen3-0.6b").mkdir()
    (tmp_path / "unrelated").mkdir()
    monkeypatch.chdir(tmp_path)
    for typo in ("qwen3-06b", "qwen-0.6b"):
        with pytest.raises(ThinkerError) as err:
            resolve_source(typo, progress=False)
        assert str(err.value).endswith(f"; no local path {typo!r} exists either (did you mean ./qwen3-0.6b?)")


def test_an_index_leaving_out_a_shard_beside_it_in_a_local_folder_is_said_to_be_damaged(tmp_path):
    """A local folder's index that names shard 1 of 2 while shard 2 lies beside it: the index is damaged or from
    another download (re-download it), not "try another revision", the advice for a Hub snapshot's own index."""
    from thinker_common.sources import SAFETENSORS_INDEX, open_source

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / shards[0]).write_bytes(save({"a": np.zeros(2, np.float32)}))
    (tmp_path / shards[1]).write_bytes(save({"b": np.zeros(2, np.float32)}))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": shards[0]}}))
    with pytest.raises(ThinkerError) as err:
        open_source(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / SAFETENSORS_INDEX}: names no tensor in {shards[1]}, a shard of its own set beside it, so the "
        "tensors in that shard would go unread; the index is damaged or from another download: re-download it"
    )


def test_one_shard_of_two_given_as_source_is_refused_naming_the_folder(tmp_path):
    """SOURCE naming model-00001-of-00002.safetensors, which the index beside it names as one of 2 shards: refused as
    a part of a checkpoint, naming the folder to give instead (not read alone as if it were the whole model)."""
    from thinker_common.sources import SAFETENSORS_INDEX, open_source

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / shards[0]).write_bytes(save({"a": np.zeros(2, np.float32)}))
    (tmp_path / shards[1]).write_bytes(save({"b": np.zeros(2, np.float32)}))
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    with pytest.raises(ThinkerError) as err:
        open_source(tmp_path / shards[0])
    assert str(err.value) == (
        f"{tmp_path / shards[0]}: one of the 2 shards {SAFETENSORS_INDEX} names; give the folder that holds them "
        f"({tmp_path}) as SOURCE"
    )


def test_a_tokenizer_model_given_as_source_is_named_as_no_weights(tmp_path):
    """tokenizer.model (sentencepiece) given as SOURCE by mistake: said to be a file of the checkpoint, not its
    weights, rather than tried as a PyTorch pickle and refused as an unloadable state dict."""
    from thinker_common.sources import open_source

    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    with pytest.raises(ThinkerError) as err:
        open_source(tmp_path / "tokenizer.model")
    assert str(err.value) == (
        f"{tmp_path / 'tokenizer.model'}: a .model file of the checkpoint, not its weights; give the folder that "
        "holds it"
    )


def test_a_symlink_to_a_cached_snapshot_reads_its_files_from_the_cache(fake_hub, tmp_path):
    """A link to a Hub snapshot (ln -s ~/.cache/huggingface/hub/models--acme--tiny/snapshots/SHA ./tiny) given as
    SOURCE: the snapshot's files link into the cache's blobs/, which the cache the link leads to vouches for."""
    from thinker_common.sources import open_source

    fake_hub.add_repo(REPO, checkpoint())
    link = tmp_path / "tiny"
    link.symlink_to(resolve_source(REPO, progress=False), target_is_directory=True)
    source = open_source(link)
    try:
        assert source.names() == ["w"]
        np.testing.assert_array_equal(source.load("w").numpy(), np.arange(4, dtype=np.float32))
    finally:
        source.close()


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("thinker", "convert its source again (thinker-convert wrote this folder)"), ("qwen2", "re-download it")],
)
def test_a_truncated_file_in_a_folder_thinker_wrote_says_to_convert_again(tmp_path, model_type, expected):
    """Weights cut short in a folder thinker-convert wrote (its config.json's model_type "thinker") were made here,
    not downloaded: the advice is to convert the source again; in a downloaded folder, to re-download it."""
    from thinker_common.sources import open_source

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    whole = save({"w": np.zeros(64, np.float32)})
    (tmp_path / "model.safetensors").write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ThinkerError, match="the file is truncated or corrupt") as err:
        open_source(tmp_path)
    assert str(err.value).endswith(f"the file is truncated or corrupt, {expected}"), err.value


# --- refusals whose advice fits what the user gave (a mutation run and a review found each wrong) ---------------


def test_a_hub_subfolder_that_does_not_exist_is_named(fake_hub):
    """Locally a missing subfolder is named ("no subfolder 'weigths'"); on the Hub the refusal spoke of the repo's
    top level and advised checking the repo id and revision, never naming the subfolder mistyped."""
    fake_hub.add_repo(REPO, {f"weights/{k}": v for k, v in checkpoint().items()})
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, subfolder="weigths", progress=False)
    assert "subfolder 'weigths'" in str(err.value)
    assert not fake_hub.file_requests()


def test_weights_one_folder_below_the_subfolder_are_named_by_their_path_in_the_repo(fake_hub):
    """subfolder="weights" whose weights lie in weights/original/: the advice once printed `hf download ...
    --include 'original/*'`, which matches nothing in the repo (its files are under weights/original/); the
    --subfolder it names is the repo's path."""
    files = checkpoint()
    fake_hub.add_repo(REPO, {"weights/config.json": files["config.json"], "weights/original/model.safetensors": b"x"})
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, subfolder="weights", progress=False)
    assert "in its folder weights/; its folders weights/original/ hold weights" in str(err.value)
    assert str(err.value).endswith("name the one to convert with --subfolder weights/original")


def test_the_subfolder_advice_followed_as_written_finds_the_checkpoint(fake_hub):
    """A repo whose checkpoint lies only in a folder is refused with the --subfolder to name; that option, read as
    the shell reads it (a folder named w[1] is quoted), finds the checkpoint, and fetches its files and the repo's
    card alone."""
    import shlex

    files = {f"w[1]/original/{name}": content for name, content in checkpoint().items()}
    sha = fake_hub.add_repo(REPO, {"README.md": b"# top", "other.txt": b"x", **files})
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, progress=False)
    advice = str(err.value).rpartition("name the one to convert with ")[2]
    assert advice == "--subfolder 'w[1]/original'"  # quoted: unquoted, a shell globs it (zsh: "no matches found")
    option, subfolder = shlex.split(advice)
    assert (option, subfolder) == ("--subfolder", "w[1]/original")
    folder = resolve_source(REPO, subfolder=subfolder, progress=False)
    assert folder.parent.parent.name == sha
    assert files_in(folder.parent.parent) == {"README.md", *files}


@pytest.mark.parametrize(
    ("environment", "local_files_only", "said"),
    [
        ({"TRANSFORMERS_OFFLINE": "1"}, False, "TRANSFORMERS_OFFLINE=1; run once online or unset TRANSFORMERS_OFFLINE"),
        ({}, True, "local_files_only=True; run once online or pass local_files_only=False"),
        (
            {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            False,
            "HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1; run once online or unset HF_HUB_OFFLINE and "
            "TRANSFORMERS_OFFLINE",
        ),
        # HF_HUB_OFFLINE=0 outweighs TRANSFORMERS_OFFLINE=1 in huggingface_hub: local_files_only alone keeps it off
        (
            {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
            True,
            "local_files_only=True; run once online or pass local_files_only=False",
        ),
        (
            {"HF_HUB_OFFLINE": "true"},
            True,
            "HF_HUB_OFFLINE=true and local_files_only=True; run once online or unset HF_HUB_OFFLINE and pass "
            "local_files_only=False",
        ),
    ],
    ids=["transformers", "local-files-only", "both-variables", "hub-0-outweighs", "variable-and-argument"],
)
def test_offline_advice_names_every_switch_that_keeps_the_hub_unasked(
    fake_hub, monkeypatch, environment, local_files_only, said
):
    """The refusal once said "and HF_HUB_OFFLINE=1; ... or unset HF_HUB_OFFLINE" whatever made the run offline:
    advice that changed nothing where HF_HUB_OFFLINE was unset, and had to be followed twice where two switches
    were on. Each switch is named, as huggingface_hub weighs them, with its undoing."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ThinkerError) as err:
        resolve_source("acme/other", progress=False, local_files_only=local_files_only)
    assert f"acme/other@main is not in the cache at {fake_hub.cache} and {said}; no local path" in str(err.value)
    assert not fake_hub.requests


def test_a_subfolder_missing_from_a_snapshot_cached_file_by_file_is_not_said_missing_from_the_repo(
    fake_hub, monkeypatch
):
    """Offline, with the cache filled file by file (as from_pretrained fills it: no listing of the repo), a folder
    the cache lacks may well be in the repo: the refusal says the cache lacks it and to run once online, not to
    check the name."""
    from huggingface_hub import hf_hub_download

    fake_hub.add_repo(REPO, {**checkpoint(), **{f"other/{k}": v for k, v in checkpoint().items()}})
    for name in ("config.json", "model.safetensors"):
        hf_hub_download(REPO, name, cache_dir=fake_hub.cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, subfolder="other", progress=False)
    assert str(err.value) == (
        f"{REPO}@main: no subfolder 'other' in the cached snapshot, which was filled file by file and may lack "
        "folders the repo holds, and the Hub is off limits (HF_HUB_OFFLINE=1); run once online to fetch it"
    )


def test_an_incomplete_snapshot_names_the_switch_that_keeps_the_hub_off_limits(fake_hub, monkeypatch):
    """A cached snapshot missing a file, offline by TRANSFORMERS_OFFLINE: the message named HF_HUB_OFFLINE=1,
    which was unset."""
    fake_hub.add_repo(REPO, checkpoint())
    folder = resolve_source(REPO, progress=False)
    (folder / "model.safetensors").unlink()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, progress=False)
    assert "is missing files (model.safetensors) and the Hub is off limits (TRANSFORMERS_OFFLINE=1); run" in str(
        err.value
    )


def test_a_gguf_file_the_subfolder_lacks_is_named_by_the_path_gguf_file_takes(fake_hub):
    """With --subfolder, a --gguf-file the folder lacks listed the repo's GGUF files by their repo paths (outside the
    folder too), and given so, with the subfolder kept, it was refused again (`sub/sub/Q8/...`, a review): the files
    are listed as --gguf-file takes them beside that --subfolder, and the advice followed finds the file."""
    fake_hub.add_repo(REPO, {"sub/Q8/x-Q8.gguf": b"x", "sub/Q4/x-Q4.gguf": b"y", "other/z.gguf": b"z"})
    with pytest.raises(ThinkerError) as err:
        resolve_source(REPO, subfolder="sub", gguf_file="x-Q8.gguf", progress=False)
    assert str(err.value) == (
        f"{REPO}@main has no GGUF file 'x-Q8.gguf' in its folder sub/; the GGUF files there: Q4/x-Q4.gguf, Q8/x-Q8.gguf"
    )
    assert resolve_source(REPO, subfolder="sub", gguf_file="Q8/x-Q8.gguf", progress=False).read_bytes() == b"x"
    with pytest.raises(ThinkerError) as err:  # without --subfolder: every GGUF file, by its path in the repo
        resolve_source(REPO, gguf_file="Q8/x-Q8.gguf", progress=False)
    assert str(err.value).endswith(
        "has no GGUF file 'Q8/x-Q8.gguf'; the GGUF files there: other/z.gguf, sub/Q4/x-Q4.gguf, sub/Q8/x-Q8.gguf"
    )
