"""Qwen3.8 (``qwen4_exp``) as a Thinker configuration, against transformers' ``Qwen4ExpForCausalLM``.

Hyper-connections, the QSA indexer on ``indexed_attention`` layers and PLE (hashed n-gram embeddings) are switches of
the one model; the tiny reference of ``tests/references/qwen4_exp.py`` has all three, with every weight random.
Configs are translated by the small function here, not by the converter, so these tests hold the model to the
reference on their own (tests/converter/test_qwen4_exp_family.py holds the converter to it). The parameter names are
Qwen4-Exp's, so the reference's state dict loads by name; its three PLE buffers (the hash multipliers and table
sizes) are derived from the config, and held equal to transformers' here.
"""

from __future__ import annotations

import pytest
import torch
from references.hybrid import left_pad, reference, token_ids
from references.qwen4_exp import EOS, LAYER_TYPES, TEXT_SIZES, VOCAB, qwen4_exp_config
from torch.testing import assert_close
from transformers import DynamicCache, Qwen4ExpForCausalLM
from transformers.cache_utils import DynamicIndexedLayer, LinearAttentionLayer
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen4_exp import modeling_qwen4_exp as qwen4

import thinker.modeling_thinker as modeling
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG, ThinkerQSAIndexer, ngram_multipliers, primes_after

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in fp32
ATTENTION = ["eager", "sdpa"]
# The reference's buffers the Thinker derives from its config instead of loading.
DERIVED_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
SAME_NAMES = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim max_position_embeddings "
    "rms_norm_eps hidden_act attention_bias tie_word_embeddings layer_types linear_conv_kernel_dim linear_key_head_dim "
    "linear_value_head_dim linear_num_key_heads linear_num_value_heads num_experts num_experts_per_tok "
    "moe_intermediate_size shared_expert_intermediate_size norm_topk_prob hc_count hc_lowrank ple_layer_ids "
    "ple_embed_dim ple_conv_kernel_size ngram_size heads_per_ngram ngram_vocab_size_base "
    "make_ngram_vocab_size_divisible_by split_ngram_parts indexer_n_heads indexer_head_dim indexer_budget "
    "indexer_compress_ratio eos_token_id pad_token_id"
).split()


def thinker_config_from(hf, **overrides) -> ThinkerConfig:
    fields = {name: getattr(hf, name) for name in SAME_NAMES}
    fields |= dict(
        rope_parameters=dict(hf.rope_parameters),
        ngram_seed=hf.seed,
        output_gate_type=hf.output_gate_type or hf.hidden_act,
        intermediate_size=hf.moe_intermediate_size,
        # what Qwen4-Exp hard-codes: Qwen3.5's attention and norms
        qk_norm=True,
        attention_output_gate=True,
        norm_zero_centered=True,
    )
    return ThinkerConfig(**(fields | overrides))


def pair(attn: str = "sdpa", seed: int = 0, **overrides) -> tuple[Qwen4ExpForCausalLM, ThinkerForCausalLM]:
    """(reference, thinker) with the same weights."""
    ref = reference(Qwen4ExpForCausalLM, qwen4_exp_config(**overrides), attn, seed=seed)
    config = thinker_config_from(ref.config)
    thinker = ThinkerForCausalLM._from_config(config, attn_implementation=attn, experts_implementation="eager").eval()
    state = {name: t for name, t in ref.state_dict().items() if not name.endswith(DERIVED_BUFFERS)}
    thinker.load_state_dict(state, strict=True)  # every parameter by name, nothing left over
    return ref, thinker


