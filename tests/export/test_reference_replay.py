"""The reference's runs kept for the check's next graph (export/reference_replay.py): a run is read back only under
the digest of everything that decides it, bit for bit, never where the reference follows the graph's routing, and
the whole check's figures are those of running the reference every time, with fewer runs of the PyTorch model."""

from __future__ import annotations

import errno
import io

import numpy as np
import pytest
import torch
from export_helpers import FullDiskFile

from export import reference_replay
from export.continuation import compare_continuation
from export.names import GENAI_MODEL_FILE, MODEL_FILE
from export.reference_replay import ReferenceReplay, run_key
from export.runtime import OnnxDecoder
from export.verify import (
    DECODE_STEPS,
    compare_decoders,
    continuation_pass,
    deep_cache_pass,
    half_shadow,
    verify_export,
)
from thinker import ThinkerForCausalLM
from thinker_common.eager import EAGER
from thinker_common.parity_inputs import parity_batch


def test_a_runs_key_tells_apart_every_input_that_decides_it():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    key = run_key("", {"input_ids": ids, "attention_mask": np.ones_like(ids)}, True)
    assert key == run_key("", {"input_ids": ids.copy(), "attention_mask": np.ones_like(ids)}, True)
    assert key == run_key("", {"input_ids": torch.from_numpy(ids), "attention_mask": np.ones_like(ids)}, True)
    others = [
        run_key("", {"input_ids": ids.astype(np.int32), "attention_mask": np.ones_like(ids)}, True),  # dtype
        run_key("", {"input_ids": ids.reshape(3, 2), "attention_mask": np.ones_like(ids)}, True),  # shape
        run_key("", {"input_ids": ids + 1, "attention_mask": np.ones_like(ids)}, True),  # values
        run_key("", {"input_ids": ids, "attention_mask": np.ones_like(ids)}, False),  # the spread's presence
        run_key(key, {"input_ids": ids, "attention_mask": np.ones_like(ids)}, True),  # the run it continues
        run_key("", {"input_ids": ids, "mask": np.ones_like(ids)}, True),  # the names
        run_key("", {"input_ids": ids, "attention_mask": [np.ones_like(ids)]}, True),  # the nesting
    ]
    assert len({key, *others}) == 1 + len(others)
    # a tensor's repr elides its middle values: a key reads the bytes, so two long rows differing there differ
    long = torch.zeros(1, 5000, dtype=torch.long)
    moved = long.clone()
    moved[0, 2500] = 1
    assert repr(long) == repr(moved) and run_key("", long) != run_key("", moved)


def test_a_runs_key_keeps_its_parts_apart():
    """Each part ends where it ends: two runs whose parts' texts only concatenate alike are two runs (a mutation run
    that dropped the separator after each part passed every test)."""
    assert run_key("", 12, 3) != run_key("", 1, 23)
    assert run_key("", "deep cache", 12, True) != run_key("", "deep cache", 1, 2, True)


def test_a_run_is_read_back_bit_for_bit_from_an_unnamed_file_in_the_folder(tmp_path):
    replay, made = ReferenceReplay(tmp_path), []
    rng = np.random.default_rng(0)
    runs = {
        "with spread": (rng.standard_normal((2, 7, 50)).astype(np.float32), rng.random((2, 7)).astype(np.float32)),
        "without": (rng.standard_normal((1, 50)).astype(np.float32), None),
    }

    def make(key):
        made.append(key)
        return runs[key]

    for key in runs:
        replay.run(key, False, lambda key=key: make(key))
    assert list(tmp_path.iterdir()) == []  # unnamed: nothing to leave behind
    for key, (logits, spread) in reversed(runs.items()):  # any order
        read, read_spread = replay.run(key, False, lambda: pytest.fail("made again"))
        np.testing.assert_array_equal(read, logits)
        assert read.dtype == logits.dtype
        if spread is None:
            assert read_spread is None
        else:
            np.testing.assert_array_equal(read_spread, spread)
    assert made == list(runs) and replay.replayed == 2
    replay.close()
    assert not replay.holds("without")


def test_a_run_that_follows_the_graph_is_made_every_time_and_never_kept(tmp_path):
    """The reference routed as the graph did depends on that graph: another graph's comparison must route anew."""
    replay, made = ReferenceReplay(tmp_path), []
    logits = np.ones((1, 4), np.float32)
    for _ in range(2):
        replay.run("routed", True, lambda: made.append(1) or (logits, None))
    assert len(made) == 2 and not replay.holds("routed") and replay.replayed == 0


