"""The Thinker folder a conversion writes, and the small shared pieces around it: shard layout and index, the
generation config and its vocabulary note, progress bars, human-readable sizes, the value check, the parity inputs,
and whether a process is alive. Tests written for the survivors of a mutation run on these modules."""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import sys

import pytest
import torch
from convert_helpers import QWEN2
from safetensors import safe_open
from transformers import GenerationConfig, Qwen2Config

import converter.engine as engine
import converter.shards as shards
from converter.load import load_thinker
from converter.output import generation_config_for, generation_differences, tokens_past_vocabulary_note
from converter.shards import ShardLayout, ShardWriter
from thinker import ThinkerConfig
from thinker_common import processes
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import (
    CONTINUATION_DECODE_STEPS,
    LONG_PROMPT_LENGTHS,
    PROMPT_LENGTHS,
    continuation_prompt,
    gate_prompts,
    left_padded,
    parity_batch,
    vocabulary_edges,
)
from thinker_common.progress import progress_bar
from thinker_common.sizes import DEFAULT_MAX_SHARD_SIZE, human_size, parse_size
from thinker_common.values import FLOAT16_MAX, value_problem

# --- shards and their index --------------------------------------------------------------------------------------


def test_the_index_names_each_tensors_own_shard_and_counts_parameters(save_reference, run_convert):
    """Each name of the index's weight_map lies in the shard the index names; total_size is the bytes of all tensors
    and total_parameters their elements (not bytes); the files returned include the index."""
    model, source = save_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False))
    result = run_convert(source, max_shard_size="16KB", verify=False)
    index = json.loads((result.output / "model.safetensors.index.json").read_text())
    assert "model.safetensors.index.json" in result.files
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        assert shard in result.files
        with safe_open(result.output / shard, "pt") as handle:
            stored |= {name: (shard, handle.get_tensor(name)) for name in handle.keys()}  # noqa: SIM118
    assert {name: shard for name, (shard, _) in stored.items()} == index["weight_map"]
    parameters = sum(tensor.numel() for _, tensor in stored.values())
    assert parameters == sum(parameter.numel() for parameter in model.parameters())
    assert index["metadata"]["total_parameters"] == parameters
    assert index["metadata"]["total_size"] == 4 * parameters == result.total_bytes  # float32


def test_a_tensor_larger_than_the_limit_takes_a_shard_of_its_own_and_sizes_are_in_bytes():
    """No empty shard before a tensor larger than max_shard_size; the limit counts bytes, not elements."""
    big = ShardLayout([("big", (100,), torch.float32), ("small", (2,), torch.float32)], 16)
    assert big.num_shards == 2 and [slot.shard for slot in big.slots.values()] == [0, 1]
    assert big.file_name(0) == "model-00001-of-00002.safetensors"
    # 3 x 4 float32 values (48 bytes) and 2 more (8 bytes): 56 bytes fill a 56-byte shard, and split at 55
    layout = ShardLayout([("a", (3, 4), torch.float32), ("b", (2,), torch.float32)], 56)
    assert layout.num_shards == 1 and layout.total_size == 56
    assert ShardLayout([("a", (3, 4), torch.float32), ("b", (2,), torch.float32)], 55).num_shards == 2


def test_two_shards_have_their_index(tmp_path):
    """The index is written (and returned with the shards) from two shards on, not only past two."""
    layout = ShardLayout([("a", (4,), torch.float32), ("b", (4,), torch.float32)], 16)
    with ShardWriter(tmp_path, layout) as writer:
        writer.write("a", torch.zeros(4))
        writer.write("b", torch.ones(4))
        files = writer.close()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert files == [first, second, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 32, "total_parameters": 8}, "weight_map": {"a": first, "b": second}}


