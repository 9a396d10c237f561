"""ThinkerForCausalLM against transformers' own reference classes, and the transformers plumbing it promises.

Parity tests build a tiny random reference model (Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Llama, GPT-2), copy its
weights into a Thinker by a plain rename written here (no converter involved), and require the logits and every
hidden state to agree in fp32 within ``torch.testing.assert_close(atol=1e-5, rtol=1e-5)``. Weights are randomised,
norms and biases included, so that a missing bias or a misplaced norm shows.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import ThinkerSparseMoeBlock
from thinker.presets import load_preset

TOL = dict(atol=1e-5, rtol=1e-5)
REPO = Path(__file__).resolve().parent.parent

# The sizes every parity reference shares; each family test adds its own switches.
REF_SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# ThinkerConfig fields that mean the same in every Qwen/Llama config (Qwen's names are ours).
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "hidden_act",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
)


def token_ids(vocab_size: int = 96, batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def thinker_config_from(reference_config, **switches) -> ThinkerConfig:
    fields = {name: getattr(reference_config, name) for name in SHARED_FIELDS if hasattr(reference_config, name)}
    return ThinkerConfig(**{**fields, **switches})


def build_reference(config, randomize, **impl) -> torch.nn.Module:
    return randomize(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **impl), seed=0).eval()


def build_thinker(config: ThinkerConfig, state_dict: dict, **impl) -> ThinkerForCausalLM:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **impl).eval()
    assert isinstance(model, ThinkerForCausalLM)
    model.load_state_dict(state_dict, strict=True)  # every Thinker parameter copied, nothing left over
    return model


@torch.no_grad()
def assert_same_outputs(thinker: torch.nn.Module, reference: torch.nn.Module, input_ids: torch.Tensor) -> None:
    ours = thinker(input_ids, output_hidden_states=True, use_cache=False)
    theirs = reference(input_ids, output_hidden_states=True, use_cache=False)
    assert_close(ours.logits, theirs.logits, **TOL)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == thinker.config.num_hidden_layers + 1
    for layer, (mine, ref) in enumerate(zip(ours.hidden_states, theirs.hidden_states, strict=True)):
        assert_close(mine, ref, **TOL, msg=lambda m, layer=layer: f"hidden state {layer}: {m}")


def assert_tied(model: ThinkerForCausalLM, tied: bool) -> None:
    same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert same == tied


# ----------------------------------------------------------------------------------------------------------------
# architecture parity with transformers' reference classes (weights copied by name)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_parity(randomize, tied):
    config = Qwen2Config(
        **REF_SIZES, tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    )
    reference = build_reference(config, randomize)
    # Qwen2 has bias on q/k/v and none on o_proj.
    thinker = build_thinker(
        thinker_config_from(config, attention_bias=True, attention_output_bias=False), reference.state_dict()
    )
    assert_tied(thinker, tied)
    assert_same_outputs(thinker, reference, token_ids())


QWEN3_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    # 11 tokens past a context of 8: the "dynamic" frequencies are recomputed during the forward pass
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
}


@pytest.mark.parametrize("rope", QWEN3_ROPES)
def test_qwen3_parity(randomize, rope):
    sizes = {**REF_SIZES, "max_position_embeddings": 8 if rope == "dynamic" else 64}
    # head_dim 12 != hidden_size / heads (8); biases on q/k/v/o (Qwen3's attention_bias covers o_proj too)
    config = Qwen3Config(**sizes, head_dim=12, attention_bias=True, rope_parameters=QWEN3_ROPES[rope])
    reference = build_reference(config, randomize)
    thinker = build_thinker(thinker_config_from(config, qk_norm=True, attention_bias=True), reference.state_dict())
    assert_same_outputs(thinker, reference, token_ids())


def test_llama_parity(randomize):
    config = LlamaConfig(
        **REF_SIZES, head_dim=16, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False
    )
    reference = build_reference(config, randomize)
    thinker = build_thinker(thinker_config_from(config, attention_bias=True, mlp_bias=True), reference.state_dict())
    assert_same_outputs(thinker, reference, token_ids())


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_qwen2_moe_parity(randomize, experts_implementation):
    # decoder_sparse_step 2: layer 1 is sparse, layers 0 and 2 dense; a shared expert behind a sigmoid gate
    config = Qwen2MoeConfig(
        **REF_SIZES,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
    )
    reference = build_reference(config, randomize, experts_implementation="eager")
    thinker_config = thinker_config_from(config, attention_bias=True, attention_output_bias=False)
    assert thinker_config.mlp_layer_types == ["dense", "sparse", "dense"]
    thinker = build_thinker(thinker_config, reference.state_dict(), experts_implementation=experts_implementation)
    assert_same_outputs(thinker, reference, token_ids())


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_qwen3_moe_parity(randomize, norm_topk_prob, experts_implementation):
    # mlp_only_layers: layer 1 dense although decoder_sparse_step 1 makes every other layer sparse
    config = Qwen3MoeConfig(
        **REF_SIZES,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=norm_topk_prob,
    )
    reference = build_reference(config, randomize, experts_implementation="eager")
    thinker_config = thinker_config_from(config, qk_norm=True)
    assert thinker_config.mlp_layer_types == ["sparse", "dense", "sparse"]
    thinker = build_thinker(thinker_config, reference.state_dict(), experts_implementation=experts_implementation)
    ids = token_ids()
    assert_same_outputs(thinker, reference, ids)
    # router logits of the sparse layers, and the loss with its load-balancing term
    with torch.no_grad():
        ours, theirs = (m(ids, labels=ids, output_router_logits=True) for m in (thinker, reference))
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    for mine, ref in zip(ours.router_logits, theirs.router_logits, strict=True):
        assert_close(mine, ref, **TOL)
    assert_close(ours.aux_loss, theirs.aux_loss, **TOL)
    assert_close(ours.loss, theirs.loss, **TOL)
    # masks that are not a 2-D padding mask count every token, as no mask does: a 4-D one, and the masks by layer
    # type generate() builds for a static cache (transformers' own classes fail on both)
    length = ids.shape[1]
    causal = torch.zeros(1, 1, length, length).masked_fill(torch.ones(length, length).triu(1).bool(), -torch.inf)
    with torch.no_grad():
        four_d = thinker(ids, attention_mask=causal, output_router_logits=True)
    assert_close(four_d.aux_loss, ours.aux_loss, **TOL)
    thinker.config.output_router_logits = True
    try:
        greedy = dict(max_new_tokens=3, do_sample=False)
        static = thinker.generate(ids, cache_implementation="static", **greedy)
        assert torch.equal(static, thinker.generate(ids, **greedy))
    finally:
        thinker.config.output_router_logits = False


def gpt2_to_thinker(state: dict[str, torch.Tensor], config: GPT2Config) -> dict[str, torch.Tensor]:
    """GPT-2's names, its Conv1D weights stored (in, out) (transposed here), and its fused c_attn split into q/k/v."""
    out = {
        "model.embed_tokens.weight": state["transformer.wte.weight"],
        "model.embed_positions.weight": state["transformer.wpe.weight"],
        "model.norm.weight": state["transformer.ln_f.weight"],
        "model.norm.bias": state["transformer.ln_f.bias"],
        "lm_head.weight": state["lm_head.weight"],
    }
    renames = {
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.c_proj": "self_attn.o_proj",
        "mlp.c_fc": "mlp.up_proj",
        "mlp.c_proj": "mlp.down_proj",
    }
    for i in range(config.n_layer):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        for old, new in renames.items():
            weight = state[f"{src}{old}.weight"]
            out[f"{dst}{new}.weight"] = weight if old.startswith("ln") else weight.t()
            out[f"{dst}{new}.bias"] = state[f"{src}{old}.bias"]
        q, k, v = state[f"{src}attn.c_attn.weight"].t().chunk(3, dim=0)
        qb, kb, vb = state[f"{src}attn.c_attn.bias"].chunk(3)
        for name, weight, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[f"{dst}self_attn.{name}.weight"], out[f"{dst}self_attn.{name}.bias"] = weight, bias
    return out