def test_steps_recorded_in_part_are_refused_rather_than_run_without_their_cache(
    thinker_variant, onnx_variant, tmp_path
):
    """A comparison whose prefill is read back has no cache to run a step from: a step the replay lacks fails loudly
    instead of running the model on an empty cache."""
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", head_dim=16) / MODEL_FILE, provider="cpu")
    batch = parity_batch(model.config.vocab_size)
    replay = ReferenceReplay(tmp_path)
    first = compare_decoders(model.eval(), decoder, *batch, steps=1, replay=replay)
    again = compare_decoders(model, decoder, *batch, steps=1, replay=replay)
    assert again == first and replay.replayed == 2  # the prefill and the step
    with pytest.raises(AssertionError, match="recorded in part"):
        compare_decoders(model, decoder, *batch, steps=2, replay=replay)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_check_reads_the_second_graphs_reference_back_with_the_same_figures(
    dtype, thinker_variant, onnx_variant, monkeypatch
):
    """The whole check, model.onnx then model.genai.onnx: the report is the one made by running the reference for
    every comparison, with far fewer runs of the PyTorch model (the genai graph's passes and the padded-around pass
    read back; the deep pass still prefills its prompt for its slots' scales); in float16 the half-precision
    spreads read back with the logits."""
    folder = thinker_variant("qwen3", head_dim=16)
    export = onnx_variant("qwen3", head_dim=16, dtype=dtype)
    assert (export / GENAI_MODEL_FILE).exists()
    forward, runs = ThinkerForCausalLM.forward, []

    def counted(self, *args, **kwargs):
        runs.append(1)
        return forward(self, *args, **kwargs)

    read, reads = ReferenceReplay._read, []

    def reading(self, key):
        reads.append(key)
        return read(self, key)

    monkeypatch.setattr(ThinkerForCausalLM, "forward", counted)
    monkeypatch.setattr(ReferenceReplay, "_read", reading)
    replayed = verify_export(folder, export / MODEL_FILE, getattr(torch, dtype))
    with_replay = len(runs)
    runs.clear()
    monkeypatch.setattr(ReferenceReplay, "run", lambda self, key, follows, make: make())
    every_time = verify_export(folder, export / MODEL_FILE, getattr(torch, dtype))
    assert replayed["passed"] and replayed == every_time
    # each run read back is one run of the model fewer, and one more: the continuation's prompt, whose cache only
    # the runs read back would have continued (a float16 check's shadows run once either way: their own read-back)
    assert len(runs) - with_replay == len(reads) + 1 and len(reads) >= 20, (with_replay, len(runs), len(reads))
    if dtype == "float32":
        assert with_replay < 0.5 * len(runs), (with_replay, len(runs))


def test_without_a_second_graph_only_the_batchs_runs_are_kept(thinker_variant, onnx_variant, monkeypatch):
    """The plain graph ships no model.genai.onnx: the runs kept are the parity batch's alone, which the padded-around
    pass reads back; the long prompts', the deep cache's and the continuation's would be written for nothing (171 MB
    of long-prompt logits at Qwen3's vocabulary)."""
    folder = thinker_variant("qwen3")
    export = onnx_variant("qwen3", graph="plain", head_dim=None)
    assert not (export / GENAI_MODEL_FILE).exists()
    write, kept, read = ReferenceReplay._write, [], []
    run = ReferenceReplay.run

    def writing(self, key, logits, spread):
        kept.append(logits.shape)
        write(self, key, logits, spread)

    def running(self, key, follows, make):
        held = self.holds(key)
        result = run(self, key, follows, make)
        read.append(held)
        return result

    monkeypatch.setattr(ReferenceReplay, "_write", writing)
    monkeypatch.setattr(ReferenceReplay, "run", running)
    assert verify_export(folder, export / MODEL_FILE, torch.float32)["passed"]
    assert len(kept) == 1 + DECODE_STEPS and kept[0][:2] == parity_batch(folder_vocabulary(folder))[0].shape
    assert sum(read) == 1 + DECODE_STEPS  # every one of them read back by the padded-around pass


def folder_vocabulary(folder) -> int:
    import json

    return json.loads((folder / "config.json").read_text())["vocab_size"]


# --- keys that must keep runs apart within one check (a mutation run's survivors) ---------------------------------
REPEATED = 7


def tiny_pair(thinker_variant, onnx_variant, dtype: str = "float32"):
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", dtype=dtype, head_dim=16) / MODEL_FILE, provider="cpu")
    return model.eval(), decoder


def repeating(model):
    """Every greedy choice the same token (the other logits still move with the position): a repeated token, as real
    models give, whose steps' inputs differ only by the runs before them."""

    def hook(module, args, out):
        return out.index_add(-1, torch.tensor([REPEATED]), torch.full((*out.shape[:-1], 1), 100.0, dtype=out.dtype))

    return model.lm_head.register_forward_hook(hook)


def continuation_references(model, decoder, replay, shadow=None) -> list:
    seen = []
    add = lambda reference, candidate, spread: seen.append((np.array(reference), spread))  # noqa: E731
    compare_continuation(model, decoder, add, shadow=shadow, replay=replay)
    return seen