def test_closing_a_writer_with_a_tensor_never_written_is_refused(tmp_path):
    layout = ShardLayout([("a", (4,), torch.float32), ("b", (4,), torch.float32)], 1 << 20)
    with ShardWriter(tmp_path, layout) as writer:
        writer.write("a", torch.zeros(4))
        with pytest.raises(RuntimeError, match=r"1 planned tensors were never written, e.g. \['b'\]"):
            writer.close()


def test_a_disk_too_full_for_a_shard_is_found_before_its_first_byte(tmp_path, monkeypatch):
    """fallocate's ENOSPC is raised (the conversion then says the disk is full), not taken for a file system that
    cannot preallocate."""

    def full(descriptor, mode, offset, length):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(shards, "_libc_function", lambda name, argtypes: full if name == "fallocate" else None)
    layout = ShardLayout([("a", (4,), torch.float32)], 1 << 20)
    with ShardWriter(tmp_path, layout) as writer, pytest.raises(OSError) as raised:
        writer.write("a", torch.zeros(4))
    assert raised.value.errno == errno.ENOSPC


def test_loading_a_thinker_folder_takes_the_dtype_asked(tiny_thinker_dirs):
    """``load_thinker(thinker_folder, dtype=...)``: a Thinker folder is loaded as it is, in the dtype asked."""
    model = load_thinker(tiny_thinker_dirs["dense"], dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training


# --- config and generation config --------------------------------------------------------------------------------


def test_an_unreadable_generation_config_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ThinkerError, match=r"generation_config\.json: unreadable"):
        generation_config_for(tmp_path, ThinkerConfig(vocab_size=64))


def test_generation_differences_name_each_setting_changed():
    """What ``thinker verify`` reports of a folder's generation config: each key that differs, both values."""
    expected = GenerationConfig(eos_token_id=[2, 3], do_sample=True, temperature=0.6)
    actual = GenerationConfig(eos_token_id=5, do_sample=True, temperature=0.7)
    assert generation_differences(expected, actual) == ["eos_token_id ([2, 3] -> 5)", "temperature (0.6 -> 0.7)"]
    assert generation_differences(expected, GenerationConfig.from_dict(expected.to_dict())) == []


def test_bos_and_pad_ids_outside_the_vocabulary_are_said_too():
    config = ThinkerConfig(vocab_size=64)
    note = tokens_past_vocabulary_note(GenerationConfig(eos_token_id=2, bos_token_id=64, pad_token_id=70), config)
    assert note is not None
    assert note.startswith("the source's bos_token_id 64 and pad_token_id 70 are outside its vocabulary of 64 ids")
    assert tokens_past_vocabulary_note(GenerationConfig(eos_token_id=63, bos_token_id=0), config) is None


# --- progress bars -----------------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    """stderr as a terminal: tqdm shows its bars there."""

    def isatty(self) -> bool:
        return True


def last_redraw(text: str) -> str:
    return text.rstrip("\n").split("\n")[-1].split("\r")[-1]