def test_gpt2_parity(randomize):
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64, activation_function="gelu_new")
    reference = build_reference(config, randomize)
    thinker_config = ThinkerConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=4 * config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        max_position_embeddings=config.n_positions,
        position_embedding_type="learned",
        norm_type="layernorm",
        mlp_gated=False,
        hidden_act=config.activation_function,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=config.layer_norm_epsilon,
    )
    thinker = build_thinker(thinker_config, gpt2_to_thinker(reference.state_dict(), config))
    assert_tied(thinker, True)
    assert_same_outputs(thinker, reference, token_ids())


# ----------------------------------------------------------------------------------------------------------------
# MoE routing: ties and renormalisation decided exactly as Qwen does


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_routing_matches_qwen_with_ties(randomize, norm_topk_prob):
    sizes = dict(hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2)
    qwen_config = Qwen3MoeConfig(**sizes, norm_topk_prob=norm_topk_prob)
    qwen_config._experts_implementation = "eager"
    reference = randomize(Qwen3MoeSparseMoeBlock(qwen_config), seed=3)
    with torch.no_grad():  # experts 1, 2, 3 get the same router row, so their probabilities tie exactly
        reference.gate.weight[2:4] = reference.gate.weight[1]
    thinker_config = ThinkerConfig(**sizes, norm_topk_prob=norm_topk_prob)
    thinker_config._experts_implementation = "eager"
    block = ThinkerSparseMoeBlock(thinker_config)
    block.load_state_dict(reference.state_dict(), strict=True)

    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(4))
    flat = x.view(-1, 16)
    probs = torch.softmax(flat @ reference.gate.weight.T, dim=-1).sort(dim=-1, descending=True).values
    tie_at_cut = probs[:, 1] == probs[:, 2]  # the 2nd and 3rd choices are equal: top-k has to break the tie
    assert tie_at_cut.sum() >= 3, "the case does not exercise ties"

    with torch.no_grad():
        ours, theirs = block.gate(flat), reference.gate(flat)
        for mine, ref in zip(ours, theirs, strict=True):  # logits, top-k weights, top-k expert indices
            assert_close(mine, ref, atol=0, rtol=0)
        assert_close(block(x), reference(x), **TOL)
        # ... and the renormalisation is not a no-op here: flipping it changes the output
        block.gate.norm_topk_prob = not norm_topk_prob
        assert not torch.allclose(block(x), reference(x), **TOL)


