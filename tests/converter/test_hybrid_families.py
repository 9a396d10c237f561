"""The hybrid families through the converter: Qwen3.5 and Qwen3.5-MoE (causal-LM and vision-language layouts) and
Qwen3-Next, each a tiny checkpoint saved with transformers' own classes (``tests/references/hybrid.py``: both layer
types, two value heads per key head, key head size != value head size, partial rotary 0.25 with an mRoPE section,
untied head, a shared expert, a dense layer among Qwen3-Next's sparse ones, every weight random), with the
multi-token-prediction tensors ``mtp.*`` the Hub checkpoints carry.

Each is converted through the real command line with the parity gate on, then held directly to its reference class:
float32 logits (max |Δlogit| <= 1e-4), 12 greedy tokens, a left-padded batch against its rows run alone, and the way
back (``--to``) bit-exact. Multimodal: the converted Qwen3.5 and Qwen3-Omni thinkers given the references' own
``inputs_embeds`` and 3-D / 4-D positions give their text decoders' logits.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from convert_helpers import class_mrope_streams
from references import qwen3_omni, qwen3_vl
from references.hybrid import (
    LAYER_TYPES,
    capture_language_model_inputs,
    left_pad,
    qwen3_5_config,
    qwen3_5_moe_config,
    qwen3_5_moe_vl_config,
    qwen3_5_vl_config,
    qwen3_next_config,
    reference,
    run_image_prompt,
    text_image_text_positions,
    token_ids,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

import thinker.modeling_thinker
from converter.cli import convert_command
from converter.engine import translate_config
from converter.families import qwen3_omni as qwen3_omni_family
from converter.families import qwen3_vl as qwen3_vl_family
from converter.families.qwen3_next import ba_groups, qkvz_groups
from converter.ops import JoinHeadGroups, SplitHeadGroups
from converter.parity import check_parity
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import mrope_streams

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in float32
GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
MTP = "mtp."
CAUSAL_LM = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread, so that the tests do not wait on a thread pool fighting for a shared machine's cores
    (a 32-wide matmul takes 200x longer on two busy threads than on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(*args: str | Path):
    return CliRunner().invoke(convert_command, [str(arg) for arg in args], catch_exceptions=False)


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def add_mtp_tensors(folder: Path, hidden: int) -> None:
    """What a Hub checkpoint holds beside the decoder: a multi-token-prediction head (a few of its tensors)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[MTP + "fc.weight"] = torch.ones(hidden, 2 * hidden)
    tensors[MTP + "norm.weight"] = torch.ones(hidden)
    tensors[MTP + "layers.0.self_attn.q_proj.weight"] = torch.ones(2 * hidden, hidden)
    save_file(tensors, path, metadata={"format": "pt"})


@dataclass(frozen=True)
class Case:
    family: str
    model_class: type
    config: object
    vision_language: bool = False
    fused_experts: bool = False
    way_back: bool = True  # False: fused experts come back per expert, as on the Hub (the per-expert case checks it)


CASES = {
    "qwen3_5": Case("qwen3_5", Qwen3_5ForCausalLM, qwen3_5_config),
    "qwen3_5-vl": Case("qwen3_5", Qwen3_5ForConditionalGeneration, qwen3_5_vl_config, vision_language=True),
    "qwen3_5_moe": Case("qwen3_5_moe", Qwen3_5MoeForCausalLM, qwen3_5_moe_config),
    # the fused 3-D experts transformers writes with save_original_format=False, in the vision-language layout
    "qwen3_5_moe-vl-fused": Case(
        "qwen3_5_moe",
        Qwen3_5MoeForConditionalGeneration,
        qwen3_5_moe_vl_config,
        vision_language=True,
        fused_experts=True,
        way_back=False,
    ),
    "qwen3_next": Case("qwen3_next", Qwen3NextForCausalLM, qwen3_next_config),
}


@dataclass
class Converted:
    case: Case
    reference: torch.nn.Module
    source: Path
    output: Path
    cli_output: str


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """``conversions(name)``: case ``name``'s reference saved as its users find it (plus ``mtp.*``) and converted
    with ``--verify``; once per module."""
    done: dict[str, Converted] = {}

    def get(name: str) -> Converted:
        if name not in done:
            case, root = CASES[name], tmp_path_factory.mktemp(name)
            model = reference(case.model_class, case.config())
            model.save_pretrained(root / "source", save_original_format=not case.fused_experts)
            add_mtp_tensors(root / "source", model.config.get_text_config().hidden_size)
            result = cli(root / "source", root / "thinker", "--verify")
            assert result.exit_code == 0, result.output
            done[name] = Converted(case, model, root / "source", root / "thinker", result.output)
        return done[name]

    return get


