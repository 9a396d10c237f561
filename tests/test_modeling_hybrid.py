"""The hybrid families as Thinker configurations: Qwen3.5, Qwen3.5-MoE and Qwen3-Next against transformers' own
classes, and multimodal positions against the Qwen3.5 vision-language model and the Qwen3-Omni thinker.

The tiny, awkward references (both layer types, two value heads per key head, key and value head sizes that differ,
partial interleaved mRoPE, untied head, MoE with a gated shared expert, every weight random) are built by
``tests/references/hybrid.py``. Configs are translated by the small function here, not by the converter, so these
tests hold the model to the references on their own. Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are
reordered into the Thinker's split layout by the converter's own table (``converter/families/qwen3_next.py``), so
that the reorder lives in one place.
"""

from __future__ import annotations

import copy

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from references import qwen3_omni
from references.hybrid import (
    LAYER_TYPES,
    left_pad,
    qwen3_5_config,
    qwen3_5_moe_config,
    qwen3_5_vl_config,
    qwen3_next_config,
    reference,
    run_image_prompt,
    text_image_text_positions,
    token_ids,
)
from seeded_weights import randomize_parameters
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    DynamicCache,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

from converter.families.qwen3_next import FUSED_PROJECTIONS
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.configuration_thinker import mrope_interleaved
from thinker.modeling_thinker import CACHE_ARG, ThinkerRMSNorm

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in fp32
ATTENTION = ["eager", "sdpa"]

# Qwen's names are the Thinker's; the switches Qwen hard-codes in these classes are explicit here.
TRANSLATED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
)
HYBRID_SWITCHES = dict(qk_norm=True, attention_output_gate=True, norm_zero_centered=True)


def thinker_config_from(reference_config, **switches) -> ThinkerConfig:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / Qwen3-Omni text config as a ThinkerConfig, translated here rather than
    by the converter's family modules (tests/converter/test_hybrid_families.py holds those to the same references)."""
    fields = {name: getattr(reference_config, name) for name in TRANSLATED_FIELDS if hasattr(reference_config, name)}
    if reference_config.model_type == "qwen3_5_moe_text":
        fields["norm_topk_prob"] = True  # Qwen3.5-MoE's router always renormalises its top-k
    fields["rope_parameters"] = dict(reference_config.rope_parameters)
    return ThinkerConfig(**fields, **switches)


def build_thinker(config: ThinkerConfig, state: dict[str, torch.Tensor], attn: str) -> ThinkerForCausalLM:
    model = ThinkerForCausalLM._from_config(config, attn_implementation=attn, experts_implementation="eager").eval()
    model.load_state_dict(state, strict=True)  # every parameter by name, nothing left over
    return model


def qwen3_next_split_projections(state: dict[str, torch.Tensor], config: ThinkerConfig) -> dict:
    """Qwen3-Next's fused, per-key-head grouped in_proj_qkvz / in_proj_ba split into the Thinker's in_proj_qkv /
    in_proj_z / in_proj_b / in_proj_a by the converter's own rules."""
    out = dict(state)
    for entry in FUSED_PROJECTIONS:
        for layer in range(config.num_hidden_layers):
            source = entry.sources[0].replace("{layer}", str(layer))
            if source in out:
                targets = [name.replace("{layer}", str(layer)) for name in entry.targets]
                out.update(zip(targets, entry.op([out.pop(source)], config), strict=True))
    return out


def language_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5's vision-language layout with the vision tower dropped: model.language_model.* -> model.*."""
    return {
        name.replace("model.language_model.", "model."): tensor
        for name, tensor in state.items()
        if not name.startswith("model.visual.")
    }