# ----------------------------------------------------------------------------------------------------------------
# generation, padding, embeddings, attention backends


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each row counts from 0 at its first real token, as generate() does."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("kind", ["dense", "moe", "learned"])
def test_greedy_generate_cache_equals_no_cache(tiny_thinker, kind):
    model = tiny_thinker(kind)
    ids = token_ids(length=6)
    runs = {
        use_cache: model.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for use_cache in (True, False)
    }
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert_close(torch.stack(runs[True].logits), torch.stack(runs[False].logits), **TOL)


def test_static_cache_generate_equals_dynamic(tiny_thinker):
    """A compileable cache makes generate() build the 4-D mask itself, which the model must take as it is."""
    model = tiny_thinker("dense")
    ids, mask = left_pad([token_ids(batch=1, length=n, seed=n)[0] for n in (7, 4)])
    runs = [
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **cache)
        for cache in ({}, {"cache_implementation": "static"})
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("kind", ["dense", "learned"])
def test_left_padded_batch_equals_rows_alone(tiny_thinker, kind):
    model = tiny_thinker(kind)
    rows = [token_ids(batch=1, length=n, seed=n)[0] for n in (9, 4, 6)]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        batch_logits = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            assert_close(batch_logits[i, mask[i].bool()], alone, **TOL)

    generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=6, do_sample=False)[0, len(row) :]
        assert torch.equal(generated[i], alone), f"row {i}"


@pytest.mark.parametrize("kind", ["dense", "learned"])
def test_inputs_embeds_equal_input_ids(tiny_thinker, kind):
    model = tiny_thinker(kind)
    ids = token_ids(length=7)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        assert_close(model(inputs_embeds=embeds).logits, model(ids).logits, atol=0, rtol=0)
    # generate() from embeddings returns only the new tokens
    from_ids = model.generate(ids, max_new_tokens=5, do_sample=False)[:, ids.shape[1] :]
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
    assert torch.equal(from_embeds, from_ids)


def test_exactly_one_of_input_ids_and_inputs_embeds(tiny_thinker):
    model = tiny_thinker("dense")
    ids = token_ids(length=3)
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    # ids handed over as embeddings (integers) ran without a word (a QA run)
    with pytest.raises(ValueError, match=r"inputs_embeds of dtype torch.int64; expected floating-point embeddings"):
        model(inputs_embeds=torch.ones(1, 3, model.config.hidden_size, dtype=torch.long))


