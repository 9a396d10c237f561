"""GGUF sources: synthetic llama / qwen2 / qwen3 / qwen2moe / qwen3moe files, and the real SmolLM2-135M-Instruct Q4_1
weights.

The reference is transformers' own GGUF loading (``from_pretrained(folder, gguf_file=...)``), which the parity gate
uses for GGUF sources. The synthetic files are written the way llama.cpp's converter writes them (names, metadata,
the llama q/k row permutation), so the permutation is undone by the engine and checked against transformers'.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from convert_helpers import assert_same_logits, build_reference, write_gguf
from transformers import AutoTokenizer, LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from converter.families.gguf import smollm2_gguf_path
from thinker import ThinkerForCausalLM
from thinker_common.errors import ThinkerError

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64)
SYNTHETIC = {
    # GQA with the q/k rows permuted for llama.cpp's interleaved RoPE; tied head (no output.weight).
    "llama": LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # q/k/v biases; stored unpermuted.
    "qwen2": Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # qk-norm, untied. head_dim 128: transformers' GGUF loader ignores attention.key_length and uses Qwen3's
    # default, so only that head size has a reference to compare with.
    "qwen3": Qwen3Config(**TINY, num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False),
    # Routed experts stacked per layer (ffn_*_exps) and a shared expert behind a gate llama.cpp stores as a vector;
    # expert widths other than the config classes' defaults, which transformers' own GGUF tables do not read.
    "qwen2moe": Qwen2MoeConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        tie_word_embeddings=False,
    ),
    # qk-norm, top-k weights renormalised (what llama.cpp's qwen3moe graph does); head_dim from key_length.
    "qwen3moe": Qwen3MoeConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("architecture", sorted(SYNTHETIC))
def test_synthetic_gguf(architecture, tmp_path, run_convert):
    model = build_reference(SYNTHETIC[architecture])
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(model, folder / f"tiny-{architecture}.gguf", architecture)
    result = run_convert(path)
    assert result.family == f"gguf-{architecture}" and result.dtype == "float32"
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)
    # the file names no special token: none is invented (a llama file took LlamaConfig's bos 1 and eos 2: a QA run)
    for name in ("config.json", "generation_config.json"):
        written = json.loads((result.output / name).read_text())
        assert [written.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3, name


def byte_pair_tokens(words: int) -> list[str]:
    """Three special tokens, one merge's pieces and ``words`` tokens more: a GPT-2-style vocabulary of ``words + 6``."""
    return ["<unk>", "<s>", "</s>", "a", "b", "ab", *(f"t{i}" for i in range(words))]