def load_thinker(folder: Path) -> ThinkerForCausalLM:
    return ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(CASES))
def test_converts_with_the_parity_gate(conversions, name):
    converted = conversions(name)
    case = converted.case
    assert f"({case.family})" in converted.cli_output and "pass" in converted.cli_output
    parity = json.loads((converted.output / "parity.json").read_text())
    expected_reference = converted.reference.__class__.__name__  # the vision-language class for that layout
    assert parity["passed"] and parity["reference"] == expected_reference
    fp32 = parity["results"][0]
    assert (
        fp32["dtype"] == "float32"
        and fp32["max_abs_diff"] <= 1e-4
        and fp32["greedy_identical"] == fp32["greedy_prompts"] == 4
    )

    config = ThinkerConfig.from_pretrained(converted.output)
    assert config.layer_types == LAYER_TYPES and not config.tie_word_embeddings
    assert config.attention_output_gate and config.norm_zero_centered and config.qk_norm
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (12, 8)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    if case.family == "qwen3_next":  # plain partial RoPE; a dense layer among the sparse ones
        assert "mrope_section" not in config.rope_parameters
        assert config.mlp_layer_types == ["sparse", "sparse", "dense", "sparse"] and config.norm_topk_prob
    else:
        assert config.rope_parameters["mrope_section"] == [2, 1, 1] and config.rope_parameters["mrope_interleaved"]
    if case.family == "qwen3_5_moe":
        assert config.mlp_layer_types == ["sparse"] * 4 and config.norm_topk_prob
        assert config.shared_expert_intermediate_size == 24

    names = list(safetensors_of(converted.output))
    assert not [name for name in names if name.startswith((MTP, "model.visual.", "model.language_model."))]
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "lm_head.weight" in names


@torch.no_grad()
@pytest.mark.parametrize("name", list(CASES))
def test_logits_greedy_tokens_and_left_padding(conversions, name):
    converted = conversions(name)
    ours, theirs = load_thinker(converted.output), converted.reference
    rows = [token_ids(batch=1, length=n, seed=n, high=88)[0] for n in (10, 5)]  # below the vision placeholder ids
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    batch = ours(ids, attention_mask=mask, position_ids=positions).logits
    expected = theirs(ids, attention_mask=mask, position_ids=positions).logits
    assert_close(batch[real], expected[real], **TOL)
    for i, row in enumerate(rows):  # each row alone: the padding changes nothing, recurrent state included
        assert_close(batch[i, real[i]], ours(row[None]).logits[0], **TOL)

    prompt = rows[0][None]
    assert torch.equal(ours.generate(prompt, **GREEDY), theirs.generate(prompt, **GREEDY))
    padded = ours.generate(ids, attention_mask=mask, **GREEDY)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        assert torch.equal(padded[i], ours.generate(row[None], **GREEDY)[0, len(row) :]), f"row {i}"


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.way_back])
def test_way_back_is_bit_exact(conversions, name, tmp_path):
    """``--to FAMILY`` writes the causal-LM layout; every tensor of the source's decoder comes back bit for bit (the
    vision tower and the MTP head were dropped on the way in; from the vision-language layout the names lose their
    ``language_model.``)."""
    converted = conversions(name)
    case = converted.case
    back = cli(converted.output, tmp_path / "back", "--to", case.family, "--verify")
    assert back.exit_code == 0, back.output
    assert json.loads((tmp_path / "back" / "parity.json").read_text())["passed"]

    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == converted.reference.config.get_text_config().model_type  # qwen3_5_text ...
    assert written["architectures"] == [CAUSAL_LM[case.family]]
    # as save_pretrained writes it: the text config's own keys, none of PretrainedConfig's defaults (id2label ...)
    expected = converted.reference.config.get_text_config().to_diff_dict()
    assert set(written) - {"architectures", "dtype"} == set(expected) - {"architectures", "dtype"}
    source = {
        name.replace("model.language_model.", "model."): tensor
        for name, tensor in safetensors_of(converted.source).items()
        if not name.startswith((MTP, "model.visual."))
    }
    after = safetensors_of(tmp_path / "back")
    assert sorted(after) == sorted(source)
    for name, tensor in source.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