def test_inputs_of_disagreeing_shapes_are_refused_by_name(tiny_thinker):
    """torch would fail deep inside with a broadcast error naming neither input, or, for an attention mask of the
    wrong length beside a cache, give other logits without a word (as transformers' own Qwen models do)."""
    model = tiny_thinker("dense")
    ids = token_ids(batch=2, length=5)
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(
        ValueError, match=r"inputs_embeds of shape \(2, 5, 16\); expected \(batch, seq, hidden_size 32\)"
    ):
        model(inputs_embeds=embeds[..., :16])
    with pytest.raises(ValueError, match=r"position_ids of shape \(2, 7\) for inputs of batch 2 and length 5"):
        model(ids, position_ids=torch.arange(7).expand(2, 7))
    with pytest.raises(ValueError, match=r"multimodal ones are \(3, batch, seq\), also for a batch of 1"):
        model(ids[:1], position_ids=torch.arange(5).expand(3, 5))  # the batch axis left out
    for use_cache in (True, False):
        with pytest.raises(ValueError, match=r"attention_mask of shape \(3, 5\); expected \(batch 2"):
            model(ids, attention_mask=torch.ones(3, 5, dtype=torch.long), use_cache=use_cache)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"the 5 cached tokens \+ this call's 1\) = \(2, 6\)"):
            model(ids[:, :1], attention_mask=torch.ones(2, 5, dtype=torch.long), cache=past)
        ok = model(ids[:, :1], attention_mask=torch.ones(2, 6, dtype=torch.long), cache=past)
    assert ok.logits.shape == (2, 1, model.config.vocab_size)
    assert model(ids, position_ids=torch.arange(5)[None]).logits.shape[:2] == (2, 5)  # one row for every row


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_eager_equals_sdpa(tiny_config, randomize, kind):
    models = {
        impl: randomize(AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation=impl)).eval()
        for impl in ("eager", "sdpa")
    }
    assert models["eager"].config._attn_implementation == "eager"
    assert models["sdpa"].config._attn_implementation == "sdpa"
    ids, mask = left_pad([token_ids(batch=1, length=n, seed=n)[0] for n in (8, 5)])
    real = mask.bool()
    with torch.no_grad():
        eager, sdpa = (m(ids, attention_mask=mask, position_ids=positions_from_mask(mask)) for m in models.values())
        assert_close(eager.logits[real], sdpa.logits[real], **TOL)
        # eager also returns the attention weights: causal, one row per head summing to one
        attentions = models["eager"](ids, attention_mask=mask, output_attentions=True).attentions
    assert len(attentions) == 3 and attentions[0].shape == (2, 4, 8, 8)
    assert_close(attentions[0][0].sum(-1), torch.ones(4, 8), **TOL)
    assert torch.all(attentions[0][0].triu(diagonal=1) == 0)


def test_output_hidden_states(tiny_thinker):
    model = tiny_thinker("dense")
    ids = token_ids(length=5)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        base = model.model(ids)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (2, 5, 32) for h in out.hidden_states)
    assert_close(out.hidden_states[0], model.get_input_embeddings()(ids), atol=0, rtol=0)
    assert_close(out.hidden_states[-1], base.last_hidden_state, atol=0, rtol=0)  # the last one is normed


def test_talker_head_and_audio_projection(tiny_thinker):
    model = tiny_thinker("dense", audio_embed_size=24, talker_head_size=40)
    audio = torch.randn(2, 5, 24)
    text = token_ids(length=3)
    audio_embeds = model.model.embed_audio(audio)
    assert audio_embeds.shape == (2, 5, 32)
    embeds = torch.cat([audio_embeds, model.get_input_embeddings()(text)], dim=1)
    with torch.no_grad():
        out = model(inputs_embeds=embeds)
    assert out.logits.shape == (2, 8, 96)
    assert out.talker_logits.shape == (2, 8, 40)
    assert_close(out.talker_logits, model.talker_head(model.model(inputs_embeds=embeds).last_hidden_state), **TOL)

    plain = tiny_thinker("dense")
    assert plain(text).talker_logits is None
    with pytest.raises(ValueError, match="audio projection"):
        plain.model.embed_audio(audio)


