"""Hostile GGUF files (issues 15 and 16): metadata of the wrong type or of impossible values, tensors whose data
overlap, and a file transformers itself cannot load as the parity reference. Each ends in one ``error:`` line naming
the file and the key or tensor, exit 1, no traceback, nothing at OUTPUT."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from convert_helpers import build_reference, write_gguf
from transformers import LlamaConfig, Qwen3Config

from thinker_common.cli import main

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64)
LLAMA = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def convert(*args: object):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def assert_error(result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert not [line for line in lines[:-1] if "warning" in line.lower() or "error" in line.lower()], result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert "Traceback" not in result.output
    return lines[-1]


def tiny_gguf(tmp_path: Path, metadata: dict | None = None, config=LLAMA, architecture: str = "llama") -> Path:
    folder = tmp_path / "gguf"
    folder.mkdir(exist_ok=True)
    return write_gguf(build_reference(config), folder / f"tiny-{architecture}.gguf", architecture, metadata)


@pytest.mark.parametrize(
    "metadata, key",
    [
        ({"llama.embedding_length": "thirty-two"}, "llama.embedding_length"),
        ({"llama.attention.head_count": 0}, "llama.attention.head_count"),
        ({"llama.block_count": "2"}, "llama.block_count"),
        ({"llama.context_length": 0}, "llama.context_length"),
        ({"llama.attention.layer_norm_rms_epsilon": "tiny"}, "llama.attention.layer_norm_rms_epsilon"),
        ({"llama.rope.freq_base": "10000"}, "llama.rope.freq_base"),
        ({"tokenizer.ggml.eos_token_id": "two"}, "tokenizer.ggml.eos_token_id"),
    ],
    ids=["embedding_length a string", "zero head_count", "block_count a string", "zero context", "eps a string",
         "rope base a string", "eos id a string"],
)  # fmt: skip
def test_metadata_no_model_can_have(metadata, key, tmp_path):
    path = tiny_gguf(tmp_path, metadata)
    output = tmp_path / "out"
    assert_error(convert(path, output, "--no-verify"), f"'{key}'", "corrupt")
    assert not output.exists()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_rotary_part_of_each_head_is_refused(architecture, tmp_path):
    """``rope.dimension_count`` below the head size: llama.cpp rotates that many channels of each head, these
    families' transformers classes the whole head. Refused by key, also under --no-verify, which converted it to a
    model computing other numbers (found by a QA run)."""
    path = tiny_gguf(tmp_path, {f"{architecture}.rope.dimension_count": 4}, architecture=architecture)
    output = tmp_path / "out"
    assert_error(convert(path, output, "--no-verify"), f"{architecture}.rope.dimension_count=4 rotates part of each")
    assert not output.exists()


def tensor_offset_position(path: Path, name: str) -> tuple[int, int]:
    """Where in the file the header stores ``name``'s data offset (a uint64), and that offset's value."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    field = tensor.field
    position = field.offset + sum(part.nbytes for part in field.parts[:-1])
    return position, int(field.parts[-1][0])


def test_tensors_whose_data_overlap(tmp_path):
    path = tiny_gguf(tmp_path)
    target, _ = tensor_offset_position(path, "blk.0.attn_k.weight")
    _, offset = tensor_offset_position(path, "blk.0.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[target : target + 8] = np.uint64(offset).tobytes()  # attn_k now reads attn_q's bytes
    path.write_bytes(bytes(data))
    output = tmp_path / "out"
    assert_error(convert(path, output, "--no-verify"), str(path), "overlap", "blk.0.attn_", "re-download")
    assert not output.exists()


@pytest.mark.parametrize("check", ["--verify", "--verify-by-layer"])
def test_a_reference_transformers_cannot_build_is_named(check, tmp_path):
    """transformers' GGUF loader ignores qwen3's attention.key_length and builds head_dim 128: with another head
    size its model does not fit the file, and it used to say only "look at the above report!" (with no report); by
    layer it named the GGUF tensors alone, without advice (a QA run): both checks say it alike."""
    config = Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    path = tiny_gguf(tmp_path, config=config, architecture="qwen3")
    output = tmp_path / "out"
    message = assert_error(
        convert(path, output, check),
        str(path),
        "with tensors of other shapes than it holds",
        "self_attn",
        "--no-verify",
    )
    assert "above report" not in message
    assert not output.exists()
    result = convert(path, output, "--no-verify")  # the conversion itself is sound
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("check", ["--verify", "--verify-by-layer"])
def test_a_reference_transformers_cannot_load_is_named(check, tmp_path, monkeypatch):
    """F64 tensors convert, but transformers' GGUF loading has no dequantization for them: the gate says it has no
    reference and how to convert anyway (by layer it blamed the class's forward with an AttributeError from gguf's
    own message, a QA run)."""
    import convert_helpers

    def add_float64(writer, name, tensor, quantization=None):
        wide = tensor.double() if tensor.ndim >= 2 else tensor.float()
        writer.add_tensor(name, np.ascontiguousarray(wide.numpy()))

    monkeypatch.setattr(convert_helpers, "add_gguf_tensor", add_float64)
    path = tiny_gguf(tmp_path)
    output = tmp_path / "out"
    assert_error(
        convert(path, output, check), str(path), "does not load with transformers (Dequantization", "--no-verify"
    )
    assert not output.exists()
    assert convert(path, output, "--no-verify").exit_code == 0
