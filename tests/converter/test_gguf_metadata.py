"""The config a GGUF file's metadata gives (``gguf_to_hf_config``) where the other tests' files hold the config classes'
defaults: values of their own (norm epsilon, RoPE base, head size), keys left out (the defaults llama.cpp and
transformers take), token id 0, and metadata no model can have.

The reference is transformers' own reading of the same file (``load_gguf_checkpoint(..., return_tensors=False)``,
what ``from_pretrained(..., gguf_file=...)`` builds its config from, completed by ``LlamaConfig`` where it leaves a
key out). GGUF stores floats as float32, so float fields are compared as the float32 the model computes with, and
the written value checked to be the short decimal (``1e-05``, not ``9.999999747378752e-06``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from convert_helpers import build_reference, write_gguf
from transformers import LlamaConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from converter.families.gguf import gguf_to_hf_config
from thinker_common.errors import ThinkerError
from thinker_common.gguf_reader import GGUFSource

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
# None of these at a config class's default (LlamaConfig: eps 1e-6, theta 10000, 2048 positions, kv heads = heads).
LLAMA = LlamaConfig(
    **TINY,
    max_position_embeddings=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=True,
)


def configs(tmp_path: Path, config: LlamaConfig = LLAMA, **metadata: object) -> tuple[dict, LlamaConfig]:
    """(ours, transformers') for a llama file written from ``config`` with ``metadata`` replacing keys (None: left
    out); transformers' dict completed by ``LlamaConfig`` as its GGUF loading completes it."""
    path = write_gguf(build_reference(config), tmp_path / "tiny.gguf", "llama", metadata or None)
    source = GGUFSource(path)
    try:
        ours = gguf_to_hf_config(source.config(), source.names())
    finally:
        source.close()
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    return ours, LlamaConfig(**theirs)


def test_values_other_than_the_defaults_are_read_as_transformers_reads_them(tmp_path):
    ours, theirs = configs(tmp_path)
    fields = ("max_position_embeddings", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert [ours[field] for field in fields] == [getattr(theirs, field) for field in fields] == [96, 4, 2, 8]
    # eps 1e-5 (SmolLM2's, Llama's): stored as float32, written as the short decimal
    assert ours["rms_norm_eps"] == 1e-05
    assert np.float32(ours["rms_norm_eps"]) == np.float32(theirs.rms_norm_eps)
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert np.float32(theirs.rope_parameters["rope_theta"]) == np.float32(500000.0)


def test_a_file_without_a_rope_base_rotates_at_10000(tmp_path):
    """No ``llama.rope.freq_base``: llama.cpp's default, and transformers' (LlamaConfig's) too."""
    ours, theirs = configs(tmp_path, **{"llama.rope.freq_base": None})
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert theirs.rope_parameters["rope_theta"] == 10000.0


def test_a_file_without_a_kv_head_count_has_one_kv_head_per_head(tmp_path):
    """No ``attention.head_count_kv``: multi-head attention (llama.cpp's n_head_kv = n_head), as transformers takes."""
    config = LlamaConfig(**{**LLAMA.to_dict(), "num_key_value_heads": 4})
    ours, theirs = configs(tmp_path, config, **{"llama.attention.head_count_kv": None})
    assert ours["num_key_value_heads"] == theirs.num_key_value_heads == 4


def test_a_llama_head_size_given_only_by_the_rotary_dimensions(tmp_path):
    """A llama file with heads wider than hidden / heads and no ``attention.key_length``: ``rope.dimension_count``
    gives the head size (llama rotates whole heads), as transformers' table for llama maps it; without it the file
    was refused as rotating part of each head."""
    config = LlamaConfig(**{**LLAMA.to_dict(), "head_dim": 16})
    ours, theirs = configs(tmp_path, config, **{"llama.attention.key_length": None})
    assert ours["head_dim"] == theirs.head_dim == 16


def test_a_special_token_id_of_0_is_kept(tmp_path):
    """Id 0 is a token id like any other (many vocabularies start with their specials); transformers keeps it."""
    ids = {"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    ours, theirs = configs(tmp_path, **ids)
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 0)


# --- metadata no model can have: refused by key --------------------------------------------------------------------


def metadata(**extra: object) -> dict[str, object]:
    base = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 96,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 48,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
        "llama.vocab_size": 64,
    }
    return {**base, **{key.replace("__", "."): value for key, value in extra.items()}}