def test_gradient_checkpointing_same_gradients(tiny_thinker):
    model = tiny_thinker("moe").train()  # no dropout in the tiny configs, so train mode is deterministic
    ids = token_ids(length=7)
    layer_calls = []  # counted inside the layers: transformers checkpoints forward(), not the hooks of __call__
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda *_: layer_calls.append(1))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    assert len(layer_calls) == 3
    model.activation_checkpointing_enable()
    layer_calls.clear()
    checkpointed = gradients()
    assert len(layer_calls) == 6, "each layer should run again in the backward pass"
    assert plain.keys() == checkpointed.keys() and len(plain) == len(list(model.parameters()))
    for name in plain:
        assert_close(checkpointed[name], plain[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------------
# saving, loading, Auto classes, remote code, device maps


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}


# The loader rebuilds non-persistent buffers (RoPE frequencies) itself: a scaled RoPE shows whether it does so right.
@pytest.mark.parametrize(("kind", "overrides"), [("moe", {}), ("learned", {}), ("dense", {"rope_parameters": YARN})])
def test_save_load_round_trip(tiny_thinker, tmp_path, kind, overrides):
    model = tiny_thinker(kind, **overrides)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, ThinkerForCausalLM) and not loaded.training
    ids = token_ids(length=6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    ours, theirs = model.config.to_dict(), loaded.config.to_dict()
    ours.pop("_name_or_path"), theirs.pop("_name_or_path")
    assert ours == theirs
    assert AutoConfig.from_pretrained(tmp_path).to_dict() == loaded.config.to_dict()


def test_from_config_tiny_preset():
    config = load_preset("thinker_tiny")
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, ThinkerForCausalLM)
    assert model.model.embed_tokens.weight.shape == (5000, 256)
    assert len(model.model.layers) == 4
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.shape == (256, 256)  # no GQA
    assert layer.mlp.gate_proj.weight.shape == (1024, 256)  # SwiGLU
    assert model.lm_head.bias is not None and model.lm_head.bias.shape == (5000,)
    # The raw JSON (with its _source / _comment keys) resolves to ThinkerConfig through model_type too.
    raw = json.loads((REPO / "configs" / "thinker_tiny.json").read_text())
    fields = {key: value for key, value in raw.items() if not key.startswith("_")}
    assert type(AutoConfig.for_model(**fields)) is ThinkerConfig