def family_pair(family: str, attn: str):
    """(reference, thinker) with the same weights."""
    if family == "qwen3_5":
        ref = reference(Qwen3_5ForCausalLM, qwen3_5_config(), attn)
        return ref, build_thinker(thinker_config_from(ref.config, **HYBRID_SWITCHES), ref.state_dict(), attn)
    if family == "qwen3_5_moe":
        ref = reference(Qwen3_5MoeForCausalLM, qwen3_5_moe_config(), attn)
        config = thinker_config_from(ref.config, **HYBRID_SWITCHES)
        assert config.mlp_layer_types == ["sparse"] * 4
        return ref, build_thinker(config, ref.state_dict(), attn)
    if family == "qwen3_next":
        ref = reference(Qwen3NextForCausalLM, qwen3_next_config(), attn)
        config = thinker_config_from(ref.config, **HYBRID_SWITCHES)
        assert config.mlp_layer_types == ["sparse", "sparse", "dense", "sparse"]
        return ref, build_thinker(config, qwen3_next_split_projections(ref.state_dict(), config), attn)
    if family == "qwen3_5_vl":
        ref = reference(Qwen3_5ForConditionalGeneration, qwen3_5_vl_config(), attn)
        config = thinker_config_from(ref.config.text_config, **HYBRID_SWITCHES)
        return ref, build_thinker(config, language_model_state(ref.state_dict()), attn)
    raise ValueError(family)


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl"]


# ----------------------------------------------------------------------------------------------------------------
# parity with the references: logits, hidden states, router logits, greedy continuations


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_reference(family, attn):
    ref, thinker = family_pair(family, attn)
    ids = token_ids(length=70)  # past one 64-token chunk of the delta rule
    with torch.no_grad():
        ours = thinker(ids, output_hidden_states=True, output_router_logits=True, use_cache=False)
        theirs = ref(ids, output_hidden_states=True, output_router_logits=True, use_cache=False)
    assert_close(ours.logits, theirs.logits, **TOL)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 5
    for layer, (mine, other) in enumerate(zip(ours.hidden_states, theirs.hidden_states, strict=True)):
        assert_close(mine, other, **TOL, msg=lambda m, layer=layer: f"hidden state {layer}: {m}")
    if family in ("qwen3_5_moe", "qwen3_next"):
        assert len(ours.router_logits) == len(theirs.router_logits) == (4 if family == "qwen3_5_moe" else 3)
        for mine, other in zip(ours.router_logits, theirs.router_logits, strict=True):
            assert_close(mine, other, **TOL)

    prompt = token_ids(batch=1, length=9, seed=2)
    greedy = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(thinker.generate(prompt, **greedy), ref.generate(prompt, **greedy))


# ----------------------------------------------------------------------------------------------------------------
# cache: prefill then one-token decode, both layer types