def test_the_metadata_helper_gives_a_config():
    assert gguf_to_hf_config(metadata(), ["token_embd.weight"])["num_key_value_heads"] == 2


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_norm_epsilon_that_is_not_finite_is_refused(value):
    key = "llama.attention.layer_norm_rms_epsilon"
    with pytest.raises(ThinkerError, match=f"^GGUF metadata '{key}' is {value}; a model needs a small positive number"):
        gguf_to_hf_config(metadata(**{key: value}), [])


def test_a_boolean_size_is_refused():
    """A GGUF bool where a size belongs (Python's bool is an int: True would be 1 layer)."""
    with pytest.raises(ThinkerError, match="^GGUF metadata 'llama.block_count' is True; a model needs a whole number"):
        gguf_to_hf_config(metadata(**{"llama.block_count": True}), [])


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv"])
def test_per_layer_head_counts_are_refused(key):
    with pytest.raises(ThinkerError, match="^GGUF file has per-layer head counts, which llama models do not support"):
        gguf_to_hf_config(metadata(**{key: [4, 2]}), [])


@pytest.mark.parametrize("value", [True, -1], ids=["bool", "negative"])
def test_a_special_token_id_that_is_no_id_is_refused(value):
    """A GGUF bool where a token id belongs (Python's bool is an int: True would be read as token id 1)."""
    key = "tokenizer.ggml.eos_token_id"
    with pytest.raises(ThinkerError, match=f"^GGUF metadata '{key}' is {value!r}, not a token id"):
        gguf_to_hf_config(metadata(**{key: value}), [])


# --- RoPE scaling keys ---------------------------------------------------------------------------------------------


def test_yarn_ext_factor_at_llama_cpps_default_scales_nothing():
    """``rope.scaling.yarn_ext_factor`` -1 is llama.cpp's "not set" (what llama_model::load_hparams defaults to):
    read as nothing, where another value is refused by key."""
    key = "llama.rope.scaling.yarn_ext_factor"
    assert gguf_to_hf_config(metadata(**{key: -1.0}), [])["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
    }
    with pytest.raises(ThinkerError, match=f"^GGUF metadata '{key}' is 0.5: RoPE scaling that no Hugging Face"):
        gguf_to_hf_config(metadata(**{key: 0.5}), [])


@pytest.mark.parametrize(
    "key, neutral",
    [("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_log_multiplier", 0.0), ("yarn_ext_factor", -1.0)],
)
def test_each_untranslated_scaling_key_at_its_neutral_value_scales_nothing(key, neutral):
    """llama.cpp's defaults of the keys no Hugging Face field carries: read as nothing, any other value refused."""
    key = f"llama.rope.scaling.{key}"
    assert gguf_to_hf_config(metadata(**{key: neutral}), [])["rope_parameters"]["rope_type"] == "default"
    with pytest.raises(ThinkerError, match=f"^GGUF metadata '{key}' is {neutral + 0.5}: RoPE scaling that no"):
        gguf_to_hf_config(metadata(**{key: neutral + 0.5}), [])