# Where the thinker package cannot be imported, a saved folder's own code loads it (trust_remote_code): the folders of
# test_trust_remote_code_without_the_package (a causal LM) and test_task_heads_auto_classes_and_remote_code (a
# sequence-classification head), loaded in one child process, each part on its own (its failure recorded, not ending
# the other): most of a child's time is a fresh interpreter's imports, and both loaded their folder alike.
REMOTE_CODE_CHILD = """
import importlib.util, json, os, sys, traceback
import torch
torch.set_num_threads(int(os.environ["THINKER_TEST_TORCH_THREADS"]))  # the parent's: the same sums, bit for bit
assert importlib.util.find_spec("thinker") is None, "the thinker package is importable: the test proves nothing"
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification
ids_file, causal_folder, causal_out, heads_folder, heads_out = sys.argv[1:]
ids = torch.load(ids_file)

def causal():
    model = AutoModelForCausalLM.from_pretrained(causal_folder, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    with torch.no_grad():
        torch.save(model(ids).logits, causal_out)
    # A head other than the one saved loads from the same folder (its score layer new, as from a Qwen3 folder).
    head = AutoModelForTokenClassification.from_pretrained(causal_folder, trust_remote_code=True, num_labels=2)
    assert type(head).__name__ == "ThinkerForTokenClassification", type(head)

def heads():
    model = AutoModelForSequenceClassification.from_pretrained(heads_folder, trust_remote_code=True)
    with torch.no_grad():
        torch.save(model(ids).logits, heads_out)

failures = {}
for name, part in (("causal", causal), ("heads", heads)):
    try:
        part()
    except Exception:
        failures[name] = traceback.format_exc()
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def remote_code(tiny_thinker, tiny_config, randomize, tmp_path_factory) -> dict:
    """The two saved models and the child's run: {"causal": (model, folder, logits file), "heads": (model, config,
    folder, logits file), "ids": the input, "child": the CompletedProcess}. The folders are named apart, so that each
    load imports its own copy of the folder's code (transformers names the module after the folder and its code's
    hash)."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("remote-code")
    causal = tiny_thinker("moe")
    causal.save_pretrained(root / "causal-model")
    config = tiny_config("moe", num_labels=3)
    heads = randomize(AutoModelForSequenceClassification.from_config(config)).eval()
    heads.save_pretrained(root / "heads-model")
    ids = token_ids(length=6)
    torch.save(ids, root / "ids.pt")
    # -S: no site module, hence no .pth files (an editable install of this repo is one); the site-packages folders
    # come back through PYTHONPATH, which lacks the repository; cwd is elsewhere.
    site_packages = [p for p in site.getsitepackages() if Path(p).is_dir() and Path(p).resolve() != REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(site_packages), "HF_HOME": str(root / "hf-home")}
    env["HF_HUB_OFFLINE"] = "1"
    # torch's thread count decides how a matmul splits its sums: the child's logits are compared bit for bit with
    # the parent's, whose threads an xdist worker shares out (tests/conftest.py)
    env["THINKER_TEST_TORCH_THREADS"] = str(torch.get_num_threads())
    arguments = [root / "ids.pt", root / "causal-model", root / "causal.pt", root / "heads-model", root / "heads.pt"]
    child = subprocess.run(
        [sys.executable, "-S", "-c", REMOTE_CODE_CHILD, *map(str, arguments)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {
        "causal": (causal, root / "causal-model", root / "causal.pt"),
        "heads": (heads, config, root / "heads-model", root / "heads.pt"),
        "ids": ids,
        "child": child,
    }


def child_part_passed(remote_code: dict, part: str) -> None:
    child = remote_code["child"]
    assert child.returncode == 0, child.stderr[-4000:]
    failure = json.loads(child.stdout.strip().splitlines()[-1]).get(part)
    assert failure is None, failure[-4000:]


def test_trust_remote_code_without_the_package(remote_code):
    model, folder, logits = remote_code["causal"]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_thinker.ThinkerConfig",
        "AutoModel": "modeling_thinker.ThinkerModel",
        "AutoModelForCausalLM": "modeling_thinker.ThinkerForCausalLM",
        "AutoModelForSequenceClassification": "modeling_thinker.ThinkerForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_thinker.ThinkerForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_thinker.ThinkerForQuestionAnswering",
    }
    assert (folder / "modeling_thinker.py").is_file() and (folder / "configuration_thinker.py").is_file()

    child_part_passed(remote_code, "causal")
    with torch.no_grad():
        assert_close(torch.load(logits), model(remote_code["ids"]).logits, atol=0, rtol=0)


def test_device_map_auto(tiny_thinker, tmp_path):
    model = tiny_thinker("dense", num_hidden_layers=4)
    model.save_pretrained(tmp_path / "model")
    ids = token_ids(length=5)
    with torch.no_grad():
        expected = model(ids).logits

        on_cpu = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto")
        assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
        assert torch.equal(on_cpu(ids).logits, expected)

        # Room for the embeddings and about 1.5 decoder layers: the rest goes to disk, but a layer is never split
        # (_no_split_modules), since its residual stream must stay on one device.
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        embed_bytes = model.model.embed_tokens.weight.numel() * 4
        offloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "model",
            device_map="auto",
            max_memory={"cpu": embed_bytes + int(1.5 * layer_bytes)},
            offload_folder=tmp_path / "offload",
        )
        placement = offloaded.hf_device_map
        assert "disk" in placement.values() and "cpu" in placement.values()
        split = [name for name in placement if name.startswith("model.layers.") and name.count(".") > 2]
        assert not split, f"decoder layers split across devices: {split}"
        assert_close(offloaded(ids).logits, expected, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# config-derived layout: MLP kinds and parallel plans follow edits of the fields they come from


def test_mlp_layer_types_follow_moe_field_edits(tiny_config):
    config = tiny_config("moe")  # mlp_only_layers [1]
    assert config.mlp_layer_types == ["sparse", "dense", "sparse"]
    config.mlp_only_layers = [0]  # as transformers' common tests edit a Qwen3-MoE config
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]
    model = ThinkerForCausalLM(config)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "ThinkerMLP",
        "ThinkerSparseMoeBlock",
        "ThinkerSparseMoeBlock",
    ]
    config.decoder_sparse_step = 2
    assert config.mlp_layer_types == ["dense", "sparse", "dense"]
    config.num_experts = 0
    assert config.mlp_layer_types == ["dense"] * 3