def test_cache_holds_kv_and_recurrent_state():
    _, thinker = family_pair("qwen3_5", "sdpa")
    cache = DynamicCache(config=thinker.config)
    assert [type(layer) for layer in cache.layers] == [LinearAttentionLayer, DynamicLayer] * 2
    with torch.no_grad():
        thinker(token_ids(length=7), use_cache=True, **{CACHE_ARG: cache})
    assert cache.get_seq_length() == 7
    config = thinker.config
    conv = cache.layers[0].conv_states[0]
    state = cache.layers[0].recurrent_states[0]
    conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_channels += config.linear_num_value_heads * config.linear_value_head_dim
    assert conv.shape == (2, conv_channels, config.linear_conv_kernel_dim)
    assert state.shape == (2, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    assert cache.layers[1].keys.shape == (2, 2, 7, 32)
    assert thinker._is_stateful and not ThinkerForCausalLM(ThinkerConfig())._is_stateful


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_prefill_then_decode_equals_full_forward(family, attn):
    """The prompt in two parts (a chunked prefill: the second, 22 tokens, runs the chunked delta rule from the
    cached state and the conv over the cached window; a mutation run found either dropped passed every test but
    assisted decoding's), then one token at a time; together the reference's logits over the whole sequence. The
    parts split at a multiple of the delta rule's 64-token chunks, where the whole sequence's chunks split too."""
    ref, thinker = family_pair(family, attn)
    ids = token_ids(batch=2, length=156, seed=3)
    first, second, steps = ids[:, :128], ids[:, 128:150], ids[:, 150:]
    with torch.no_grad():
        full = ref(ids, use_cache=False).logits
        cache = DynamicCache(config=thinker.config)
        logits = [thinker(part, use_cache=True, **{CACHE_ARG: cache}).logits for part in (first, second)]
        for step in steps.T:  # one token at a time: the one-step delta rule and the conv-state update
            logits.append(thinker(step[:, None], use_cache=True, **{CACHE_ARG: cache}).logits)
    assert cache.get_seq_length() == 156
    assert_close(torch.cat(logits, dim=1), full, **TOL)


def test_multimodal_rope_interleaves_unless_told_not_to():
    """transformers' Qwen3-VL, Qwen3.5 and Qwen3-Omni classes interleave their sections whatever the config says, so a
    config naming ``mrope_section`` alone is interleaved (a mutation defaulting to contiguous sections passed every
    test: their configs all name the key)."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}
    config = ThinkerConfig(hidden_size=32, num_attention_heads=2, head_dim=16, rope_parameters=rope)
    assert mrope_interleaved(config.rope_parameters)
    assert not mrope_interleaved({**rope, "mrope_interleaved": False})
    assert ThinkerForCausalLM(config).model.rotary_emb.mrope_interleaved is True


def test_cache_without_linear_layers_is_refused():
    _, thinker = family_pair("qwen3_5", "sdpa")
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        thinker(token_ids(length=3), use_cache=True, **{CACHE_ARG: DynamicCache()})


# ----------------------------------------------------------------------------------------------------------------
# left padding, inputs_embeds


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_left_padded_batch_equals_rows_alone(family, attn):
    ref, thinker = family_pair(family, attn)
    rows = [token_ids(batch=1, length=n, seed=n)[0] for n in (80, 13)]  # the short row has 67 padding tokens
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = {
            name: m(ids, attention_mask=mask, position_ids=positions).logits
            for name, m in (("ours", thinker), ("ref", ref))
        }
        for i, row in enumerate(rows):
            real = mask[i].bool()
            alone = thinker(row[None]).logits[0]
            assert_close(batch["ours"][i, real], alone, **TOL)
            assert_close(batch["ref"][i, real], ref(row[None]).logits[0], **TOL)  # the reference's own behaviour
            assert_close(batch["ours"][i, real], batch["ref"][i, real], **TOL)

    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    generated = thinker.generate(ids, attention_mask=mask, **greedy)[:, ids.shape[1] :]
    assert torch.equal(generated, ref.generate(ids, attention_mask=mask, **greedy)[:, ids.shape[1] :])
    for i, row in enumerate(rows):
        assert torch.equal(generated[i], thinker.generate(row[None], **greedy)[0, len(row) :]), f"row {i}"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_assisted_decoding_rolls_the_state_back_as_the_reference_does(family):
    """Prompt-lookup decoding drafts tokens and crops the cache back to the last one accepted; a linear layer's
    recurrent state can only go back through the states the cache recorded for it, which transformers >= 5.25 asks
    a layer for (``get_recurrent_states_to_keep``); earlier releases refuse assisted decoding of hybrid models. Ours
    does what the reference does, token for token or refusal for refusal. (Under 5.25.0 the reference's assisted
    tokens part from its own plain greedy ones at the second token, which is not a near tie: transformers' rollback,
    which ours follows, not a difference between the two.)"""
    ref, thinker = family_pair(family, "sdpa")
    repeated = token_ids(batch=1, length=12, seed=5)
    ids = torch.cat([repeated, repeated[:, :7]], dim=1)  # a repeat, so the lookup drafts tokens to accept
    greedy = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(thinker.generate(ids, **greedy), ref.generate(ids, **greedy))
    assisted = {}
    for name, model in (("ref", ref), ("ours", thinker)):
        try:
            assisted[name] = model.generate(ids, prompt_lookup_num_tokens=3, **greedy)
        except ValueError as err:
            assisted[name] = str(err).replace(type(model).__name__, "MODEL")
    if isinstance(assisted["ref"], str):
        assert assisted["ours"] == assisted["ref"]
    else:
        assert torch.equal(assisted["ours"], assisted["ref"])


def test_flex_attention_is_refused_as_the_reference_refuses_it(tmp_path):
    """transformers' Qwen3.5 offers no flex attention, so nothing could check ours (a QA run found it accepted, and
    torch's inductor then failing on the CPU): refused at load, by name, as the reference refuses it."""
    ref, thinker = family_pair("qwen3_5", "sdpa")
    thinker.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="flex_attention"):
        type(ref).from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(
        ValueError, match="'flex_attention': models with linear-attention layers .*take sdpa, eager or flash"
    ):
        ThinkerForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="models with linear-attention layers"):
        thinker.set_attn_implementation("flex_attention")