def test_a_rope_scaling_type_other_than_linear_or_yarn_is_refused():
    scaled = metadata(**{"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ThinkerError, match=r"^GGUF RoPE scaling 'longrope' \(factor 4.0\) is not supported; supported"):
        gguf_to_hf_config(scaled, [])


def test_an_infinite_rope_scaling_factor_is_refused():
    """inf passes ``factor > 0``: written, it would scale every position to 0 (and config.json would hold Infinity)."""
    key = "llama.rope.scaling.factor"
    scaled = metadata(**{"llama.rope.scaling.type": "linear", key: float("inf")})
    with pytest.raises(ThinkerError, match=f"^GGUF metadata '{key}' is inf; RoPE scaling needs a positive number"):
        gguf_to_hf_config(scaled, [])


# --- the file itself (thinker_common/gguf_reader.py, gguf_split.py) ------------------------------------------------


def tiny_file(path: Path, split: tuple[int, int] | None = None, **options: object) -> Path:
    """One F32 tensor and a tokenizer list, written by gguf's own writer (``options``: its ``endianess``); ``split``
    (shard number from 0, count) the keys llama.cpp's gguf-split writes in each shard."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="llama", **options)
    if split is not None:
        writer.add_uint16("split.no", split[0])
        writer.add_uint16("split.count", split[1])
    writer.add_array("tokenizer.ggml.tokens", ["a", b"\xe2\x82", "b"])  # a byte fragment, as byte-level BPE has
    writer.add_tensor("token_embd.weight", np.arange(96, dtype=np.float32).reshape(3, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_token_that_is_not_utf8_on_its_own_is_read_with_a_replacement_character(tmp_path):
    source = GGUFSource(tiny_file(tmp_path / "t.gguf"))
    try:
        assert source.metadata["tokenizer.ggml.tokens"] == ["a", "\ufffd", "b"]
    finally:
        source.close()


def test_a_big_endian_file_is_refused_by_its_byte_order(tmp_path):
    import gguf

    path = tiny_file(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ThinkerError, match=r"be\.gguf: a GGUF file of the opposite byte order \(big-endian\)"):
        GGUFSource(path)


def test_one_alignment_of_bytes_after_the_data_is_refused(tmp_path):
    """A writer pads the last tensor to the alignment (32 bytes), so fewer may follow it, but not a whole
    alignment's worth."""
    path = tiny_file(tmp_path / "t.gguf")
    GGUFSource(path).close()
    extra = tmp_path / "extra.gguf"
    extra.write_bytes(path.read_bytes() + bytes(32))
    with pytest.raises(ThinkerError, match=r"extra\.gguf: 32 bytes follow the data of its 1 tensors"):
        GGUFSource(extra)


def test_four_shards_missing_are_cut_after_three():
    from thinker_common.gguf_split import split_gguf

    said = split_gguf(["x-00005-of-00005.gguf"])
    assert said.startswith(
        "a GGUF split into 5 files, 4 of them not here (x-00001-of-00005.gguf, x-00002-of-00005.gguf, "
        "x-00003-of-00005.gguf ...); merge"
    ), said


def test_a_shard_of_a_gguf_split_in_two_is_refused_as_one(tmp_path):
    """The smallest split (two files): the first shard holds only some of the tensors, and says so."""
    path = tiny_file(tmp_path / "x-00001-of-00002.gguf", split=(0, 2))
    with pytest.raises(
        ThinkerError, match=r"shard 1 of a GGUF split into 2 files \(split.count\); x-00002-of-00002.gguf not beside"
    ):
        GGUFSource(path)


def test_tensors_sharing_one_byte_overlap():
    """The last byte of one tensor's data the first of the next's: refused, naming both and the byte; tensors that
    only touch, or are empty, are not."""
    from types import SimpleNamespace

    from thinker_common.gguf_reader import _check_overlaps

    def reader(*extents):
        tensors = [SimpleNamespace(name=name, data_offset=start, n_bytes=size) for name, start, size in extents]
        return SimpleNamespace(tensors=tensors)

    _check_overlaps(Path("m.gguf"), reader(("a", 0, 32), ("b", 32, 32), ("empty", 40, 0)))
    with pytest.raises(ThinkerError, match=r"'a' and 'b' overlap \(both hold bytes 31 to 31 of the file\)"):
        _check_overlaps(Path("m.gguf"), reader(("b", 31, 32), ("a", 0, 32)))


def test_a_name_that_only_begins_like_a_shard_is_no_shard():
    from thinker_common.gguf_split import is_split_shard

    assert is_split_shard("q8/m-00001-of-00002.gguf")
    assert not is_split_shard("m-00001-of-00002.gguf.part") and not is_split_shard("m-1-of-2.gguf")