@pytest.mark.parametrize(
    ("model_class", "make_config"),
    [(Qwen3_5MoeForCausalLM, qwen3_5_moe_config), (Qwen3NextForCausalLM, qwen3_next_config)],
)
def test_a_hybrid_moe_keeps_its_router_loss(model_class, make_config, tmp_path):
    """output_router_logits, as a fine-tuned checkpoint's config keeps it, carried over: a labelled forward adds the
    same router loss as the source class (Qwen3.5-MoE's was dropped: the gate and verify do not compare losses)."""
    model = reference(model_class, make_config(output_router_logits=True, router_aux_loss_coef=0.5))
    model.save_pretrained(tmp_path / "source")
    assert cli(tmp_path / "source", tmp_path / "thinker").exit_code == 0
    converted = load_thinker(tmp_path / "thinker")
    assert converted.config.output_router_logits is True
    ids = token_ids(1, 7)
    with torch.no_grad():
        expected, actual = model(input_ids=ids, labels=ids), converted(input_ids=ids, labels=ids)
    assert_close(actual.aux_loss, expected.aux_loss)
    assert_close(actual.loss, expected.loss)


def test_multimodal_rope_goes_only_where_the_class_reads_it(conversions, tmp_path):
    """Qwen3-Next's class rotates text positions alone, whatever mrope_section its config names: converted without
    it, and a Qwen3.5 Thinker (which has one) is refused by key on the way back to qwen3_next."""
    config = qwen3_next_config()
    config.rope_parameters = dict(config.rope_parameters) | {"mrope_section": [1, 1, 0]}
    reference(Qwen3NextForCausalLM, config).save_pretrained(tmp_path / "next")
    assert cli(tmp_path / "next", tmp_path / "next-thinker").exit_code == 0
    written = json.loads((tmp_path / "next-thinker" / "config.json").read_text())["rope_parameters"]
    assert "mrope_section" not in written
    back = CliRunner().invoke(
        convert_command, [str(conversions("qwen3_5").output), str(tmp_path / "x"), "--to", "qwen3_next"]
    )
    assert back.exit_code == 1 and "not expressible as qwen3_next" in back.output and "mrope_section" in back.output
    assert not (tmp_path / "x").exists()
    dense = CliRunner().invoke(
        convert_command, [str(conversions("qwen3_5").output), str(tmp_path / "x"), "--to", "qwen3"]
    )
    assert "not expressible as qwen3: the config has linear_attention layers" in dense.output, dense.output
    assert "which qwen3 models do not have; theirs are full_attention layers" in dense.output
    moe = CliRunner().invoke(
        convert_command, [str(conversions("qwen3_5").output), str(tmp_path / "x"), "--to", "qwen3_5_moe"]
    )  # the reason first, then the field it shows in (a QA run found only norm_topk_prob named)
    assert "not expressible as qwen3_5_moe: it is dense (no routed experts); the qwen3_5_moe config" in moe.output
    assert not (tmp_path / "x").exists()


def test_mixed_dtypes_keep_the_wider_tensors(tmp_path):
    """Qwen3.5's releases store each linear-attention layer's A_log and gated norm in float32 beside bfloat16
    weights. ``--dtype auto`` keeps those as stored: float32 loads equal the source class's to the bit, and the way
    back gives the source's bits; ``dtype="auto"`` loads both as bfloat16, as transformers does; ``--dtype
    bfloat16`` casts every tensor."""
    model = reference(Qwen3_5ForCausalLM, qwen3_5_config())
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # float32
    model.to(torch.bfloat16).save_pretrained(tmp_path / "source")
    path = tmp_path / "source" / "model.safetensors"
    stored = load_file(path)
    wide = sorted(name for name in stored if name.endswith(("linear_attn.A_log", "linear_attn.norm.weight")))
    stored |= {name: original[name].contiguous() for name in wide}
    save_file(stored, path, metadata={"format": "pt"})

    result = cli(tmp_path / "source", tmp_path / "thinker")
    assert result.exit_code == 0, result.output
    assert f"bfloat16 weights ({len(wide)} tensors kept in float32, as the source stores them)" in result.output
    written = safetensors_of(tmp_path / "thinker")
    assert {name for name, tensor in written.items() if tensor.dtype == torch.float32} == set(wide)
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        expected = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.float32)(ids).logits
        actual = ThinkerForCausalLM.from_pretrained(tmp_path / "thinker", dtype=torch.float32)(ids).logits
    assert torch.equal(actual, expected)
    auto = ThinkerForCausalLM.from_pretrained(tmp_path / "thinker", dtype="auto")
    assert {parameter.dtype for parameter in auto.parameters()} == {torch.bfloat16}

    back = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen3_5")
    assert back.exit_code == 0, back.output
    after = safetensors_of(tmp_path / "back")
    for name, tensor in stored.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    narrow = cli(tmp_path / "source", tmp_path / "narrow", "--dtype", "bfloat16")
    assert narrow.exit_code == 0 and "kept" not in narrow.output
    assert {tensor.dtype for tensor in safetensors_of(tmp_path / "narrow").values()} == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------------