def test_static_cache_generate_equals_dynamic():
    """A compileable cache makes generate() build both masks itself (a dict by layer type), which the model takes."""
    ref, thinker = family_pair("qwen3_5", "sdpa")
    ids, mask = left_pad([token_ids(batch=1, length=n, seed=n)[0] for n in (9, 5)])
    greedy = dict(max_new_tokens=6, min_new_tokens=6, attention_mask=mask, do_sample=False)
    dynamic = thinker.generate(ids, **greedy)
    assert torch.equal(thinker.generate(ids, cache_implementation="static", **greedy), dynamic)
    assert torch.equal(ref.generate(ids, cache_implementation="static", **greedy), dynamic)


def test_inputs_embeds_equal_input_ids():
    _, thinker = family_pair("qwen3_5", "sdpa")
    ids = token_ids(length=9)
    embeds = thinker.get_input_embeddings()(ids)
    with torch.no_grad():
        assert_close(thinker(inputs_embeds=embeds).logits, thinker(ids).logits, atol=0, rtol=0)
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(thinker.generate(inputs_embeds=embeds, **greedy), thinker.generate(ids, **greedy)[:, 9:])


# ----------------------------------------------------------------------------------------------------------------
# multimodal positions: the reference's own inputs_embeds and 3-D / 4-D position_ids


@pytest.fixture(scope="module", params=ATTENTION)
def qwen3_5_vl_image_prompt(request):
    """A Qwen3.5 vision-language reference, a prompt holding one 4x6-patch image (6 tokens after the 2x2 merge),
    and what its own forward hands to the text decoder."""
    ref, thinker = family_pair("qwen3_5_vl", request.param)
    captured, logits = run_image_prompt(ref)
    return ref, thinker, captured, logits


def test_qwen3_5_vl_image_prompt_gives_reference_logits(qwen3_5_vl_image_prompt):
    ref, thinker, captured, expected = qwen3_5_vl_image_prompt
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]
    assert positions.shape == (3, 1, 20)
    assert not torch.equal(positions[1], positions[2]) and not torch.equal(positions[0], positions[1])
    with torch.no_grad():
        assert_close(thinker(inputs_embeds=embeds, position_ids=positions).logits, expected, **TOL)
        # (4, B, T): a text row ahead of t/h/w, as generate() hands them to Qwen3.5's text model
        four = torch.cat([torch.arange(20)[None, None], positions])
        theirs = ref.lm_head(ref.model.language_model(inputs_embeds=embeds, position_ids=four).last_hidden_state)
        assert_close(thinker(inputs_embeds=embeds, position_ids=four).logits, theirs, **TOL)