def byte_pair_vocabulary(tokens: list[str]) -> dict[str, object]:
    """A GGUF file's tokenizer metadata for ``tokens`` (the first three special, one merge, eos 2), as llama.cpp
    writes a GPT-2-style tokenizer."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_a_tokenizer_larger_than_the_embedding_is_said(tmp_path, run_convert, caplog):
    """A file whose vocabulary lists more tokens than its embedding has rows converted without a word, and its
    tokenizer then gives ids the model cannot embed (a QA run): a warning names both counts."""
    model = build_reference(SYNTHETIC["llama"])
    tokens = byte_pair_tokens(64)  # 70 tokens, 64 rows
    vocabulary = byte_pair_vocabulary(tokens)
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(model, folder / "tiny.gguf", "llama", metadata=vocabulary)
    with caplog.at_level("WARNING"):
        result = run_convert(path, verify=False)
    assert "tokens, but its embedding (token_embd.weight) 64 rows: ids from 64 on fail" in caplog.text
    assert json.loads((result.output / "config.json").read_text())["eos_token_id"] == 2
    # a file with one token per row, whose GPT-2 vocabulary lacks <|endoftext|>: transformers' conversion appends it
    # (its tokenizer class's default); the file is not blamed for it (a QA run: "convert the model again")
    caplog.clear()
    exact = {**vocabulary, "tokenizer.ggml.tokens": tokens[:64], "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 61}
    path = write_gguf(model, folder / "exact.gguf", "llama", metadata=exact)
    with caplog.at_level("WARNING"):
        run_convert(path, "exact", verify=False)
    assert "added '<|endoftext|>' (id 64) beyond the file's 64 tokens" in caplog.text
    assert "the file is inconsistent" not in caplog.text


def test_a_gguf_tokenizer_is_the_same_files_offline_or_not(tmp_path, run_convert, monkeypatch):
    """transformers writes how it loaded a tokenizer (local_files_only, is_local) into tokenizer_config.json, so a
    GGUF conversion's files followed HF_HUB_OFFLINE, and `thinker verify` of a folder converted offline refused it
    online ("not the source's tokenizer_config.json", a benchmark run): the files are the tokenizer's alone."""
    from huggingface_hub import constants

    from converter.convert import refuse_other_tokenizer
    from thinker_common.gguf_reader import GGUFSource

    vocabulary = byte_pair_vocabulary(byte_pair_tokens(58))  # one token per embedding row
    (tmp_path / "gguf").mkdir()
    path = write_gguf(build_reference(SYNTHETIC["llama"]), tmp_path / "gguf" / "tiny.gguf", "llama", vocabulary)
    written = {}
    for offline in (True, False):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        output = run_convert(path, f"offline-{offline}", verify=False).output
        written[offline] = (output / "tokenizer_config.json").read_bytes()
    assert written[True] == written[False]
    assert not {"local_files_only", "is_local"} & set(json.loads(written[True])), written[True]
    source = GGUFSource(path)
    try:
        refuse_other_tokenizer(source, tmp_path / "offline-True")  # checked online
    finally:
        source.close()


@pytest.mark.parametrize("default", [True, False])
def test_a_gguf_files_named_chat_templates_travel(default, tmp_path, run_convert):
    """llama.cpp writes a checkpoint's additional_chat_templates/ as ``tokenizer.chat_template.NAME`` (listed in
    ``tokenizer.chat_templates``); transformers' GGUF tokenizer reads the default alone, so the named ones were
    dropped and ``apply_chat_template(chat_template="tool_use")`` returned "tool_use" (a review). They come back where
    transformers reads them, and ``thinker verify``'s rebuild of the tokenizer holds them too."""
    from transformers import AutoTokenizer

    from converter.convert import refuse_other_tokenizer
    from thinker_common.gguf_reader import GGUFSource

    metadata = {
        **byte_pair_vocabulary(byte_pair_tokens(58)),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}" if default else None,
        "tokenizer.chat_templates": ["tool_use"],
        "tokenizer.chat_template.tool_use": "TOOL {% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (tmp_path / "gguf").mkdir()
    path = write_gguf(build_reference(SYNTHETIC["llama"]), tmp_path / "gguf" / "tiny.gguf", "llama", metadata)
    output = run_convert(path, verify=False).output
    assert (output / "additional_chat_templates" / "tool_use.jinja").is_file()
    tokenizer = AutoTokenizer.from_pretrained(output)
    messages = [{"role": "user", "content": "ab"}]
    assert tokenizer.apply_chat_template(messages, chat_template="tool_use", tokenize=False) == "TOOL ab"
    if default:
        assert tokenizer.apply_chat_template(messages, tokenize=False) == "ab"
    source = GGUFSource(path)
    try:
        refuse_other_tokenizer(source, output)
    finally:
        source.close()