def test_config_json_with_mlp_layer_types_still_loads(tiny_config, tmp_path):
    """Folders saved before mlp_layer_types was derived carry it; it is folded into the MoE fields it stands for."""
    saved = tiny_config("moe").to_dict()
    assert "mlp_layer_types" not in saved  # derived, so not written any more
    old = {**saved, "mlp_layer_types": ["dense", "dense", "sparse"], "decoder_sparse_step": 1}
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.mlp_layer_types == ["dense", "dense", "sparse"]
    assert (config.decoder_sparse_step, config.mlp_only_layers) == (1, [0, 1])
    # beside a sparse step the list does not follow, the list wins: the step is reset, not left to thin it out
    # (left at 2, it silently made a listed sparse layer dense, a mutation run)
    stepped = {**saved, "mlp_layer_types": ["sparse", "sparse", "dense"], "decoder_sparse_step": 2}
    (tmp_path / "config.json").write_text(json.dumps(stepped))
    assert AutoConfig.from_pretrained(tmp_path).mlp_layer_types == ["sparse", "sparse", "dense"]
    # one that agrees with the MoE fields changes nothing
    same = ThinkerConfig(**{**saved, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    assert same.to_dict() == ThinkerConfig(**saved).to_dict()
    with pytest.raises(ValueError, match="num_experts is 0"):
        ThinkerConfig(num_hidden_layers=2, mlp_layer_types=["sparse", "dense"])
    with pytest.raises(ValueError, match="for each of 2 layers"):
        ThinkerConfig(num_hidden_layers=2, num_experts=4, mlp_layer_types=["sparse"])


@pytest.mark.parametrize("kind", ["dense", "moe", "learned"])
def test_parallel_plans_name_only_parameters_the_model_has(tiny_config, kind):
    from transformers.distributed.parallel_utils import _get_parameter_plan

    model = ThinkerForCausalLM(tiny_config(kind))
    params, modules = [name for name, _ in model.named_parameters()], [name for name, _ in model.named_modules()]
    for plan in (model.tp_plan, model.ep_plan):
        for pattern in plan:
            assert any(_get_parameter_plan(name, {pattern: ""}, is_weight=True) is not None for name in params) or any(
                _get_parameter_plan(name, {pattern: ""}, is_weight=False) is not None for name in modules
            ), pattern
    experts = [name for name in params if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert bool(experts) == (kind == "moe")
    for name in experts:  # every expert weight is sharded by both plans
        assert _get_parameter_plan(name, model.tp_plan, is_weight=True) is not None
        assert _get_parameter_plan(name, model.ep_plan, is_weight=True) is not None
    assert bool(model.ep_plan) == (kind == "moe")


def test_task_heads_auto_classes_and_remote_code(remote_code):
    """The sequence-classification head of ``remote_code``: ``AutoModelForSequenceClassification.from_config`` of a
    Thinker config, saved and loaded by its own code in the child."""
    from transformers import AutoModelForQuestionAnswering

    from thinker import ThinkerForQuestionAnswering, ThinkerForSequenceClassification

    model, config, folder, logits = remote_code["heads"]
    assert isinstance(model, ThinkerForSequenceClassification)
    assert isinstance(AutoModelForQuestionAnswering.from_config(config), ThinkerForQuestionAnswering)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForSequenceClassification"] == "modeling_thinker.ThinkerForSequenceClassification"

    child_part_passed(remote_code, "heads")
    with torch.no_grad():
        assert_close(torch.load(logits), model(remote_code["ids"]).logits, **TOL)


def test_deepstack_features_are_repeated_with_their_rows_for_beams(tiny_thinker):
    """Beams and num_return_sequences repeat each prompt row in place; the DeepStack features, a list of
    (visual positions, hidden) tensors in the rows' order, are repeated with them: row i's copies carry row i's."""
    model = tiny_thinker("dense")
    mask = torch.tensor([[False, True, True, False], [True, True, True, False]])  # 2 and 3 visual positions
    features = [torch.arange(5 * 4.0).reshape(5, 4), -torch.arange(5 * 4.0).reshape(5, 4)]
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    expanded_ids, kwargs = model._expand_inputs_for_generation(
        3, input_ids=ids, visual_pos_masks=mask, deepstack_visual_embeds=features
    )
    assert torch.equal(expanded_ids, ids.repeat_interleave(3, dim=0))
    assert torch.equal(kwargs["visual_pos_masks"], mask.repeat_interleave(3, dim=0))
    for layer, expanded in zip(features, kwargs["deepstack_visual_embeds"], strict=True):
        rows = [layer[:2]] * 3 + [layer[2:]] * 3
        assert torch.equal(expanded, torch.cat(rows))


def test_deepstack_inputs_are_refused_when_they_do_not_fit(tiny_thinker):
    """Qwen3-VL's DeepStack inputs go together, a row of features per visual position, at most one list entry per
    decoder layer: anything else is refused by name (rather than an indexing error, or nothing for extra entries)."""
    model = tiny_thinker("dense")
    embeds = torch.randn(1, 6, 32)
    mask = torch.tensor([[False, True, True, False, False, False]])
    features = [torch.randn(2, 32)]
    with torch.no_grad():
        base = model(inputs_embeds=embeds).logits
        added = model(inputs_embeds=embeds, visual_pos_masks=mask, deepstack_visual_embeds=features).logits
    assert torch.equal(added[:, :1], base[:, :1]) and not torch.equal(added[:, 1:], base[:, 1:])  # causal: after them
    cases = {
        "pass both or neither": dict(visual_pos_masks=mask),
        r"deepstack_visual_embeds\[0\] of shape \(3, 32\); expected \(2, 32\)": dict(
            visual_pos_masks=mask, deepstack_visual_embeds=[torch.randn(3, 32)]
        ),
        r"visual_pos_masks of shape \(1, 5\)": dict(visual_pos_masks=mask[:, :5], deepstack_visual_embeds=features),
        "4 deepstack_visual_embeds for 3 decoder layers": dict(
            visual_pos_masks=mask, deepstack_visual_embeds=features * 4
        ),
        # a mask of counts: the features were blamed for its sum (a QA run); 0/1 integers are a mask
        "visual_pos_masks holds values other than 0 and 1": dict(
            visual_pos_masks=torch.tensor([[0, 2, 2, 0, 0, 0]]), deepstack_visual_embeds=features
        ),
    }
    for message, inputs in cases.items():
        with pytest.raises(ValueError, match=message):
            model(inputs_embeds=embeds, **inputs)
    with torch.no_grad():
        as_integers = model(inputs_embeds=embeds, visual_pos_masks=mask.long(), deepstack_visual_embeds=features)
    assert torch.equal(as_integers.logits, added)


def norm_epsilons(model: torch.nn.Module) -> dict[str, float]:
    """Every norm module's epsilon by its name: RMSNorms (``variance_epsilon``) and LayerNorms (``eps``)."""
    found = {}
    for name, module in model.named_modules():
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if isinstance(eps, float):
            found[name] = eps
    return found


@pytest.mark.parametrize(
    "preset", ["qwen2.5-0.5b", "qwen3-0.6b", "qwen3-30b-a3b", "qwen3.5-0.8b", "qwen3-next-80b-a3b-instruct"]
)
@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
def test_every_norm_takes_the_configs_epsilon(preset, norm_type):
    """A QA run's mutations: the q/k norms, or the final norm, built without ``eps=config.rms_norm_eps`` (so at the
    default 1e-6) moved a real model's logits by 1e-6 to 3e-5 of their scale, under every tolerance, and no test
    saw it: the tiny configs all use the default. An epsilon no default has is found on every norm or on none."""
    config = load_preset(preset, num_hidden_layers=4, hidden_size=64, intermediate_size=64, vocab_size=128)
    config.rms_norm_eps, config.norm_type = 3e-5, norm_type
    with torch.device("meta"):
        found = norm_epsilons(ThinkerForCausalLM(config))
    assert found and set(found.values()) == {3e-5}, {name: eps for name, eps in found.items() if eps != 3e-5}