def test_switches_change_the_logits(qwen3_5_vl_image_prompt):
    """Each hybrid switch matters with these weights: dropping it would fail the parity tests above."""
    _, thinker, captured, expected = qwen3_5_vl_image_prompt
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return thinker(inputs_embeds=embeds, position_ids=positions).logits

    def differs(changed: torch.Tensor) -> bool:
        return (changed - expected).abs().max() > 100 * TOL["atol"]

    rotary = thinker.model.rotary_emb
    section = rotary.mrope_section
    bounds = [0, section[0], section[0] + section[1], sum(section)]
    for dropped in (
        lambda freqs: freqs[0],  # temporal positions only
        lambda freqs: torch.cat([freqs[i, ..., bounds[i] : bounds[i + 1]] for i in range(3)], -1),  # not interleaved
    ):
        rotary.select_sections = dropped
        assert differs(logits())
        del rotary.select_sections

    norms = [m for m in thinker.modules() if isinstance(m, ThinkerRMSNorm)]
    for norm in norms:
        norm.zero_centered = False
    assert differs(logits())
    for norm in norms:
        norm.zero_centered = True

    gated = [layer.self_attn for layer in thinker.model.layers if hasattr(layer, "self_attn")]
    for attn in gated:  # the same attention without its gate: q_proj keeps only each head's query rows
        attn.gated_q_proj, attn.output_gate = attn.q_proj, False
        attn.q_proj = torch.nn.Linear(32, 4 * 32, bias=False)
        with torch.no_grad():
            attn.q_proj.weight.copy_(attn.gated_q_proj.weight.view(4, 2, 32, 32)[:, 0].reshape(4 * 32, 32))
    assert differs(logits())
    for attn in gated:
        attn.q_proj, attn.output_gate = attn.gated_q_proj, True
        del attn.gated_q_proj
    assert_close(logits(), expected, **TOL)


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("rows", [3, 4])
def test_qwen3_omni_text_decoder_with_multimodal_positions(rows, attn):
    text_config = qwen3_omni.tiny_config().thinker_config.text_config  # mrope_section [4, 2, 2], interleaved
    decoder = Qwen3OmniMoeThinkerTextModel._from_config(text_config, attn_implementation=attn)
    decoder = randomize_parameters(decoder, seed=0).eval()
    decoder.config._experts_implementation = "eager"
    head = randomize_parameters(torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False), 1)
    config = thinker_config_from(text_config, qk_norm=True)
    assert config.mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    state = {f"model.{name}": tensor for name, tensor in decoder.state_dict().items()}
    thinker = build_thinker(config, {**state, "lm_head.weight": head.weight}, attn)

    positions = text_image_text_positions(batch=2)  # (3, B, T): t/h/w rows that differ inside the block
    if rows == 4:
        positions = torch.cat([torch.arange(15).expand(1, 2, -1), positions])
    embeds = torch.randn(2, 15, text_config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = head(decoder(inputs_embeds=embeds, position_ids=positions).last_hidden_state)
        assert_close(thinker(inputs_embeds=embeds, position_ids=positions).logits, expected, **TOL)
        # ... and the same embeddings at plain text positions give other logits: the t/h/w rows are used
        plain = thinker(inputs_embeds=embeds).logits
    assert (plain - expected).abs().max() > 100 * TOL["atol"]


# ----------------------------------------------------------------------------------------------------------------
# config: layer_types


def test_layer_types_default_validation_and_edits():
    assert ThinkerConfig(num_hidden_layers=3).layer_types == ["full_attention"] * 3
    with pytest.raises(StrictDataclassError, match="layer_types must list"):
        ThinkerConfig(num_hidden_layers=2, layer_types=["full_attention"])
    with pytest.raises(StrictDataclassError, match="layer_types must list"):
        ThinkerConfig(num_hidden_layers=1, layer_types=["mamba2"])
    with pytest.raises(StrictDataclassError, match="linear_num_value_heads=3"):
        ThinkerConfig(num_hidden_layers=1, layer_types=["linear_attention"], linear_num_value_heads=3)
    # more value heads than key heads, and not a multiple of them
    with pytest.raises(StrictDataclassError, match="linear_num_value_heads=3"):
        ThinkerConfig(
            num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=3
        )
    # three sections that must sum to the head's 8 rotary frequencies: fewer, more, or not three (each loosening of
    # the check to one side passed the cases of the other, and the model then failed inside torch: a mutation run)
    for section in ([1, 1], [2, 2, 2], [3, 3, 3]):
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}
        with pytest.raises(StrictDataclassError, match="mrope_section"):
            ThinkerConfig(head_dim=16, rope_parameters=rope)
    with pytest.raises(StrictDataclassError, match="num_experts_per_tok=5 must lie in 1..4"):
        ThinkerConfig(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(StrictDataclassError, match="norm_zero_centered"):
        ThinkerConfig(norm_type="layernorm", norm_zero_centered=True)

    # layer_types is stored, not derived from another field: an edit after construction is what the model builds
    config = ThinkerConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, linear_num_key_heads=2)
    config.layer_types = ["full_attention", "linear_attention"]
    model = ThinkerForCausalLM(config)
    assert hasattr(model.model.layers[1], "linear_attn") and hasattr(model.model.layers[0], "self_attn")
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="layer_types lists 2 layers but num_hidden_layers is 3"):
        ThinkerForCausalLM(config)