# multimodal through the converter


@torch.no_grad()
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.vision_language])
def test_image_prompt_through_the_converter(conversions, name):
    """The converted Thinker, given what the vision-language class's own forward (Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration) hands its text decoder for a prompt with an image (vision-tower embeddings,
    3-D positions whose rows differ), gives its logits."""
    converted = conversions(name)
    ours, theirs = load_thinker(converted.output), converted.reference
    captured, expected = run_image_prompt(theirs)
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]
    assert positions.shape == (3, 1, 20) and not torch.equal(positions[1], positions[2])
    assert_close(ours(inputs_embeds=embeds, position_ids=positions).logits, expected, **TOL)
    four = torch.cat([torch.arange(20)[None, None], positions])  # (4, B, T), as generate() hands them
    decoder = theirs.model.language_model(inputs_embeds=embeds, position_ids=four).last_hidden_state
    assert_close(ours(inputs_embeds=embeds, position_ids=four).logits, theirs.lm_head(decoder), **TOL)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """A tiny Qwen3-Omni checkpoint converted through the command line, and its reference thinker."""
    root = tmp_path_factory.mktemp("omni")
    source = qwen3_omni.save(root / "source")
    result = cli(source, root / "thinker", "--no-verify")  # the gate itself runs in test_qwen3_omni.py
    assert result.exit_code == 0, result.output
    return load_thinker(root / "thinker"), qwen3_omni.load_reference_thinker(source)


def test_qwen3_omni_keeps_its_mrope(omni):
    ours, _ = omni
    assert ours.config.rope_parameters["mrope_section"] == qwen3_omni.TEXT_CONFIG["rope_parameters"]["mrope_section"]
    assert ours.config.rope_parameters["mrope_interleaved"] and "interleaved" not in ours.config.rope_parameters


