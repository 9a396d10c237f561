"""Switches of the Thinker decoder that the parity tests of tests/test_modeling.py and tests/test_modeling_hybrid.py
leave open (a mutation run of thinker/modeling_thinker.py found each change below passing them).

- bfloat16: the Thinker runs transformers' own order of operations (a norm's cast before or after its scale, the
  zero-centred norm's scale in float32, the softmaxes in float32), so in bfloat16 its logits are the reference's bit
  for bit; every fp32 parity test is blind to an order that rounds differently.
- epsilons no tiny reference sets: the gated norm of the Gated DeltaNet with an epsilon large enough to matter.
- the load-balancing loss of a step after a cache, whose router saw only the new tokens.
- the padding row of the embedding, which takes no gradient (transformers' ``padding_idx``).
- a step after the cache with no position_ids; a step while the cache records recurrent states (assisted decoding).
- a fresh MoE model's routers, drawn as the reference draws them.
- multimodal position_ids with no cache, whose text row (or its absence) decides the mask.

References are transformers' own classes with every weight seeded (``randomize_parameters``), weights copied by name.
"""

from __future__ import annotations

import pytest
import torch
from references.hybrid import qwen3_5_config, reference, text_image_text_positions, token_ids
from seeded_weights import randomize_parameters
from test_modeling import REF_SIZES
from test_modeling_hybrid import TRANSLATED_FIELDS
from torch.testing import assert_close
from transformers import (
    DynamicCache,
    Qwen3_5ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG

TOL = dict(atol=1e-4, rtol=0)  # fp32 logits, as tests/test_modeling_hybrid.py
SIZES = REF_SIZES
FIELDS = (*TRANSLATED_FIELDS, "rope_parameters", "pad_token_id")


def translated(reference_config, **switches) -> ThinkerConfig:
    fields = {name: getattr(reference_config, name) for name in FIELDS if hasattr(reference_config, name)}
    if "rope_parameters" in fields:
        fields["rope_parameters"] = dict(fields["rope_parameters"])
    return ThinkerConfig(**fields, **switches)


def thinker_like(ref: torch.nn.Module, attn: str, **switches) -> ThinkerForCausalLM:
    config = translated(ref.config, **switches)
    model = ThinkerForCausalLM._from_config(config, attn_implementation=attn, experts_implementation="eager").eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    return model


def qwen3_pair(attn: str):
    config = Qwen3Config(**SIZES, head_dim=12, attention_bias=True)
    ref = randomize_parameters(Qwen3ForCausalLM._from_config(config, attn_implementation=attn), 0).eval()
    return ref, thinker_like(ref, attn, qk_norm=True)


def qwen3_moe_pair(attn: str):
    config = Qwen3MoeConfig(
        **SIZES, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0
    )
    model = Qwen3MoeForCausalLM._from_config(config, attn_implementation=attn, experts_implementation="eager")
    ref = randomize_parameters(model, 0).eval()
    return ref, thinker_like(ref, attn, qk_norm=True)


def qwen3_5_pair(attn: str, **overrides):
    ref = reference(Qwen3_5ForCausalLM, qwen3_5_config(**overrides), attn)
    return ref, thinker_like(ref, attn, qk_norm=True, attention_output_gate=True, norm_zero_centered=True)


PAIRS = {"qwen3": qwen3_pair, "qwen3_moe": qwen3_moe_pair, "qwen3_5": qwen3_5_pair}


# ----------------------------------------------------------------------------------------------------------------
# bfloat16: the reference's order of operations, hence its bits


@pytest.mark.parametrize(
    ("family", "attn"), [("qwen3", "eager"), ("qwen3", "sdpa"), ("qwen3_moe", "sdpa"), ("qwen3_5", "sdpa")]
)
def test_bfloat16_logits_are_the_references_bit_for_bit(family, attn):
    """In bfloat16 a norm that scales before its cast back, a zero-centred scale taken in bfloat16, or a softmax (of
    the attention or of the router) not in float32 rounds differently: every logit is compared exactly, as the same
    operations in the same order give the same bits (a changed order moves some logits by a bfloat16 ulp or more)."""
    ref, thinker = PAIRS[family](attn)
    ref, thinker = ref.to(torch.bfloat16), thinker.to(torch.bfloat16)
    ids = token_ids(length=20)
    with torch.no_grad():
        ours, theirs = thinker(ids).logits, ref(ids).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert_close(ours, theirs, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# epsilons the tiny references leave at their defaults


def test_a_large_epsilon_reaches_every_norm_of_a_hybrid_model():
    """rms_norm_eps 0.05: the zero-centred norms, the q/k norms and the Gated DeltaNet's gated norm all take it in
    their forward (a norm built with it but computing with 1e-6 moves these logits by far more than the tolerance)."""
    ref, thinker = qwen3_5_pair("sdpa", rms_norm_eps=0.05)
    ids = token_ids(length=20)
    with torch.no_grad():
        ours, theirs = thinker(ids).logits, ref(ids).logits
        default = qwen3_5_pair("sdpa")[0](ids).logits
    assert (default - theirs).abs().max() > 100 * TOL["atol"]  # the epsilon matters with these weights
    assert_close(ours, theirs, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# the load-balancing loss counts the tokens the router saw, real ones only


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(row) for row in rows)
    ids, mask = torch.zeros(len(rows), length, dtype=torch.long), torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
    return ids, mask


def test_router_loss_counts_the_real_tokens_of_a_padded_prompt_and_of_a_step_after_it():
    """A left-padded prompt: the aux loss is Qwen3-MoE's own, its padding left out (a loss that counts the padding
    differs). The next step, one token after the cache: the router saw that token only, so the loss is transformers'
    ``load_balancing_loss_func`` over the mask's last column (the first column, a padding of the short row, differs)."""
    ref, thinker = qwen3_moe_pair("sdpa")
    ids, mask = left_padded([token_ids(batch=1, length=n, seed=n)[0] for n in (9, 4)])
    experts, top_k = thinker.config.num_experts, thinker.config.num_experts_per_tok
    with torch.no_grad():
        ours = thinker(ids, attention_mask=mask, output_router_logits=True, use_cache=True)
        theirs = ref(ids, attention_mask=mask, output_router_logits=True)
        everything = load_balancing_loss_func(ours.router_logits, experts, top_k, None)
        assert (everything - theirs.aux_loss).abs() > 1e-3  # the padding changes the loss here
        assert_close(ours.aux_loss, theirs.aux_loss, atol=1e-6, rtol=1e-5)

        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        step = thinker(
            torch.tensor([[5], [7]]),
            attention_mask=step_mask,
            output_router_logits=True,
            use_cache=True,
            **{CACHE_ARG: getattr(ours, CACHE_ARG)},
        )
        expected = load_balancing_loss_func(step.router_logits, experts, top_k, step_mask[:, -1:])
        other = load_balancing_loss_func(step.router_logits, experts, top_k, step_mask[:, :1])
    assert (other - expected).abs() > 1e-3
    assert_close(step.aux_loss, expected, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# the padding row of the embedding, the talker head under logits_to_keep


def test_the_padding_rows_embedding_takes_no_gradient_as_the_references():
    """transformers' Qwen3 builds its embedding with ``padding_idx=pad_token_id``: training never moves the padding
    row. The Thinker's takes none either (a Thinker whose padding row learned would drift from its reference)."""
    config = Qwen3Config(**SIZES, head_dim=12, pad_token_id=3, tie_word_embeddings=False)
    ref = randomize_parameters(Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa"), 0)
    thinker = thinker_like(ref, "sdpa", qk_norm=True).train()
    ids = token_ids(length=10)
    ids[:, ::3] = 3  # padding ids among the tokens
    for model in (ref, thinker):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
    grads = {name: model.get_input_embeddings().weight.grad for name, model in (("ref", ref), ("ours", thinker))}
    assert torch.equal(grads["ref"][3], torch.zeros(32))
    assert torch.equal(grads["ours"][3], torch.zeros(32))
    assert_close(grads["ours"], grads["ref"], atol=1e-6, rtol=1e-5)


def test_talker_logits_follow_logits_to_keep(tiny_thinker):
    """generate() asks for the last position's logits only (``logits_to_keep=1``): the talker head's are cut alike."""
    model = tiny_thinker("dense", talker_head_size=40)
    ids = token_ids(length=6)
    with torch.no_grad():
        full = model(ids)
        last = model(ids, logits_to_keep=1)
    assert last.logits.shape == (2, 1, 96) and last.talker_logits.shape == (2, 1, 40)
    assert_close(last.talker_logits, full.talker_logits[:, -1:], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# multimodal RoPE at a real model's sections


def test_interleaved_mrope_tables_equal_qwen3_vls_at_its_real_sections():
    """Qwen3-VL's mrope_section [24, 20, 20] (head_dim 128): the tiny references' sections ([2, 1, 1], [4, 2, 2]) end
    where an off-by-one in the interleaved layout's bounds changes nothing; these do not."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from thinker.modeling_thinker import ThinkerRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    sizes = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_parameters=rope)
    theirs = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**sizes))
    ours = ThinkerRotaryEmbedding(ThinkerConfig(**sizes))
    positions = torch.randint(0, 500, (3, 2, 9), generator=torch.Generator().manual_seed(0))
    x = torch.zeros(1, dtype=torch.float32)
    for mine, ref in zip(ours(x, positions), theirs(x, positions), strict=True):
        assert_close(mine, ref, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# a step after the cache without position_ids; a step while the cache records states (assisted decoding)


def test_a_step_after_the_cache_without_position_ids_counts_from_the_cache():
    """A prompt through a cache, then one token with no ``position_ids``: its position is the cache's length (as
    Qwen3's own step takes it), not 0 (which moves these logits by far more than the tolerance)."""
    ref, thinker = qwen3_pair("sdpa")
    ids = token_ids(length=9)
    steps = {}
    with torch.no_grad():
        for name, model in (("ref", ref), ("ours", thinker)):
            cache = DynamicCache(config=model.config)
            model(ids[:, :8], use_cache=True, **{CACHE_ARG: cache})
            steps[name] = model(ids[:, 8:], use_cache=True, **{CACHE_ARG: cache}).logits
        full = thinker(ids).logits[:, 8:]
    assert_close(steps["ours"], steps["ref"], **TOL)
    assert_close(steps["ours"], full, **TOL)


def test_a_step_that_records_recurrent_states_equals_the_references_and_rolls_back():
    """Assisted decoding runs the drafted tokens through a cache that records the last recurrent states
    (``activate_past_recording``), each of those tokens one recurrent step after the one before it, then crops back
    to the last token accepted. Ours gives Qwen3.5's logits for the step and for the step after the crop (a step that
    starts from the cached state instead of the previous token's, or that skips the l2 norm of q/k, moves them by
    more than 1)."""
    ref, thinker = qwen3_5_pair("sdpa")
    ids = token_ids(length=14)
    out = {}
    with torch.no_grad():
        for name, model in (("ref", ref), ("ours", thinker)):
            cache = DynamicCache(config=model.config)
            model(ids[:, :8], use_cache=True, **{CACHE_ARG: cache})
            cache.activate_past_recording(recurrent_states_to_keep=3)
            step = model(ids[:, 8:13], use_cache=True, **{CACHE_ARG: cache}).logits
            cache.crop(-2)  # the last two tokens rejected
            out[name] = step, model(ids[:, 11:12], use_cache=True, **{CACHE_ARG: cache}).logits
        full = thinker(ids[:, :13]).logits
    assert_close(out["ours"][0], out["ref"][0], **TOL)
    assert_close(out["ours"][1], out["ref"][1], **TOL)
    assert_close(out["ours"][0], full[:, 8:13], **TOL)
    assert_close(out["ours"][1], full[:, 11:12], **TOL)


# ----------------------------------------------------------------------------------------------------------------
# a model built from a config (training from scratch) starts as the reference does


def test_a_fresh_moe_models_router_starts_random_as_the_references():
    """``ThinkerForCausalLM(config)`` draws its routers from normal(0, initializer_range), as Qwen3-MoE's
    ``_init_weights`` does: a router left at zero ties every expert, so top-k routes every token alike. The sample
    std of 32 x 4 draws is compared with initializer_range within 25%, for ours and the reference alike."""
    config = Qwen3MoeConfig(**SIZES, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    thinker = ThinkerForCausalLM(translated(config, qk_norm=True))
    std = config.initializer_range
    for model in (ref, thinker):
        sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        assert len(sparse) == 3
        for block in sparse:
            assert abs(block.gate.weight.std().item() - std) < 0.25 * std


# ----------------------------------------------------------------------------------------------------------------
# multimodal positions with no cache: which row the mask reads


@pytest.mark.parametrize("rows", [3, 4])
def test_multimodal_positions_without_a_cache_mask_as_the_references(rows):
    """``use_cache=False`` and no attention_mask (a training batch): transformers reads the text positions for packed
    sequences, a step other than +1 starting a new one. (3, B, T) positions have no text row (the mask is plain
    causal); (4, B, T) ones carry it first. The temporal row of an image block repeats a position, so a mask read from
    it would cut the sequence there: the logits would move by far more than the tolerance."""
    ref, thinker = qwen3_5_pair("sdpa")
    positions = text_image_text_positions(batch=2)  # (3, B, 15): t/h/w rows that differ inside the image block
    if rows == 4:
        positions = torch.cat([torch.arange(15).expand(1, 2, -1), positions])
    ids = token_ids(length=15)
    with torch.no_grad():
        ours = thinker(ids, position_ids=positions, use_cache=False).logits
        theirs = ref(ids, position_ids=positions, use_cache=False).logits
    assert_close(ours, theirs, **TOL)