def test_from_pretrained_takes_the_first_layers(tmp_path):
    """``from_pretrained(folder, num_hidden_layers=2)``, the usual way to load a model's first layers: the Thinker
    builds them as the reference class does (the same logits), and its config, cut to them, saves and loads."""
    reference, thinker = family_pair("qwen3_5_moe", "sdpa")
    reference.save_pretrained(tmp_path / "reference")
    thinker.save_pretrained(tmp_path / "thinker")
    first = ThinkerForCausalLM.from_pretrained(
        tmp_path / "thinker", num_hidden_layers=2, experts_implementation="eager"
    )
    assert len(first.model.layers) == 2 and first.config.layer_types == LAYER_TYPES[:2]
    expected = type(reference).from_pretrained(tmp_path / "reference", num_hidden_layers=2)
    ids = token_ids(length=9)
    with torch.no_grad():
        torch.testing.assert_close(first(ids).logits, expected(ids).logits, atol=1e-5, rtol=1e-5)
    first.save_pretrained(tmp_path / "first")
    assert ThinkerForCausalLM.from_pretrained(tmp_path / "first").config.num_hidden_layers == 2


def test_init_weights_as_the_references():
    config = thinker_config_from(qwen3_5_moe_config(), **HYBRID_SWITCHES)
    model = ThinkerForCausalLM(config)
    zero_centred = [m.weight for m in model.modules() if isinstance(m, ThinkerRMSNorm)]
    assert len(zero_centred) == 4 * 2 + 2 * 2 + 1 and all(torch.all(w == 0) for w in zero_centred)  # scale one
    linear = model.model.layers[0].linear_attn
    assert torch.all(linear.norm.weight == 1) and torch.all(linear.dt_bias == 1)
    assert torch.all((linear.A_log.exp() >= 0.01 - 1e-6) & (linear.A_log.exp() <= 16 + 1e-4))
    assert 0 < linear.conv1d.weight.std() < 0.05  # normal(0, initializer_range), as every Linear and Conv1d


def test_save_load_round_trip_keeps_the_hybrid_layout(tmp_path):
    _, thinker = family_pair("qwen3_5_moe", "sdpa")
    thinker.save_pretrained(tmp_path)
    loaded = ThinkerForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert loaded.config.layer_types == LAYER_TYPES and loaded.config.norm_zero_centered
    assert loaded.config.rope_parameters["mrope_section"] == [2, 1, 1]
    ids = token_ids(length=9)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, thinker(ids).logits)


# ----------------------------------------------------------------------------------------------------------------
# float64: the export check's second opinion on a float32 graph runs the Thinker so (export/exact_reference.py)


class Float32Ops(TorchDispatchMode):
    """Records each op that computes a float32 tensor, outside the modules ``allowed`` (while they run)."""

    def __init__(self, model: torch.nn.Module, allowed: tuple[type, ...]) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.inside = 0
        for module in model.modules():
            if isinstance(module, allowed):
                module.register_forward_pre_hook(lambda *_: setattr(self, "inside", self.inside + 1))
                module.register_forward_hook(lambda *_: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside:
            tensors = out if isinstance(out, tuple | list) else (out,)
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tensors):
                self.seen.append(str(func))
        return out


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_a_float64_thinker_computes_in_float64_throughout(family):
    """transformers' Qwen code computes its norms, softmaxes, decays and delta rule in float32 whatever the model's
    dtype, and so did the Thinker: a float64 run rounded to float32 at each, and its float32 softmax turned a float64
    mask's fully masked row (a left pad's) into NaN, which the recurrence carried into the row's tokens. Now no op
    outside the RoPE tables (float32, as a graph ships them) computes a float32 tensor, a left-padded batch gives each
    row's own logits, and prefill then decode agrees with one prefill to float64's precision (float32's parts by
    1e-7 or so)."""
    from thinker.modeling_thinker import ThinkerRotaryEmbedding

    _, thinker = family_pair(family, "eager")
    exact = copy.deepcopy(thinker).double()
    rows = [token_ids(batch=1, length=n, seed=n)[0] for n in (80, 13)]
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    recorder = Float32Ops(exact, (ThinkerRotaryEmbedding,))
    with torch.no_grad(), recorder:
        batch = exact(ids, attention_mask=mask, position_ids=positions).logits
    assert not recorder.seen, sorted(set(recorder.seen))
    assert batch.dtype == torch.float64 and batch[mask.bool()].isfinite().all()
    with torch.no_grad():
        for i, row in enumerate(rows):
            assert_close(batch[i, mask[i].bool()], exact(row[None]).logits[0], atol=1e-10, rtol=0)
        float32 = thinker(ids, attention_mask=mask, position_ids=positions).logits  # the same model: its rounding
        assert_close(batch.float()[mask.bool()], float32[mask.bool()], atol=1e-3, rtol=0)

    ids = token_ids(batch=2, length=72, seed=3)
    gaps = {}
    with torch.no_grad():
        for model in (thinker, exact):
            cache = DynamicCache(config=model.config)
            parts = [model(ids[:, :70], use_cache=True, **{CACHE_ARG: cache}).logits]
            parts += [model(ids[:, t : t + 1], use_cache=True, **{CACHE_ARG: cache}).logits for t in (70, 71)]
            gaps[model is exact] = float((torch.cat(parts, dim=1) - model(ids).logits).abs().max())
    assert gaps[True] < 1e-11 < 1e-9 < gaps[False], gaps