def _qwen3_omni_without_section():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    hf = qwen3_omni.tiny_config(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return qwen3_omni_family.QWEN3_OMNI, hf, hf.thinker_config.text_config, Qwen3OmniMoeThinkerTextRotaryEmbedding


def _qwen3_vl_without_section():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    text = qwen3_vl.TEXT_CONFIG | {"head_dim": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    hf = Qwen3VLConfig(text_config=text, vision_config=qwen3_vl.VISION_CONFIG)
    return qwen3_vl_family.QWEN3_VL, hf, hf.text_config, Qwen3VLTextRotaryEmbedding


@pytest.mark.parametrize("make", [_qwen3_omni_without_section, _qwen3_vl_without_section], ids=["omni", "vl"])
def test_without_mrope_section_a_head_of_128_takes_the_classs_fallback(make):
    """A config.json that names no mrope_section (older Qwen3-Omni / Qwen3-VL configs), on the releases' head of 128:
    the text model's rotary embedding falls back to a section of its own ([24, 20, 20], interleaved), read here from
    the class itself. The translated config gives every frequency the position stream the class gives it, so image,
    video and audio prompts (3-D positions) rotate as the reference's."""
    family, hf, text, rotary_class = make()
    assert "mrope_section" not in text.rope_parameters
    rotary = rotary_class(text)
    assert rotary.inv_freq.numel() == 64

    ours = translate_config(family, hf.to_dict(), torch.float32).rope_parameters
    assert ours["mrope_section"] == rotary.mrope_section and ours["mrope_interleaved"] is True
    assert torch.equal(mrope_streams(ours["mrope_section"], ours["mrope_interleaved"]), class_mrope_streams(rotary))


@torch.no_grad()
def test_qwen3_omni_audio_prompt_through_the_converter(omni):
    """A prompt with an audio clip through the reference thinker's own forward (mel features -> audio tower ->
    embeddings at the audio placeholders; positions from the thinker): the converted Thinker, given what the text
    decoder received, gives the thinker's logits."""
    ours, theirs = omni
    theirs.config.audio_token_id = 120  # a placeholder id inside the tiny vocabulary (the release's is 151646)
    frames = 130  # one full 100-frame chunk and a partial one: 17 audio tokens
    text = token_ids(batch=1, length=14, seed=3, high=100)
    ids = torch.cat([text[:, :4], torch.full((1, 17), 120), text[:, 4:]], dim=1)
    features = torch.randn(1, 16, frames, generator=torch.Generator().manual_seed(5))
    captured = capture_language_model_inputs(theirs)
    theirs.model.rope_deltas = None
    expected = theirs(
        input_ids=ids,
        input_features=features,
        feature_attention_mask=torch.ones(1, frames, dtype=torch.long),
        attention_mask=torch.ones_like(ids),
    ).logits
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]
    assert positions.shape == (3, 1, 31)
    assert (embeds[0, 4:21] - theirs.get_input_embeddings()(ids)[0, 4:21]).abs().amin() > 0  # audio embeddings
    assert_close(ours(inputs_embeds=embeds, position_ids=positions).logits, expected, **TOL)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint converted through the command line with its parity gate, and the reference."""
    root = tmp_path_factory.mktemp("qwen3_vl")
    source = qwen3_vl.save(root / "source")
    result = cli(source, root / "thinker", "--verify")
    assert result.exit_code == 0 and "(qwen3_vl)" in result.output, result.output
    from transformers import Qwen3VLForConditionalGeneration

    return load_thinker(root / "thinker"), Qwen3VLForConditionalGeneration.from_pretrained(source).eval(), root


def test_qwen3_vl_converts_its_text_decoder(vl):
    ours, _, root = vl
    assert json.loads((root / "thinker" / "parity.json").read_text())["reference"] == "Qwen3VLForConditionalGeneration"
    assert ours.config.qk_norm and not ours.config.tie_word_embeddings
    assert (
        ours.config.rope_parameters["mrope_section"] == [4, 2, 2] and ours.config.rope_parameters["mrope_interleaved"]
    )
    with safe_open(root / "thinker" / "model.safetensors", "pt") as handle:
        assert not [name for name in handle.keys() if "visual" in name]


@pytest.mark.parametrize("count", [2, 0], ids=["more", "none"])
@pytest.mark.parametrize("mode", ["whole-model", "layer-by-layer"])
def test_a_deepstack_count_translated_wrong_fails_the_gate(vl, mode, count, tmp_path):
    """Text prompts take no DeepStack features, so a converted config naming more (or fewer) DeepStack layers than
    the vision tower's deepstack_visual_indexes passed every logit, and an --inputs-embeds export would take that
    many feature inputs; the gate holds the count equal, both modes. A count translated to 0 (DeepStack dropped)
    fails too: a stage only where both models had one passed it (a mutation run)."""
    from converter.convert import source_family
    from converter.parity_report import DEEPSTACK_STAGE

    _, _, root = vl
    family = source_family(root / "source")
    sound = check_parity(root / "source", root / "thinker", family, mode)
    assert sound.passed and DEEPSTACK_STAGE in [stage.name for stage in sound.results[0].unreached]
    wrong = tmp_path / "thinker"
    shutil.copytree(root / "thinker", wrong)
    config = json.loads((wrong / "config.json").read_text())
    assert config["deepstack_layers"] == 1
    (wrong / "config.json").write_text(json.dumps({**config, "deepstack_layers": count}))
    report = check_parity(root / "source", wrong, family, mode)
    fp32 = report.results[0]
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.top1_agreement == 1.0  # the prompts see nothing
    assert not report.passed and fp32.first_divergence == DEEPSTACK_STAGE, report.table()


def test_a_deepstack_key_a_model_does_not_read_is_not_its_count(tmp_path):
    """A Qwen3.5 vision config carrying ``deepstack_visual_indexes`` (a key Qwen3.5's classes never read: its tower
    has no DeepStack mergers): the gate counts the mergers the reference runs, not the key, so a sound conversion
    passes (a review: it failed on the key's count against the Thinker's 0)."""
    source = tmp_path / "source"
    reference(Qwen3_5ForConditionalGeneration, qwen3_5_vl_config()).save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    (source / "config.json").write_text(json.dumps(config))
    result = cli(source, tmp_path / "thinker", "--verify")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "thinker" / "config.json").read_text())["deepstack_layers"] == 0


def test_qwen3_vl_moe_converts_from_either_expert_layout(tmp_path):
    """Qwen3-VL-MoE's experts as the Hub stores them (transposed) and as save_pretrained writes them: both convert
    with parity, whole and layer by layer, to the same tensors."""
    from converter.cli import verify_command

    converted = {}
    for layout in ("hub", "saved"):
        source = qwen3_vl.save(tmp_path / layout, moe=True, hub_layout=layout == "hub")
        with safe_open(source / "model.safetensors", "pt") as handle:
            shape = handle.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
        assert shape == ([4, 32, 48] if layout == "hub" else [4, 48, 32])
        result = cli(source, tmp_path / f"{layout}-thinker", "--verify")
        assert result.exit_code == 0 and "(qwen3_vl_moe)" in result.output, result.output
        by_layer = CliRunner().invoke(
            verify_command, [str(source), str(tmp_path / f"{layout}-thinker"), "--verify-by-layer"]
        )
        assert by_layer.exit_code == 0, by_layer.output
        converted[layout] = load_file(tmp_path / f"{layout}-thinker" / "model.safetensors")
    assert converted["hub"].keys() == converted["saved"].keys()
    assert all(torch.equal(converted["hub"][name], converted["saved"][name]) for name in converted["hub"])
    config = ThinkerConfig.from_pretrained(tmp_path / "hub-thinker")
    assert config.norm_topk_prob and config.mlp_layer_types == ["sparse", "dense", "sparse"]


@torch.no_grad()
@pytest.mark.parametrize("family", ["omni", "vl"])
def test_an_image_prompt_with_its_deepstack_features_gives_the_models_logits(family, request):
    """Qwen3-VL's and Qwen3-Omni's image prompts through their own forward (pixels -> vision tower -> embeddings at
    the placeholders, DeepStack features of the tower's inner layer added after the decoder's first layer, positions
    from get_rope_index): given what the text decoder received, DeepStack included, the converted Thinker gives the
    model's logits and, generating, its tokens; without the DeepStack features, other logits."""
    ours, theirs = request.getfixturevalue(family)[:2]
    config = theirs.config
    for key, value in (("image_token_id", 120), ("vision_start_token_id", 121), ("vision_end_token_id", 122)):
        setattr(config, key, value)  # placeholder ids inside the tiny vocabulary (the releases' are past 151000)
    image = [121] + [120] * 6 + [122]
    text = token_ids(batch=1, length=12, seed=4, high=100)[0]
    ids = torch.cat([text[:5], torch.tensor(image), text[5:]])[None]
    vision = config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(24, patch, generator=torch.Generator().manual_seed(6))
    image_inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 6]])}
    if family == "vl":
        image_inputs["mm_token_type_ids"] = (ids == 120).int()
    captured = capture_language_model_inputs(theirs)
    if hasattr(theirs, "rope_deltas"):
        theirs.rope_deltas = None
    theirs.model.rope_deltas = None
    expected = theirs(input_ids=ids, attention_mask=torch.ones_like(ids), **image_inputs).logits
    prompt = dict(captured)
    assert len(prompt["deepstack_visual_embeds"]) == 1 and int(prompt["visual_pos_masks"].sum()) == 6
    assert_close(ours(**prompt).logits, expected, **TOL)
    without = {key: prompt[key] for key in ("inputs_embeds", "position_ids")}
    assert (ours(**without).logits - expected).abs().max() > 100 * TOL["atol"]

    theirs.model.rope_deltas = None
    continuation = theirs.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **image_inputs)[:, ids.shape[1] :]
    generated = ours.generate(**prompt, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(generated[:, -6:], continuation)
    # beams and several samples: generate repeats each prompt's rows, DeepStack features included
    for search in (dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)):
        theirs.model.rope_deltas = None
        torch.manual_seed(0)
        continuation = theirs.generate(input_ids=ids, max_new_tokens=4, **search, **image_inputs)[:, ids.shape[1] :]
        torch.manual_seed(0)
        generated = ours.generate(**prompt, attention_mask=torch.ones_like(ids), max_new_tokens=4, **search)
        assert torch.equal(generated[:, -4:], continuation), search