def padded_batch_with_eos(length: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 7, each with an eos inside (where the n-grams restart)."""
    ids = token_ids(batch=2, length=length, seed=5, high=VOCAB)
    ids[ids == EOS] = 2
    ids[0, 17], ids[1, 30] = EOS, EOS
    return left_pad([ids[0], ids[1, 7:]])


# ----------------------------------------------------------------------------------------------------------------
# the hash: the Thinker's own code against transformers' helpers


@pytest.mark.parametrize(
    ("vocab", "ngram", "index", "seed"), [(248320, 3, 0, 1234), (248320, 3, 2, 1234), (96, 4, 1, 7), (151936, 2, 5, 0)]
)
def test_ngram_multipliers_are_transformers(vocab, ngram, index, seed):
    assert (
        ngram_multipliers(vocab, ngram, index, seed)
        == qwen4._build_layer_multipliers(vocab, ngram, index, seed).tolist()
    )


def test_table_sizes_are_transformers_primes():
    # the defaults' first tables (base 20,000,000), and a small base past its first primes
    assert primes_after(20_000_000 - 1, 3) == [qwen4._find_nth_prime_after(20_000_000 - 1, n) for n in (1, 2, 3)]
    assert primes_after(1, 10) == [qwen4._find_nth_prime_after(1, n) for n in range(1, 11)]


def test_derived_buffers_equal_the_references():
    ref, thinker = pair()
    theirs = ref.state_dict()
    for layer in (0, 4):  # the two PLE layers: the second's primes continue from the first's
        ours = thinker.model.layers[layer].ple.ple_embedding
        prefix = f"model.layers.{layer}.ple.ple_embedding."
        assert torch.equal(ours.multipliers, theirs[prefix + "layer_multipliers"])
        assert torch.equal(ours.table_sizes, theirs[prefix + "ngram_heads_vocab_sizes"])
        assert torch.equal(ours.table_offsets, theirs[prefix + "ngram_heads_offsets"])
    assert not (
        thinker.model.layers[0].ple.ple_embedding.table_sizes == thinker.model.layers[4].ple.ple_embedding.table_sizes
    ).any()


# ----------------------------------------------------------------------------------------------------------------
# parity: logits, hidden states, routers, greedy continuations


@pytest.mark.parametrize("attn", ATTENTION)
def test_parity_with_reference_on_a_padded_batch(attn):
    ref, thinker = pair(attn)
    ids, mask = padded_batch_with_eos()
    with torch.no_grad():
        ours = thinker(ids, attention_mask=mask, output_hidden_states=True, output_router_logits=True, use_cache=False)
        theirs = ref(ids, attention_mask=mask, output_hidden_states=True, output_router_logits=True, use_cache=False)
    real = mask.bool()
    assert_close(ours.logits[real], theirs.logits[real], **TOL)
    assert float(theirs.logits.abs().max()) > 1.0  # a logit scale the tolerance means something against
    for layer, (mine, other) in enumerate(zip(ours.hidden_states, theirs.hidden_states, strict=True)):
        assert_close(mine[real], other[real], **TOL, msg=lambda m, layer=layer: f"hidden state {layer}: {m}")
    assert len(ours.router_logits) == len(theirs.router_logits) == 5
    for mine, other in zip(ours.router_logits, theirs.router_logits, strict=True):
        assert_close(mine[real.flatten()], other[real.flatten()], **TOL)

    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    prompt, prompt_mask = ids[:, :20], mask[:, :20]
    assert torch.equal(
        thinker.generate(prompt, attention_mask=prompt_mask, **greedy),
        ref.generate(prompt, attention_mask=prompt_mask, **greedy),
    )


def test_a_sigmoid_output_gate_equals_the_references():
    """Qwen4-Exp's gated norm of the linear-attention output takes output_gate_type (silu, as hidden_act, unless
    set): a sigmoid one (a mutation run: the norm's activation fixed at silu passed every test on the default)."""
    ref, thinker = pair(output_gate_type="sigmoid")
    assert thinker.config.output_gate_type == "sigmoid"
    ids, mask = padded_batch_with_eos()
    with torch.no_grad():
        ours, theirs = (model(ids, attention_mask=mask, use_cache=False).logits for model in (thinker, ref))
        silu = pair(output_gate_type="silu")[1](ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert_close(ours[real], theirs[real], **TOL)
    assert float((silu[real] - theirs[real]).abs().max()) > 100 * TOL["atol"]  # the gate shapes the logits


def test_a_row_in_a_padded_batch_equals_the_row_alone():
    _, thinker = pair()
    ids, mask = padded_batch_with_eos()
    with torch.no_grad():
        batch = thinker(ids, attention_mask=mask).logits
        alone = thinker(ids[1:, 7:]).logits
    assert_close(batch[1, 7:], alone[0], **TOL)


def test_the_indexer_prunes_and_the_parity_check_sees_it():
    """At 48 tokens the indexer keeps at most 11 of them per query; a Thinker whose indexer keeps every block (its
    budget widened, all else equal) is another model, and the parity check says so."""
    ref, thinker = pair()
    ids = token_ids(batch=1, length=48, seed=6, high=VOCAB)
    attention = thinker.model.layers[1].self_attn
    seen = {}
    attention.indexer.register_forward_hook(lambda module, args, out: seen.update(kept=out))
    with torch.no_grad():
        ours = thinker(ids).logits
        theirs = ref(ids).logits
    assert_close(ours, theirs, **TOL)
    kept = seen["kept"][0, 0].sum(-1)  # per query
    assert int(kept.max()) <= 8 + 3 and int(kept[-1]) < 48

    attention.indexer.budget = 48
    with torch.no_grad():
        widened = thinker(ids).logits
    assert (widened - theirs).abs().max() > 100 * TOL["atol"]


def indexer_pair(heads: int, dtype: torch.dtype, seed: int):
    """transformers' indexer and the Thinker's, the same random weights."""
    hf = qwen4_exp_config(indexer_n_heads=heads)
    theirs = qwen4.Qwen4ExpTextQSAIndexer(hf, 1)
    ours = ThinkerQSAIndexer(thinker_config_from(hf), 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * (0.3 if "norm" in name else 0.2))
    ours.load_state_dict(theirs.state_dict())
    return hf, theirs.to(dtype), ours.to(dtype)


def indexer_mismatches(heads: int, dtype: torch.dtype, seeds: range, attn: str = "sdpa") -> tuple[int, int]:
    """(queries whose kept slots differ from the reference's, queries compared): prefills of a left-padded batch of
    3 rows, each of 64 to 95 tokens (the indexer prunes from 12 visible tokens on), under the causal mask transformers
    builds (bool for sdpa, additive for eager), and under masks no causal model makes (random slots hidden), which
    take the reference's steps."""
    different = compared = 0
    for seed in seeds:
        hf, theirs, ours = indexer_pair(heads, dtype, seed)
        hf._attn_implementation = attn
        generator = torch.Generator().manual_seed(seed)
        length = 64 + seed % 32
        hidden = torch.randn(3, length, hf.hidden_size, generator=generator).to(dtype)
        padding = torch.ones(3, length, dtype=torch.long)
        padding[1, : seed % 7], padding[2, : 3 + seed % 11] = 0, 0
        positions = (padding.cumsum(-1) - 1).clamp(min=0)
        causal = create_causal_mask(
            config=hf,
            inputs_embeds=hidden,
            attention_mask=padding,
            cache=None,
            position_ids=positions,
            allow_is_causal_skip=False,
        )
        hidden_slots = torch.rand(causal.shape, generator=generator) < 0.2
        holes = causal & ~hidden_slots if attn == "sdpa" else causal.masked_fill(hidden_slots, causal.min())
        tables = qwen4.Qwen4ExpTextRotaryEmbedding(hf)(hidden, positions[None].expand(3, -1, -1))
        for mask in (causal, holes):
            with torch.no_grad():
                expected, actual = theirs(hidden, tables, mask, None), ours(hidden, tables, mask, None)
            different += int((expected != actual).any(-1).sum())
            compared += expected.shape[0] * expected.shape[2]
    return different, compared


@pytest.mark.parametrize(
    ("heads", "dtype", "attn"), [(1, torch.float32, "sdpa"), (3, torch.float32, "eager"), (2, torch.bfloat16, "sdpa")]
)
def test_the_indexer_keeps_the_slots_the_reference_keeps(heads, dtype, attn):
    """Block for block, query for query: scored for all queries at once, but decided as the reference decides where
    the scores leave room for doubt (one index head makes ties at zero common: relu)."""
    different, compared = indexer_mismatches(heads, dtype, range(12), attn)
    assert different == 0 and compared > 3000


def test_the_indexer_check_fails_when_ties_are_not_settled_as_the_reference_settles_them(monkeypatch):
    """A planted bug: every query's batched ranking taken as certain. With one index head, ties and near-ties then
    pick other blocks than the reference in some queries, and the comparison above sees them."""
    real = modeling.best_blocks
    monkeypatch.setattr(
        modeling, "best_blocks", lambda *args: (real(*args)[0], torch.ones(args[2].shape[:2], dtype=torch.bool))
    )
    different, _ = indexer_mismatches(1, torch.float32, range(12))
    assert different > 0


# ----------------------------------------------------------------------------------------------------------------
# cache: conv and recurrent state, PLE windows and n-gram context, index keys and the position history


def test_cache_layers_and_what_they_hold():
    _, thinker = pair()
    cache = DynamicCache(config=thinker.config)
    assert [type(layer) for layer in cache.layers] == [
        LinearAttentionLayer if kind == "linear_attention" else DynamicIndexedLayer for kind in LAYER_TYPES
    ]
    ids = token_ids(batch=2, length=9, seed=3, high=VOCAB)
    with torch.no_grad():
        thinker(ids, use_cache=True, **{CACHE_ARG: cache})
    ple = cache.layers[0]
    assert ple.number_of_states == 3
    assert ple.conv_states[1].shape == (2, 3 * 32, (3 - 1) * 3)  # the PLE conv's window: (kernel - 1) x dilation
    assert torch.equal(ple.conv_states[2], ids[:, -2:])  # the n-gram context: the last ngram_size - 1 ids
    assert cache.layers[2].conv_states[1] is None  # not a PLE layer
    indexed = cache.layers[1]
    assert indexed.indexer_keys.shape == (2, 9, 12) and indexed.indexer_position_ids.shape == (3, 2, 9)
    assert cache.layers[3].indexer_position_ids is None  # the history is kept once, on the first indexed layer
    assert cache.get_seq_length() == 9


@pytest.mark.parametrize("attn", ATTENTION)
def test_prefill_then_decode_equals_the_reference(attn):
    ref, thinker = pair(attn)
    ids, mask = padded_batch_with_eos(length=44)
    logits = {}
    with torch.no_grad():
        full = ref(ids, attention_mask=mask, use_cache=False).logits
        for name, model in (("ours", thinker), ("theirs", ref)):
            cache = DynamicCache(config=model.config)
            steps = [model(ids[:, :30], attention_mask=mask[:, :30], use_cache=True, **{CACHE_ARG: cache}).logits]
            for t in range(30, ids.shape[1]):
                step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], use_cache=True, **{CACHE_ARG: cache})
                steps.append(step.logits)
            logits[name] = torch.cat(steps, dim=1)
    real = mask.bool()
    assert_close(logits["ours"][real], logits["theirs"][real], **TOL)
    assert_close(logits["ours"][real], full[real], **TOL)