def test_a_byte_bar_counts_in_binary_units_and_stays_on_screen(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress_bar(2048, "writing") as bar:
        bar.update(2048)
    shown = last_redraw(sys.stderr.getvalue())
    assert shown.startswith("writing: 100%|") and "2.00k/2.00k" in shown, shown  # 1024 bytes a k: not 2.05k
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress_bar(3, "steps", unit="step") as bar:
        bar.update(3)
    assert "3/3" in last_redraw(sys.stderr.getvalue())


def test_a_bar_turned_off_or_not_on_a_terminal_is_not_shown(monkeypatch):
    """``enabled=False`` hides a bar on a terminal; a log file or a pipe gets none either way."""
    for stream, enabled in ((Terminal(), False), (io.StringIO(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(10, "hidden", enabled=enabled) as bar:
            bar.update(10)
        assert stream.getvalue() == "", (type(stream).__name__, enabled)


def test_the_conversion_bar_ends_full_at_the_bytes_written(save_reference, run_convert, monkeypatch):
    bars = []

    def recorded(*args, **kwargs):
        bars.append(progress_bar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(engine, "progress_bar", recorded)
    monkeypatch.setattr(sys, "stderr", Terminal())
    _, source = save_reference(Qwen2Config(**QWEN2))
    result = run_convert(source, verify=False, progress=True, max_shard_size="16KB")
    assert len(bars) == 1 and bars[0].n == bars[0].total == result.total_bytes
    assert last_redraw(sys.stderr.getvalue()).startswith("converting: 100%|")


# --- sizes -------------------------------------------------------------------------------------------------------


def test_human_sizes_in_binary_units():
    assert [human_size(size) for size in (1023, 1024, 1536 * 2**20, 3 * 2**40)] == [
        "1023 B",
        "1.0 KiB",
        "1.5 GiB",
        "3072.0 GiB",
    ]
    assert human_size(1000) == "1000 B" and human_size(2**30) == "1.0 GiB"
    # a need a user may copy into a setting: rounded up, never below the bytes
    assert human_size(1025, round_up=True) == "1.1 KiB" and human_size(1025) == "1.0 KiB"
    assert human_size(2**30 + 1, round_up=True) == "1.1 GiB"


def test_the_default_shard_size_is_transformers_5gb():
    assert parse_size(DEFAULT_MAX_SHARD_SIZE) == 5 * 10**9


# --- the value check ---------------------------------------------------------------------------------------------


def test_float16_range_both_signs_and_across_pieces():
    assert value_problem(torch.tensor([FLOAT16_MAX, -FLOAT16_MAX]), torch.float16) is None  # representable
    assert "beyond float16" in value_problem(torch.tensor([1.0, -7e4]), torch.float16)
    assert value_problem(torch.tensor([1.0, -7e4]), torch.bfloat16) is None
    # the large value in the first piece, smaller ones after: still found
    values = torch.zeros(3 * 32768)
    values[0] = 7e4
    assert value_problem(values, torch.float16) == "holds values up to 70000, beyond float16's ±65504"


# --- parity inputs -----------------------------------------------------------------------------------------------


def test_the_parity_batch_is_left_padded_with_unequal_prompts():
    assert PROMPT_LENGTHS == (7, 4)
    ids, mask = parity_batch(64)
    assert ids.shape == mask.shape == (2, 7)
    assert mask.tolist() == [[1] * 7, [0, 0, 0, 1, 1, 1, 1]]
    assert ids[1, :3].tolist() == [0, 0, 0]
    ids, mask, positions = left_padded([[5, 6, 7], [8]], pad_id=9)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_gate_prompts_leave_room_for_the_tokens_after_them():
    """The fixed prompts and the long ones, each cut so that it and ``reserve`` more tokens fit the context."""
    prompts = gate_prompts(64, context=20, reserve=4)
    assert [len(prompt) for prompt in prompts] == [7, 4, 16, 11]
    whole = gate_prompts(64, context=None, reserve=4)
    assert [len(prompt) for prompt in whole] == [*PROMPT_LENGTHS, *LONG_PROMPT_LENGTHS]
    assert [len(prompt) for prompt in gate_prompts(64, context=8, reserve=4)] == [4, 4, 4, 2]


def test_the_continuation_fits_the_context_with_its_decode_steps():
    first, then = continuation_prompt(64, context=40)
    assert first.shape == (1, 10) and then.shape == (1, 40 - 10 - CONTINUATION_DECODE_STEPS)


def test_vocabulary_edges_include_the_last_ids():
    edges = vocabulary_edges(300)[0].tolist()
    assert edges == [0, 1, 255, 256, 298, 299]


# --- processes ---------------------------------------------------------------------------------------------------


def test_another_users_process_counts_as_alive(monkeypatch):
    """kill(pid, 0) on someone else's process raises PermissionError: it runs (its staging folder stays)."""

    def not_ours(pid, signal):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_ours)
    assert processes.alive(12345) is True