@torch.no_grad()
@pytest.mark.parametrize("rows", [3, 4])
@pytest.mark.parametrize("family", ["omni", "vl"])
def test_distinct_position_rows_through_the_converter(family, rows, request):
    """3-D positions whose temporal/height/width rows differ (an image block, and the 4-row form generate() hands
    on), with embeddings standing for the vision tower's, without the deepstack features that Qwen3-Omni's and
    Qwen3-VL's image prompts also feed their first layers: the converted Thinker gives the text decoder's logits,
    which the same embeddings at text positions do not."""
    ours, theirs = request.getfixturevalue(family)[:2]
    positions = text_image_text_positions(batch=2)
    if rows == 4:
        positions = torch.cat([torch.arange(15).expand(1, 2, -1), positions])
    embeds = torch.randn(2, 15, ours.config.hidden_size, generator=torch.Generator().manual_seed(7))
    decoder = theirs.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    expected = theirs.lm_head(decoder)
    actual = ours(inputs_embeds=embeds, position_ids=positions).logits
    assert_close(actual, expected, **TOL)
    # the tiny models' logits are small (Qwen3-VL's near 0.2): the positions' effect is judged against the
    # conversion's own difference
    at_text_positions = (ours(inputs_embeds=embeds).logits - expected).abs().max()
    assert at_text_positions > 1e-3 and at_text_positions > 1e3 * (actual - expected).abs().max()