def test_chunked_prefill_and_a_first_chunk_shorter_than_the_context():
    """Prefill in chunks (one of a single token, shorter than the n-gram context), then the rest: the cached PLE
    windows, n-gram context and index keys carry across chunks as the whole prompt would."""
    ref, thinker = pair()
    ids = token_ids(batch=2, length=40, seed=7, high=VOCAB)
    with torch.no_grad():
        whole = ref(ids, use_cache=False).logits
        cache = DynamicCache(config=thinker.config)
        chunks = [
            thinker(ids[:, a:b], use_cache=True, **{CACHE_ARG: cache}).logits for a, b in ((0, 1), (1, 23), (23, 40))
        ]
    assert_close(torch.cat(chunks, dim=1), whole, **TOL)


def test_beam_search_equals_the_reference():
    """Beams reorder the cache: the index keys and the position history move with their rows."""
    ref, thinker = pair()
    prompt = token_ids(batch=1, length=14, seed=8, high=VOCAB)
    beams = dict(max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(thinker.generate(prompt, **beams), ref.generate(prompt, **beams))


# ----------------------------------------------------------------------------------------------------------------
# inputs_embeds and multimodal positions


def test_inputs_embeds_find_their_ids_or_take_ple_input_ids(monkeypatch):
    ref, thinker = pair()
    ids = token_ids(batch=2, length=20, seed=9, high=VOCAB)
    embeds = thinker.model.embed_tokens(ids).detach()
    with torch.no_grad():
        by_ids = thinker(ids).logits
        assert_close(thinker(inputs_embeds=embeds).logits, by_ids, **TOL)
        monkeypatch.setattr(modeling, "REVERSE_EMBEDDING_ELEMENTS", 1)  # the table compared one row at a time
        assert torch.equal(thinker.model.reverse_embedding(embeds), ids)
        assert_close(thinker(inputs_embeds=embeds, ple_input_ids=ids).logits, by_ids, **TOL)
        # an image's embedding stands at a placeholder id: PLE hashes the id, the decoder reads the embedding
        embeds[0, 5] = torch.randn(embeds.shape[-1])
        ours = thinker(inputs_embeds=embeds, ple_input_ids=ids).logits
        theirs = ref(inputs_embeds=embeds, ple_input_ids=ids).logits
        assert_close(ours, theirs, **TOL)
        with pytest.raises(ValueError, match="pass ple_input_ids"):
            thinker(inputs_embeds=embeds)
        # integers are no embeddings, before any lookup of them (a review: the PLE refusal answered first)
        with pytest.raises(ValueError, match="inputs_embeds of dtype torch.int64; expected floating-point"):
            thinker(inputs_embeds=embeds.long())


def test_multimodal_positions_equal_the_reference():
    """(3, B, T) temporal / height / width positions (an image grid in the middle), and (4, B, T) with a text row:
    the attention and the indexer's block keys both rotate by them."""
    ref, thinker = pair()
    ids = token_ids(batch=2, length=36, seed=10, high=VOCAB)
    positions = torch.arange(36).expand(3, 2, 36).clone()
    positions[1, :, 10:22] = 10 + torch.arange(12) // 4  # a 3 x 4 grid: rows, then columns
    positions[2, :, 10:22] = 10 + torch.arange(12) % 4
    positions[:, :, 22:] -= 8
    with torch.no_grad():
        for given in (positions, torch.cat([torch.arange(36).expand(1, 2, 36), positions])):
            assert_close(thinker(ids, position_ids=given).logits, ref(ids, position_ids=given).logits, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# loading and the config's checks


def test_save_and_load_derive_the_hash_again(tmp_path):
    """The hash buffers are not in the checkpoint: a model loaded on the meta device derives them again."""
    _, thinker = pair()
    thinker.save_pretrained(tmp_path)
    loaded = ThinkerForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()  # as pair() builds it
    ids = token_ids(batch=2, length=30, seed=11, high=VOCAB)
    assert_same_hash(loaded, thinker)
    with torch.no_grad():  # a wrong hash reads other table rows: differences of the logits' own size
        assert_close(loaded(ids).logits, thinker(ids).logits, **SAME_WEIGHTS)
    assert not any("multipliers" in name or "table_" in name for name in loaded.state_dict())


def test_a_resized_thinker_keeps_its_hash(tmp_path):
    """The hash's multipliers are drawn for the vocabulary the model was made with (ngram_hash_vocab_size, fixed in
    the config): resizing the embeddings, saving and loading again changes no logit of the old tokens' prompts."""
    _, thinker = pair()
    ids = token_ids(batch=2, length=30, seed=12, high=VOCAB)
    thinker.resize_token_embeddings(VOCAB + 32)
    with torch.no_grad():
        before = thinker(ids).logits[..., :VOCAB]
    thinker.save_pretrained(tmp_path)
    loaded = ThinkerForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()  # as pair() builds it
    assert loaded.config.ngram_hash_vocab_size == VOCAB and loaded.config.vocab_size == VOCAB + 32
    assert_same_hash(loaded, thinker)
    with torch.no_grad():
        assert_close(loaded(ids).logits[..., :VOCAB], before, **SAME_WEIGHTS)


# The same weights, loaded from a file: bit for bit on some CPUs, within float32's rounding on others (a loaded tensor's
# alignment can pick another kernel path: an AMD EPYC here, where the experts' matmuls differed by 6e-8).
SAME_WEIGHTS = {"rtol": 1e-5, "atol": 1e-5}


def assert_same_hash(loaded: ThinkerForCausalLM, made: ThinkerForCausalLM) -> None:
    """The derived hash buffers, which the checkpoint does not hold, equal to the last bit."""
    derived = {name: buffer for name, buffer in made.named_buffers() if "multipliers" in name or "table_" in name}
    assert derived
    again = dict(loaded.named_buffers())
    for name, buffer in derived.items():
        assert torch.equal(again[name], buffer), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"indexer_budget": None}, "indexed_attention layers need indexer_budget"),
        ({"indexer_budget": 6}, "not a multiple of indexer_compress_ratio"),
        ({"indexer_head_dim": 4}, "narrower than the rotary part"),
        ({"ple_layer_ids": [2]}, "PLE layers are linear-attention layers"),
        ({"ple_layer_ids": [6]}, "PLE layers are linear-attention layers"),
        ({"eos_token_id": None}, "PLE layers need eos_token_id"),
        ({"heads_per_ngram": 3}, "must split into the 6 n-gram heads"),
        ({"hc_lowrank": 0}, "hc_lowrank >= 1"),
        ({"output_gate_type": "gelu"}, "output_gate_type='gelu'"),
    ],
)
def test_config_refuses_what_no_model_builds(change, message):
    fields = thinker_config_from(qwen4_exp_config()).to_dict() | change
    with pytest.raises(Exception, match=message):
        ThinkerConfig(**{k: v for k, v in fields.items() if k not in ("transformers_version", "model_type")})