def test_a_repeated_token_never_reads_back_an_earlier_step(thinker_variant, onnx_variant, tmp_path):
    """Two steps feeding the same token differ only by the cache before them: each step's key holds the runs it
    continues, so the first comparison reads nothing back and its logits are the model's own."""
    model, decoder = tiny_pair(thinker_variant, onnx_variant)
    with repeating(model):
        replay = ReferenceReplay(tmp_path)
        recorded = continuation_references(model, decoder, replay)
        assert replay.replayed == 0
        batch = parity_batch(model.config.vocab_size)
        first = compare_decoders(model, decoder, *batch, steps=3, replay=replay)
        assert replay.replayed == 0 and first == compare_decoders(model, decoder, *batch, steps=3)
        made = continuation_references(model, decoder, None)
    for (kept, _), (fresh, _) in zip(recorded, made, strict=True):
        np.testing.assert_array_equal(kept, fresh)


def test_two_prompts_with_the_same_steps_keep_their_own_runs(thinker_variant, onnx_variant, tmp_path):
    model, decoder = tiny_pair(thinker_variant, onnx_variant)
    ids, mask = parity_batch(model.config.vocab_size)
    other = np.where(mask.astype(bool), (ids + 1) % model.config.vocab_size, ids)
    with repeating(model):
        replay = ReferenceReplay(tmp_path)
        compare_decoders(model, decoder, ids, mask, steps=2, replay=replay)
        second = compare_decoders(model, decoder, other, mask, steps=2, replay=replay)
        assert replay.replayed == 0 and second == compare_decoders(model, decoder, other, mask, steps=2)


def test_a_torch_ties_comparison_reads_nothing_back(thinker_variant, onnx_variant, tmp_path):
    model, decoder = tiny_pair(thinker_variant, onnx_variant)
    batch, replay = parity_batch(model.config.vocab_size), ReferenceReplay(tmp_path)
    compare_decoders(model, decoder, *batch, steps=1, replay=replay)
    compare_decoders(model, decoder, *batch, steps=1, replay=replay, torch_ties=True)
    assert replay.replayed == 0


def test_a_run_with_a_spread_is_never_read_back_for_one_without(thinker_variant, onnx_variant, tmp_path):
    """A float16 check's comparisons carry the half run's spreads: a run recorded without a shadow is another run."""
    model, decoder = tiny_pair(thinker_variant, onnx_variant, "float16")
    batch, replay = parity_batch(model.config.vocab_size), ReferenceReplay(tmp_path)
    compare_decoders(model, decoder, *batch, steps=1, replay=replay)
    shadowed = compare_decoders(
        model, decoder, *batch, steps=1, replay=replay, shadow=half_shadow(model, torch.float16)
    )
    assert shadowed == compare_decoders(model, decoder, *batch, steps=1, shadow=half_shadow(model, torch.float16))
    replay = ReferenceReplay(tmp_path)
    continuation_references(model, decoder, replay)
    spreads = [
        spread for _, spread in continuation_references(model, decoder, replay, half_shadow(model, torch.float16))
    ]
    assert spreads and all(spread is not None for spread in spreads)


def test_a_run_written_after_a_read_leaves_every_run_whole(tmp_path):
    replay = ReferenceReplay(tmp_path)
    runs = {key: (np.full((2, 3), index, np.float32), None) for index, key in enumerate("abc")}
    for key in ("a", "b", "a", "c"):
        replay.run(key, False, lambda key=key: runs[key])
    for key in "abc":
        np.testing.assert_array_equal(replay.run(key, False, lambda: pytest.fail("made again"))[0], runs[key][0])


def test_a_routed_graphs_deep_and_continuation_runs_are_never_kept(thinker_variant, onnx_variant, tmp_path):
    """A float16 MoE graph's reference follows its routing: its deep-cache and continuation runs depend on that
    graph, and none is kept for another."""
    from export.routing import checked_probes

    path = onnx_variant("qwen3_next", dtype="float16", head_dim=None) / MODEL_FILE
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3_next"), dtype=torch.float32, **EAGER).eval()
    decoder = OnnxDecoder(path, provider="cpu", probes=checked_probes(path, torch.float16))
    assert decoder.probe_names
    replay = ReferenceReplay(tmp_path)
    deep_cache_pass(model, decoder, torch.float16, most_slots=64, replay=replay)
    continuation_pass(model, decoder, replay=replay)
    assert replay.offsets == {}


def _disk_fills_after(monkeypatch, saves: int) -> None:
    """``np.save`` as the replay calls it, failing for lack of space from the ``saves + 1``-th call on."""
    calls, save = [], np.save

    def saving(*args, **kwargs):
        calls.append(1)
        if len(calls) > saves:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(*args, **kwargs)

    monkeypatch.setattr(reference_replay.np, "save", saving)