# ----------------------------------------------------------------------------------------------------------------
# the parity gate on hybrid models: it would catch a bug


@pytest.fixture(scope="module")
def next_conversion(conversions) -> Converted:
    return conversions("qwen3_next")


def test_gate_fails_on_value_heads_out_of_order(next_conversion, tmp_path):
    """What a wrong reorder of Qwen3-Next's grouped rows would write: layer 0's two output-gate heads of one key head
    swapped. The gate fails and names the layer."""
    planted = shutil.copytree(next_conversion.output, tmp_path / "planted")
    path = planted / "model.safetensors"
    tensors = load_file(path)
    z = tensors["model.layers.0.linear_attn.in_proj_z.weight"]
    tensors["model.layers.0.linear_attn.in_proj_z.weight"] = torch.cat([z[8:16], z[:8], z[16:]])  # heads 0 <-> 1
    save_file(tensors, path, metadata={"format": "pt"})
    report = check_parity(next_conversion.source, planted)
    assert not report.passed and report.results[0].first_divergence == "layer 0"
    assert check_parity(next_conversion.source, next_conversion.output).passed


def test_gate_fails_when_padding_leaks_into_the_recurrent_state(next_conversion, monkeypatch):
    """A Thinker whose linear-attention layers let left padding into their state agrees with the reference on
    unpadded rows only: the gate's left-padded batch catches it."""
    monkeypatch.setattr(thinker.modeling_thinker, "apply_mask_to_padding_states", lambda states, mask: states)
    report = check_parity(next_conversion.source, next_conversion.output)
    assert not report.passed and report.results[0].max_abs_diff > report.results[0].tolerance


# ----------------------------------------------------------------------------------------------------------------
# Qwen3-Next's reorder operation


@pytest.mark.parametrize(
    ("key_heads", "value_heads", "key_dim", "value_dim"), [(3, 6, 5, 7), (1, 4, 6, 3), (2, 2, 4, 4)]
)
def test_split_head_groups_is_transformers_ordering_and_reverses_exactly(key_heads, value_heads, key_dim, value_dim):
    """The split projections give exactly the q, k, v, z, b, a that Qwen3NextGatedDeltaNet's own
    ``fix_query_key_value_ordering`` derives from the fused ones; the inverse restores the fused tensors bit for bit;
    shapes come out of meta tensors too, and a row count that fits no grouping is refused."""
    sizes = dict(
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim,
    )
    hf_config = Qwen3NextConfig(hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"], **sizes)
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(hf_config, 0)
    config = ThinkerConfig(hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"], **sizes)
    qkvz, ba = layer.in_proj_qkvz.weight.detach(), layer.in_proj_ba.weight.detach()
    split_qkvz, split_ba = SplitHeadGroups(qkvz_groups, (3, 1)), SplitHeadGroups(ba_groups, (1, 1))
    qkv, z = split_qkvz([qkvz], config)
    b, a = split_ba([ba], config)

    # The weights' rows as the "projected" features: the ordering is then pure row selection, compared exactly.
    expected = layer.fix_query_key_value_ordering(qkvz.T[None], ba.T[None])  # q, k, v, z (1, C, heads, dim); b, a
    q, k, v = qkv.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim])
    for mine, theirs in zip((q, k, v, z, b, a), expected, strict=True):
        assert torch.equal(mine.T, theirs.reshape(mine.T.shape))

    assert torch.equal(split_qkvz.inverse()([qkv, z], config)[0], qkvz)
    assert torch.equal(JoinHeadGroups(ba_groups, (1, 1))([b, a], config)[0], ba)
    meta = split_qkvz([torch.empty(qkvz.shape, device="meta")], config)
    assert [t.shape for t in meta] == [qkv.shape, z.shape]
    with pytest.raises(ValueError, match="head groups"):
        split_qkvz([qkvz[:-1]], config)