def test_an_attention_without_a_dense_mask_is_refused_by_name():
    """flash attention passes no mask and flex a BlockMask: neither can be narrowed per query."""
    _, thinker = pair()
    attention, hidden = thinker.model.layers[1].self_attn, torch.zeros(1, 8, TEXT_SIZES["hidden_size"])
    thinker.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="need a dense mask .*'flash_attention_2' gives NoneType"):
        attention(hidden, position_embeddings=None, attention_mask=None)


def test_flex_and_flash_attention_are_refused_when_the_model_is_built(tmp_path):
    """As transformers' Qwen4-Exp refuses them at load, not at the first forward; without indexers they are kept."""
    _, thinker = pair()
    thinker.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'flex_attention': indexed_attention layers .* load with"):
        ThinkerForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="'flash_attention_2': indexed_attention layers"):
        thinker._flash_attn_can_dispatch(2, is_init_check=True)
    with pytest.raises(ValueError, match="'flex_attention': indexed_attention layers"):
        thinker.set_attn_implementation("flex_attention")
    plain = ThinkerConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    assert ThinkerForCausalLM(plain)._flex_attn_can_dispatch(is_init_check=True)


assert TEXT_SIZES["layer_types"] == LAYER_TYPES


def test_every_norm_takes_the_configs_epsilon():
    """The hyper-connections' and PLE's norms too (tests/test_modeling.py has the other layer types)."""
    from test_modeling import norm_epsilons

    with torch.device("meta"):
        found = norm_epsilons(ThinkerForCausalLM(thinker_config_from(qwen4_exp_config(), rms_norm_eps=3e-5)))
    assert found and set(found.values()) == {3e-5}, {name: eps for name, eps in found.items() if eps != 3e-5}