SCALED = {  # RoPE scaling as a GGUF records it: (architecture, its keys, the Hugging Face parameters they stand for)
    "qwen2 yarn": (
        "qwen2",
        {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 8.0,
            "rope.scaling.original_context_length": 16,
            "rope.scaling.yarn_beta_fast": 16.0,  # not transformers' defaults (32, 1): each must be read, and apart
            "rope.scaling.yarn_beta_slow": 2.0,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
    ),
    "llama linear": (
        "llama",
        {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
        {"rope_type": "linear", "factor": 4.0},
    ),
    # llama.cpp reads a factor with no type as linear (llama_model::load_hparams: rope_scaling("linear") unless the
    # key says otherwise), and the factor under the older rope.scale_linear key too: such files were written unscaled
    "llama factor alone": ("llama", {"rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    "llama scale_linear": ("llama", {"rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    # a type without a factor: llama.cpp reads the factor as 0 and rotates unscaled (it was refused as "'yarn' is not
    # supported; supported: none, linear, yarn", a QA run)
    "llama type without a factor": ("llama", {"rope.scaling.type": "yarn"}, {"rope_type": "default"}),
}
# Heads wide enough for YaRN's betas to matter (at the tiny configs' 8 dimensions a head, every frequency falls on one
# side of both correction bounds, and swapping the betas changes nothing): swapped here, 6.9 on a logit scale of 5.9.
SCALED_SHAPES = {"qwen2 yarn": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}}


def scaled_model(case: str):
    """The original model of a ``SCALED`` case, the Hugging Face parameters its file stands for."""
    architecture, _, rope = SCALED[case]
    config = SYNTHETIC[architecture].to_dict() | SCALED_SHAPES.get(case, {})
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    return build_reference(type(SYNTHETIC[architecture])(**config))


@pytest.mark.parametrize("case", sorted(SCALED))
def test_rope_scaled_gguf_passes_its_gate(case, tmp_path, run_convert):
    """transformers' GGUF loading reads RoPE scaling for gpt-oss alone, so the gate's reference rotated unscaled and
    every scaled file failed it: the reference now takes the file's scaling, read as llama.cpp reads it, and both
    equal the scaled original."""
    architecture, keys, rope = SCALED[case]
    model = scaled_model(case)
    folder = tmp_path / "gguf"
    folder.mkdir()
    metadata = {f"{architecture}.{key}": value for key, value in keys.items()}
    path = write_gguf(model, folder / f"scaled-{architecture}.gguf", architecture, metadata=metadata)
    result = run_convert(path)
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)
    written = json.loads((result.output / "config.json").read_text())["rope_parameters"]
    assert {key: written[key] for key in rope} == rope, written


def test_the_gates_reference_reads_the_rope_scaling_on_its_own(tmp_path, run_convert, monkeypatch):
    """The reference takes a scaled file's RoPE parameters from the file itself, not from the converter's reading: a
    slip there (YaRN's betas swapped) landed on both sides of the gate, which passed a Thinker 1.3 of its logit scale
    off the file's model (a mutation run). With the slip planted in the converter's reading, the gate fails."""
    from converter.families import gguf

    read = gguf._rope_parameters

    def betas_swapped(*args):
        parameters = read(*args)
        if "beta_fast" in parameters:
            parameters["beta_fast"], parameters["beta_slow"] = parameters["beta_slow"], parameters["beta_fast"]
        return parameters

    architecture, keys, _ = SCALED["qwen2 yarn"]
    model = scaled_model("qwen2 yarn")
    (tmp_path / "gguf").mkdir()
    metadata = {f"{architecture}.{key}": value for key, value in keys.items()}
    path = write_gguf(model, tmp_path / "gguf" / "yarn.gguf", architecture, metadata=metadata)
    monkeypatch.setattr(gguf, "_rope_parameters", betas_swapped)
    with pytest.raises(ThinkerError, match="does not match its reference"):
        run_convert(path)


def test_a_llama_file_with_attention_biases_passes_its_gate(tmp_path, run_convert):
    """transformers' GGUF config for llama never sets attention_bias, so the gate's reference dropped a file's q/k/v
    biases and refused an exact conversion (a QA run): the reference takes the flag off the file's tensors."""
    config = SYNTHETIC["llama"]
    model = build_reference(type(config)(**(config.to_dict() | {"attention_bias": True})))
    (tmp_path / "gguf").mkdir()
    result = run_convert(write_gguf(model, tmp_path / "gguf" / "biased.gguf", "llama"))
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)


@pytest.fixture(scope="module")
def smollm2(smollm2_demo):
    """SmolLM2-135M-Instruct converted once from its Q4_1 GGUF, with the parity gate on: what ``thinker demo``'s
    step 1, ``convert(smollm2_gguf_path(), folder, verify=True)``, returned (tests/conftest.py), so that the suite
    converts SmolLM2 with its parity check once, not once here and once in the demo."""
    if len(smollm2_demo.conversions) != 1:  # a conversion that raised (a failed parity gate) returned nothing
        made = len(smollm2_demo.conversions)
        pytest.fail(f"the demo made {made} conversions, not one:\n{smollm2_demo.result.output}", pytrace=False)
    ((args, kwargs, conversion),) = smollm2_demo.conversions
    assert args[0] == smollm2_gguf_path() and kwargs.get("verify") is True, (args, kwargs)  # this module's subject
    assert conversion.output == smollm2_demo.thinker
    return conversion


@pytest.mark.slow
def test_smollm2_real_weights_convert_with_parity(smollm2):
    assert smollm2.family == "gguf-llama"
    assert smollm2.parity.passed, smollm2.parity.table()
    fp32 = smollm2.parity.results[0]
    assert fp32.greedy_identical == fp32.greedy_prompts and fp32.top1_agreement == 1.0
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(smollm2.files) | {
        path.name for path in smollm2.output.iterdir()
    }


@pytest.mark.slow
def test_smollm2_answers_in_plain_text(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2.output)
    model = ThinkerForCausalLM.from_pretrained(smollm2.output, dtype=torch.float32).eval()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_verify_holds_a_gguf_conversions_tokenizer_to_its_metadata(smollm2, tmp_path):
    """A GGUF carries its tokenizer as metadata, which the conversion rebuilds as transformers' files: verify
    rebuilds them again (byte for byte the same) and refuses a folder whose tokenizer differs. It compared a folder
    source's files only, so two vocabulary ids swapped in a GGUF conversion's tokenizer.json passed (a QA run)."""
    import json
    import shutil

    from converter.convert import refuse_other_tokenizer
    from thinker_common.errors import ThinkerError
    from thinker_common.gguf_reader import GGUFSource

    source = GGUFSource(smollm2_gguf_path())
    try:
        refuse_other_tokenizer(source, smollm2.output)  # the conversion's own files
        swapped = tmp_path / "swapped"
        swapped.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(smollm2.output / name, swapped / name)
        tokenizer = json.loads((swapped / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab["Ġcapital"], vocab["ĠFrance"] = vocab["ĠFrance"], vocab["Ġcapital"]
        (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
        with pytest.raises(ThinkerError, match="tokenizer.json: not the source's tokenizer.json"):
            refuse_other_tokenizer(source, swapped)
    finally:
        source.close()


@pytest.mark.parametrize("architecture", sorted(SYNTHETIC))
def test_config_agrees_with_transformers_gguf_loader(architecture, tmp_path):
    """``gguf_to_hf_config`` reads the metadata keys transformers' own tables name (``load_gguf_checkpoint`` with
    ``return_tensors=False``); it differs only where it says so: head_dim from ``attention.key_length``."""
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from converter.families.gguf import gguf_to_hf_config
    from thinker_common.gguf_reader import GGUFSource

    model = build_reference(SYNTHETIC[architecture])
    path = write_gguf(model, tmp_path / f"tiny-{architecture}.gguf", architecture)
    source = GGUFSource(path)
    ours = gguf_to_hf_config(source.config(), source.names())
    source.close()
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    fields = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"]
    fields += ["num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"]
    for field in fields:
        assert ours[field] == theirs[field], field
    assert np.float32(ours["rms_norm_eps"]) == np.float32(theirs["rms_norm_eps"])
    assert np.float32(ours["rope_parameters"]["rope_theta"]) == np.float32(theirs["rope_theta"])
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert ours["head_dim"] == head_dim == theirs.get("head_dim", head_dim)


@pytest.mark.parametrize("architecture", ["qwen2moe", "qwen3moe"])
def test_moe_config_reads_the_experts(architecture, tmp_path):
    """The routing fields come from the file (the widths from keys transformers' table leaves out), and what
    llama.cpp's graph fixes from transformers' table of GGUF defaults: Qwen3-MoE renormalises its top-k weights."""
    from converter.families.gguf import gguf_to_hf_config
    from thinker_common.gguf_reader import GGUFSource

    config = SYNTHETIC[architecture]
    path = write_gguf(build_reference(config), tmp_path / f"tiny-{architecture}.gguf", architecture)
    source = GGUFSource(path)
    ours = gguf_to_hf_config(source.config(), source.names())
    source.close()
    assert ours["model_type"] == config.model_type
    assert (ours["num_experts"], ours["num_experts_per_tok"], ours["moe_intermediate_size"]) == (4, 2, 24)
    assert ours.get("norm_topk_prob", False) is config.norm_topk_prob  # Qwen2-MoE: the config class default
    assert ours.get("shared_expert_intermediate_size") == getattr(config, "shared_expert_intermediate_size", None)


@pytest.mark.parametrize(
    ("architecture", "missing"),
    [("qwen3moe", "expert_feed_forward_length"), ("qwen2moe", "expert_shared_feed_forward_length")],
)
def test_moe_file_without_an_expert_width_is_refused_by_name(architecture, missing, tmp_path, run_convert):
    from thinker_common.errors import ThinkerError

    model = build_reference(SYNTHETIC[architecture])
    path = write_gguf(model, tmp_path / "broken.gguf", architecture, metadata={f"{architecture}.{missing}": None})
    with pytest.raises(ThinkerError, match=f"GGUF metadata lacks '{architecture}.{missing}'.*the file is incomplete"):
        run_convert(path)
    assert not (tmp_path / "out").exists()


def test_moe_file_without_dense_width_converts(tmp_path, run_convert):
    """feed_forward_length is the width of dense layers, which llama.cpp's MoE architectures do not have."""
    model = build_reference(SYNTHETIC["qwen3moe"])
    path = write_gguf(model, tmp_path / "t.gguf", "qwen3moe", metadata={"qwen3moe.feed_forward_length": None})
    result = run_convert(path)
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)


def test_quantized_moe_file_converts_with_parity(tmp_path, run_convert):
    """Expert stacks stored block-quantized (Q8_0, as llama.cpp's quantized files store them): dequantized 3-D on
    read, bit for bit as transformers' GGUF loading dequantizes them, so the parity gate holds at its tolerance."""
    import gguf

    config = SYNTHETIC["qwen3moe"]
    path = write_gguf(build_reference(config), tmp_path / "q8.gguf", "qwen3moe", quantization="Q8_0")
    kinds = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    result = run_convert(path)
    assert result.parity.passed, result.parity.table()
    assert result.parity.results[0].max_abs_diff == 0


def test_moe_metadata_disagreeing_with_the_expert_stacks_is_named(tmp_path, run_convert):
    """An expert count the stacked tensors do not hold: refused before a byte is read, naming the stacks and the
    GGUF metadata (not a config.json the user does not have)."""
    from thinker_common.errors import ThinkerError

    model = build_reference(SYNTHETIC["qwen3moe"])
    path = write_gguf(model, tmp_path / "m.gguf", "qwen3moe", metadata={"qwen3moe.expert_count": 3})
    with pytest.raises(ThinkerError) as caught:
        run_convert(path)
    message = str(caught.value)
    assert "blk.0.ffn_gate_exps.weight (+1): (4, 48, 32), expected (3, 48, 32)" in message
    assert message.endswith("the GGUF metadata does not describe these weights")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("by_layer", [False, True], ids=["whole", "by-layer"])
def test_a_gguf_file_is_parsed_once_per_conversion_and_check(by_layer, tmp_path, run_convert, monkeypatch):
    """The conversion reads the file for its tensors and the parity gate's reference reads it through transformers
    for the config, the tokenizer and the weights (or layer by layer): one parse of the header serves them all
    (thinker_common/gguf_reader.py ``gguf_read_once``; a parse of a real vocabulary takes seconds), and so does one
    for ``thinker verify``. A file changed between two conversions is parsed afresh, and the readers are gguf's own
    again outside them."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    from converter.convert import verify

    parsed = []
    real_init = GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        parsed.append(str(path))
        real_init(self, path, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counted)
    model = build_reference(SYNTHETIC["qwen2"])
    (tmp_path / "gguf").mkdir()
    path = write_gguf(model, tmp_path / "gguf" / "tiny.gguf", "qwen2")
    result = run_convert(path, verify_by_layer=by_layer)
    assert result.parity.passed and len(parsed) == 1, parsed
    verify(path, result.output, by_layer=by_layer)
    assert len(parsed) == 2, parsed
    assert gguf.GGUFReader is GGUFReader and not isinstance(gguf.get_tensor_name_map, functools._lru_cache_wrapper)

    write_gguf(build_reference(SYNTHETIC["qwen2"], seed=1), path, "qwen2")  # the same path, other bytes
    run_convert(path, name="again", verify_by_layer=by_layer)
    assert len(parsed) == 3, parsed


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's resident size from /proc")
def test_a_shared_reader_handed_out_again_holds_none_of_the_file_resident(tmp_path):
    """A reader shared by ``gguf_read_once`` outlives its users: what one read must not stay resident for the
    rest of a check (as it would not with a reader of its own, unmapped when dropped)."""
    import numpy as np

    from thinker_common.gguf_reader import gguf_read_once, mapped_reader

    path = write_gguf(build_reference(Qwen3Config(**{**TINY, "vocab_size": 4096})), tmp_path / "t.gguf", "qwen3")

    def resident_kib() -> int:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.endswith(str(path))]
        return sum(
            int(line.split()[1])
            for start in starts
            for line in lines[start + 1 : start + 25]
            if line.startswith("Rss:")
        )

    with gguf_read_once():
        reader = mapped_reader(path)
        assert sum(float(np.asarray(t.data, dtype=np.float32).sum()) for t in reader.tensors) != 0
        read = resident_kib()
        assert mapped_reader(path) is reader
        assert read > 4 * resident_kib() and read * 1024 > path.stat().st_size / 2, (read, resident_kib())


def test_a_file_rewritten_within_one_read_once_block_is_parsed_again(tmp_path):
    """``gguf_read_once`` shares one reader per file, told apart by its identity: a file rewritten in place (the same
    inode, other bytes) is parsed afresh, not read through the stale header of the first parse."""
    from thinker_common.gguf_reader import GGUFSource, gguf_read_once, mapped_reader

    path = write_gguf(build_reference(SYNTHETIC["qwen2"]), tmp_path / "tiny.gguf", "qwen2")
    inode = path.stat().st_ino
    with gguf_read_once():
        first = mapped_reader(path)
        assert mapped_reader(path) is first
        write_gguf(build_reference(SYNTHETIC["llama"]), path, "llama")  # GGUFWriter opens "wb": the same inode
        assert path.stat().st_ino == inode
        assert mapped_reader(path) is not first
        source = GGUFSource(path)
        try:
            assert source.config()["general.architecture"] == "llama"
        finally:
            source.close()