# ----------------------------------------------------------------------------------------------------------------
# what is refused, by name; the Hub's config spellings


@pytest.fixture(scope="module")
def vl_source(conversions) -> Path:
    return conversions("qwen3_5-vl").source


def edited_copy(source: Path, folder: Path, drop: str | None = None, text_config: dict | None = None, **top) -> Path:
    """A copy of ``source`` without the tensor ``drop``, its config.json updated (``text_config`` keys inside it;
    a value of None deletes the key)."""
    shutil.copytree(source, folder)
    if drop:
        tensors = load_file(folder / "model.safetensors")
        del tensors[drop]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    for section, changes in ((config, top), (config.get("text_config", config), text_config or {})):
        for key, value in changes.items():
            section.pop(key, None) if value is None else section.update({key: value})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_missing_linear_attention_tensor_is_named(vl_source, tmp_path):
    missing = "model.language_model.layers.2.linear_attn.in_proj_b.weight"
    source = edited_copy(vl_source, tmp_path / "source", drop=missing)
    result = cli(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and "lacks tensors" in result.output and missing in result.output
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_beside_the_vision_tower_is_named(vl_source, tmp_path):
    source = edited_copy(vl_source, tmp_path / "source")
    tensors = load_file(source / "model.safetensors")
    tensors["model.audio.proj.weight"] = torch.ones(2, 2)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    result = cli(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and "model.audio.proj.weight" in result.output


@pytest.mark.parametrize(
    ("text_config", "named"),
    [
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"layer_types": ["linear_attention", "chunked_attention"] * 2}, "chunked_attention"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
    ],
    ids=["ungated", "chunked", "value-heads", "linear-only"],
)
def test_what_thinker_cannot_represent_is_refused_by_key(vl_source, tmp_path, text_config, named):
    source = edited_copy(vl_source, tmp_path / "source", text_config=text_config)
    result = cli(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and named in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_a_vision_language_config_without_its_text_config_is_refused_by_key(vl_source, tmp_path):
    """Without it transformers takes its default sizes, and every tensor would be reported missing or misshapen."""
    source = edited_copy(vl_source, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    del config["text_config"]
    (source / "config.json").write_text(json.dumps(config))
    result = cli(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1, result.output
    assert "(model_type 'qwen3_5') has no text_config, which holds its text decoder's sizes" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_hub_config_spelling_of_qwen3_5(vl_source, tmp_path):
    """Hub config.json files of Qwen3.5 may name ``full_attention_interval`` instead of ``layer_types``, carry the
    vLLM keys ``attn_output_gate`` / ``mamba_ssm_dtype`` / ``mtp_num_hidden_layers`` and an ``mlp_only_layers`` the
    classes do not read: the same Thinker config comes out. The head is tied by the outer ``tie_word_embeddings``."""
    hub_keys = dict(layer_types=None, full_attention_interval=2, attn_output_gate=True, mamba_ssm_dtype="float32")
    hub_keys |= dict(mtp_num_hidden_layers=1, mlp_only_layers=[])
    source = edited_copy(vl_source, tmp_path / "source", text_config=hub_keys)
    assert cli(source, tmp_path / "out", "--no-verify").exit_code == 0
    assert ThinkerConfig.from_pretrained(tmp_path / "out").layer_types == LAYER_TYPES

    tied = edited_copy(vl_source, tmp_path / "tied", tie_word_embeddings=True)
    result = cli(tied, tmp_path / "tied-out", "--no-verify")  # the outer flag ties, so lm_head.weight is one too many
    assert result.exit_code == 1 and "tie_word_embeddings=true" in result.output and "lm_head.weight" in result.output


def test_hub_config_spelling_of_qwen3_next(next_conversion, tmp_path):
    """Qwen3-Next-80B-A3B's config.json spells RoPE the transformers-4 way (``rope_theta``, ``partial_rotary_factor``,
    ``rope_scaling: null``) and has no ``layer_types``: it translates to the same model."""
    source = shutil.copytree(next_conversion.source, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": 0.25, "rope_scaling": None}
    config["full_attention_interval"] = 2
    (source / "config.json").write_text(json.dumps(config))
    assert cli(source, tmp_path / "out", "--no-verify").exit_code == 0
    converted = ThinkerConfig.from_pretrained(tmp_path / "out")
    assert converted.to_dict() == ThinkerConfig.from_pretrained(next_conversion.output).to_dict()
    with safe_open(source / "model.safetensors", "pt") as handle:
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in handle.keys()