def test_the_float64_delta_rule_is_transformers_recurrent_one_in_its_inputs_dtype():
    """``gated_delta_rule_in_own_dtype`` in float32 is transformers' token-by-token rule bit for bit; in float64 it
    lies within float32's rounding of it and of transformers' chunked rule, grouped value heads and a carried state
    included."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    from thinker.modeling_thinker import gated_delta_rule_in_own_dtype

    generator = torch.Generator().manual_seed(0)
    batch, seq, key_heads, value_heads, key_dim, value_dim = 2, 9, 2, 4, 8, 6
    query, key = (torch.randn(batch, seq, key_heads, key_dim, generator=generator) for _ in range(2))
    value = torch.randn(batch, seq, value_heads, value_dim, generator=generator)
    g, beta = -torch.rand(batch, seq, value_heads, generator=generator), torch.rand(batch, seq, value_heads)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=generator)
    options = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours = gated_delta_rule_in_own_dtype(query, key, value, g=g, beta=beta, **options)
    theirs = torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, **options)
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine, other)
    wide = [x.double() for x in (query, key, value, g, beta, state)]
    exact = gated_delta_rule_in_own_dtype(*wide[:3], g=wide[3], beta=wide[4], **{**options, "initial_state": wide[5]})
    chunked = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, **options)
    for float64, *float32 in zip(exact, theirs, chunked, strict=True):
        assert float64.dtype == torch.float64
        for other in float32:
            assert_close(float64, other.double(), atol=1e-5, rtol=0)
            assert not torch.equal(float64, other.double())  # float64's own arithmetic, not float32's cast up


def test_a_float64_thinker_keeps_float64_in_the_states_it_records(monkeypatch):
    """Where the cache records the last tokens' states (assisted decoding, transformers >= 5.25), those tokens run
    one step at a time after the chunked rest: in float64 too (transformers' stepwise rule rounded them to float32,
    six ops of it: a mutation run)."""
    import thinker.modeling_thinker as modeling
    from thinker.modeling_thinker import ThinkerRotaryEmbedding

    _, thinker = family_pair("qwen3_5_moe", "eager")
    exact = copy.deepcopy(thinker).double()
    monkeypatch.setattr(modeling, "states_to_keep", lambda cache, layer_idx: 3)
    recorder = Float32Ops(exact, (ThinkerRotaryEmbedding,))
    with torch.no_grad(), recorder:
        exact(token_ids(batch=1, length=12, seed=1), use_cache=True, **{CACHE_ARG: DynamicCache(config=exact.config)})
    assert not recorder.seen, sorted(set(recorder.seen))


def test_the_float64_delta_rule_refuses_packed_sequences():
    """Packed sequences (``cu_seqlens``) would carry one sequence's state into the next in the token-by-token form:
    refused, naming them."""
    from thinker.modeling_thinker import gated_delta_rule_in_own_dtype

    query = key = torch.randn(1, 6, 2, 4, dtype=torch.float64)
    value = torch.randn(1, 6, 2, 4, dtype=torch.float64)
    g, beta = -torch.rand(1, 6, 2, dtype=torch.float64), torch.rand(1, 6, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="packed sequences"):
        gated_delta_rule_in_own_dtype(query, key, value, g=g, beta=beta, cu_seqlens=torch.tensor([0, 2, 6]))