def test_a_disk_too_full_for_the_replay_costs_runs_not_the_check(tmp_path, monkeypatch):
    """The replay's file is not in the export's free-space estimate: a full disk makes every later run afresh (what
    was recorded before included, so that no comparison reads back part of its runs) and returns the made run."""
    replay, made = ReferenceReplay(tmp_path), []
    runs = {key: (np.full((2, 3), index, np.float32), None) for index, key in enumerate("abc")}
    _disk_fills_after(monkeypatch, 1)
    for key in ("a", "b", "c", "a", "b"):
        logits, _ = replay.run(key, False, lambda key=key: made.append(key) or runs[key])
        np.testing.assert_array_equal(logits, runs[key][0])
    assert made == ["a", "b", "c", "a", "b"] and replay.replayed == 0
    assert not replay.holds("a") and list(tmp_path.iterdir()) == []


class FullDisk(io.BytesIO):
    """A file on a disk with ``room`` bytes left: a write past them fails as a full disk's does, and so does the
    close, as a buffered file's flush of what it still held would (a review's run on a full tmpfs)."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, data) -> int:
        if self.tell() + memoryview(data).nbytes > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)

    def close(self) -> None:
        super().close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_real_file_on_a_full_disk_costs_runs_not_the_check(tmp_path, monkeypatch):
    """np.save on a real file wrote with tofile, whose full-disk error has no errno: the replay took it for another
    failure and failed the export; written through the file's write, it is the full disk it is."""
    replay, made = ReferenceReplay(tmp_path), []
    file = tmp_path / "replay"
    monkeypatch.setattr(reference_replay.tempfile, "TemporaryFile", lambda **options: FullDiskFile(file, "w+b"))
    logits, _ = replay.run("a", False, lambda: made.append("a") or (np.ones((2, 300), np.float32), None))
    np.testing.assert_array_equal(logits, np.ones((2, 300), np.float32))
    assert made == ["a"] and not replay.holds("a")


def test_a_full_disk_that_fails_the_close_too_costs_runs_not_the_check(tmp_path, monkeypatch):
    replay, made = ReferenceReplay(tmp_path), []
    runs = {key: (np.full((2, 300), index, np.float32), None) for index, key in enumerate("abc")}
    monkeypatch.setattr(reference_replay.tempfile, "TemporaryFile", lambda **options: FullDisk(room=3000))
    for key in ("a", "b", "a", "c"):  # "a" fits, "b" does not
        logits, _ = replay.run(key, False, lambda key=key: made.append(key) or runs[key])
        np.testing.assert_array_equal(logits, runs[key][0])
    assert made == ["a", "b", "a", "c"] and replay.replayed == 0
    replay.close()


def test_the_replays_file_is_unbuffered(tmp_path):
    """What a write does not put on the disk at once would meet a full disk at a later flush, outside the handling."""
    replay = ReferenceReplay(tmp_path)
    replay.run("a", False, lambda: (np.ones((1, 2), np.float32), None))
    assert isinstance(replay.file, io.FileIO)
    replay.close()


def test_a_disk_full_once_stops_the_recording_for_good(tmp_path, monkeypatch):
    """Space that comes back after the failure records nothing more: a later run recorded alone would leave a
    comparison reading back part of its runs (a mutation run)."""
    calls, save = [], np.save

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(*args, **kwargs)

    monkeypatch.setattr(reference_replay.np, "save", once)
    replay, made = ReferenceReplay(tmp_path), []
    runs = {key: (np.full((2, 3), index, np.float32), None) for index, key in enumerate("abc")}
    for key in ("a", "b", "c", "c"):
        replay.run(key, False, lambda key=key: made.append(key) or runs[key])
    assert made == ["a", "b", "c", "c"] and replay.replayed == 0 and list(tmp_path.iterdir()) == []


def test_another_write_error_is_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_replay.np, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(OSError, match="I/O"):
        ReferenceReplay(tmp_path).run("a", False, lambda: (np.ones((1, 2), np.float32), None))


def test_a_disk_that_fills_during_a_comparison_leaves_the_next_one_whole(thinker_variant, onnx_variant, tmp_path):
    """The prefill recorded, a step not: the next comparison runs every run again with the same figures, where
    reading back the prefill alone would leave its steps no cache to run from."""
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", head_dim=16) / MODEL_FILE, provider="cpu")
    batch = parity_batch(model.config.vocab_size)
    replay = ReferenceReplay(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        _disk_fills_after(patch, 1)
        first = compare_decoders(model.eval(), decoder, *batch, steps=2, replay=replay)
    assert compare_decoders(model, decoder, *batch, steps=2, replay=replay) == first
    assert replay.replayed == 0
