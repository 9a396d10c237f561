"""The parts of a model the parity prompts cannot reach, compared directly: every row of the token embedding, every
routed expert and its router row, and every row of the n-gram tables of Qwen4-Exp's PLE layers.

The fixed prompts hold 252 token ids (``gate_prompts``), so they read at most 252 rows of a 150k embedding; and a
router sends them to some of a layer's experts (of 128 at top-8 in a MoE layer, few tokens reach the rarer ones). A
conversion that garbles a row or an expert nobody routes to would pass the logits. So both models' embeddings and
experts also run on inputs of their own, from a fixed seed:

- the embedding: the whole table times a fixed (hidden, PROBE_COLUMNS) matrix, which differs wherever any row does;
  so is a learned position table (GPT-2's), whose rows past the prompts' positions no prompt reads;
- each MoE layer's experts: EXPERT_ROWS random hidden states sent to every expert in turn (weight 1, one expert a
  token), through the experts module's own forward (transformers 5's ``experts(hidden, top_k_index,
  top_k_weights)``, the Thinker's alike) or, for a list of expert modules, each expert called;
- each MoE layer's router (``mlp.gate``): its logits for every expert on PROBE_COLUMNS random hidden states. The
  row of an expert no prompt token is routed to changes no logit of theirs either (two such rows swapped would send
  a later token to the wrong expert: a QA run), and the experts' probe does not route;
- each PLE layer's n-gram table (``ple.ple_embedding.ngram_embedding``, the same path in both models), as the
  embedding: a prompt hashes to a few dozen of its rows, of hundreds of millions at full size, and its pieces are
  joined by the conversion (one out of order would pass the logits);
- each indexed-attention layer's QSA indexer (``self_attn.indexer``, the same path and call in both models): it
  keeps every token until more than its budget are visible, which the prompts never are, so its weights change no
  logit of theirs. It runs on random hidden states as many tokens long as its budget plus eight blocks, under a
  causal mask and random rotary tables, and the slots it keeps for each query are compared (any slot apart fails);
- the positions: the prompts hold a few dozen, where the config's RoPE scaling (dynamic NTK, LongRoPE's long
  factors, YaRN past the trained length) and its context length act only far beyond them, and their positions are
  text ones, where a multimodal model's sections and their layout (Qwen3.5's interleaved mRoPE) act only on an
  image's. So the context (``max_position_embeddings``) is held equal, and both rotary embeddings' cos / sin tables
  are compared at positions across the trained length, the whole context and past it, as (3, B, T) positions where
  the model takes them (``position_stages``: a config translation that passes every weight check, a QA run found);
- a vision-language model's DeepStack layer count (``deepstack_stage``): text prompts take no DeepStack features, so
  a count translated wrong passes them, and an export with ``--inputs-embeds`` takes as many feature inputs as it says.

Each is a stage like the layer-by-layer check's (``LayerParity``), held to the same relative tolerance. ``Probes``
collects both sides' figures and compares them: from whole models (``unreached_stages``), or unit by unit as the
layer-by-layer check loads them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedConfig

from thinker_common.parity_inputs import GATE_TOLERANCE

from .parity_report import CONTEXT_STAGE, DEEPSTACK_STAGE, POSITION_ROWS, ROTARY_STAGE, LayerParity

PROBE_COLUMNS = 8
EXPERT_ROWS = 2
PROBE_SEED = 0
EXTRA_BLOCKS = 8  # the indexer's probe runs on its budget plus this many blocks of tokens
EMBEDDING_ROWS = "every embedding row"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def _random(rows: int, columns: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, columns, generator=generator).to(dtype)


@torch.no_grad()
def embedding_probe(embedding: nn.Embedding) -> torch.Tensor:
    """The table times a fixed (hidden, PROBE_COLUMNS) matrix: (vocab, PROBE_COLUMNS), a row per token id."""
    table = embedding.weight
    return table @ _random(table.shape[1], PROBE_COLUMNS, table.dtype, PROBE_SEED)


def experts_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's routed experts (``mlp.experts``), or None for a dense layer."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return experts if isinstance(experts, nn.Module) else None


@torch.no_grad()
def every_expert(layer: nn.Module, hidden_size: int) -> torch.Tensor | None:
    """Each routed expert of ``layer`` on the same EXPERT_ROWS fixed hidden states: (experts * EXPERT_ROWS, hidden),
    expert after expert; None for a dense layer."""
    experts = experts_of(layer)
    if experts is None:
        return None
    dtype = next(experts.parameters()).dtype
    hidden = _random(EXPERT_ROWS, hidden_size, dtype, PROBE_SEED + 1)
    if isinstance(experts, nn.ModuleList):  # one module per expert
        return torch.cat([expert(hidden) for expert in experts])
    count = experts.num_experts
    index = torch.arange(count).repeat_interleave(EXPERT_ROWS)[:, None]
    return experts(hidden.repeat(count, 1), index, torch.ones(index.shape, dtype=dtype))


@torch.no_grad()
def every_router_row(layer: nn.Module, hidden_size: int) -> torch.Tensor | None:
    """A MoE layer's router logits, (PROBE_COLUMNS, experts), on fixed random hidden states; None for a dense layer.
    transformers 5's routers return ``(logits, weights, indices)``, a plain ``nn.Linear`` router its logits."""
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    if experts_of(layer) is None or not isinstance(gate, nn.Module):
        return None
    hidden = _random(PROBE_COLUMNS, hidden_size, next(gate.parameters()).dtype, PROBE_SEED + 4)
    logits = gate(hidden)
    return logits[0] if isinstance(logits, tuple) else logits


def stage(name: str, expected: torch.Tensor | None, actual: torch.Tensor | None, dtype: torch.dtype) -> LayerParity:
    """``expected`` against ``actual`` at ``GATE_TOLERANCE[dtype]`` of the expected's scale; a missing or
    differently shaped side fails."""
    if expected is None or actual is None or expected.shape != actual.shape:
        nan, inf = float("nan"), float("inf")
        return LayerParity(name=name, max_abs_diff=inf, mean_abs_diff=nan, scale=nan, tolerance=nan, passed=False)
    expected, actual = expected.float(), actual.float()
    diff = (expected - actual).abs()
    scale = expected.abs().max().item()
    tolerance = GATE_TOLERANCE[dtype] * max(1.0, scale)
    return LayerParity(
        name=name,
        max_abs_diff=diff.max().item(),
        mean_abs_diff=diff.mean().item(),
        scale=scale,
        tolerance=tolerance,
        passed=diff.max().item() <= tolerance,
    )


def ngram_table_probe(layer: nn.Module) -> torch.Tensor | None:
    """A PLE layer's n-gram table through ``embedding_probe``; None for a layer without one."""
    table = getattr(getattr(getattr(layer, "ple", None), "ple_embedding", None), "ngram_embedding", None)
    return embedding_probe(table) if isinstance(table, nn.Embedding) else None


@torch.no_grad()
def indexer_probe(layer: nn.Module, hidden_size: int, rotary_dim: int, tokens: int) -> torch.Tensor | None:
    """The slots a layer's QSA indexer keeps, (tokens, tokens) as 0 / 1, on fixed random inputs of ``tokens``
    positions; None for a layer without one."""
    indexer = getattr(getattr(layer, "self_attn", None), "indexer", None)
    if indexer is None or not tokens:
        return None
    dtype = next(indexer.parameters()).dtype
    hidden = _random(tokens, hidden_size, dtype, PROBE_SEED + 2)[None]
    angles = _random(tokens, rotary_dim, torch.float32, PROBE_SEED + 3)[None]
    tables = (angles.cos().to(dtype), angles.sin().to(dtype))
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    return indexer(hidden, tables, causal, None)[0, 0].float()


def experts_stage(layer: int) -> str:
    return f"layer {layer}: every expert"


def router_stage(layer: int) -> str:
    return f"layer {layer}: every router row"


def ngram_stage(layer: int) -> str:
    return f"layer {layer}: every n-gram row"


def indexer_stage(layer: int) -> str:
    return f"layer {layer}: the indexer's choice"


def embeddings_parent(model: nn.Module) -> nn.Module | None:
    """The module whose child the model's input embeddings are (``model``, ``model.language_model``, GPT-2's
    ``transformer``), or None."""
    embeddings = model.get_input_embeddings()
    return next((module for module in model.modules() if any(c is embeddings for c in module.children())), None)


def decoder_module(model: nn.Module) -> nn.Module | None:
    """The module holding a model's decoder layers beside its input embeddings (``model``, ``model.language_model``,
    a thinker's ``model``), or None where none does."""
    parent = embeddings_parent(model)
    return parent if isinstance(getattr(parent, "layers", None), nn.ModuleList) else None


def decoder_layers(model: nn.Module) -> dict[int, nn.Module]:
    """A model's decoder layers by index: the ``layers`` list beside its input embeddings (``model.``,
    ``model.language_model.``, a thinker's ``model.``). A model with towers has other ``layers`` lists (Qwen3-Omni's
    audio encoder: ``audio_tower.layers.N``), so the first ``...layers.{i}`` found by name is not the decoder's."""
    decoder = decoder_module(model)
    if decoder is not None:
        return dict(enumerate(decoder.layers))
    found = {}  # no such pair: every ``...layers.{i}`` by name, the first of each index
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if match:
            found.setdefault(int(match.group(1)), module)
    return found


@dataclass
class Probes:
    """Each side's figures ("reference", "converted"): the embedding table's probe, and each decoder layer's experts
    and n-gram table in the order of the layers (None where a layer has none). Taken as the modules come: all at
    once from whole models (``unreached_stages``), or while each unit is loaded (converter/layer_parity.py)."""

    hidden_size: int
    vocab_size: int
    rotary_dim: int = 0  # of the attention heads, whose tables the indexer takes
    indexer_tokens: int = 0  # the indexer probe's length (0: no indexer)
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: dict[str, list[torch.Tensor | None]] = field(default_factory=lambda: {"reference": [], "converted": []})
    routers: dict[str, list[torch.Tensor | None]] = field(default_factory=lambda: {"reference": [], "converted": []})
    ngrams: dict[str, list[torch.Tensor | None]] = field(default_factory=lambda: {"reference": [], "converted": []})
    indexers: dict[str, list[torch.Tensor | None]] = field(default_factory=lambda: {"reference": [], "converted": []})
    position_tables: set[int] = field(default_factory=set)  # the ids of both models' learned position tables
    positions: dict[str, torch.Tensor] = field(default_factory=dict)

    def watch_positions(self, *models: nn.Module) -> None:
        """Take the learned position tables of these models (``position_table``) as they come by."""
        self.position_tables |= {id(table) for model in models if (table := position_table(model)) is not None}

    @classmethod
    def of(cls, config: PreTrainedConfig) -> Probes:
        """The probes a model of ``config`` needs (the converted model's: a Thinker's, or on the way back the family's,
        which names the indexer's sizes alike)."""
        budget, ratio = getattr(config, "indexer_budget", None), getattr(config, "indexer_compress_ratio", None)
        tokens = budget + EXTRA_BLOCKS * ratio if budget and ratio else 0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = int(head_dim * (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))
        return cls(config.hidden_size, config.vocab_size, rotary, tokens)

    def take(self, side: str, module: nn.Module, is_layer: bool) -> None:
        if is_layer:
            self.experts[side].append(every_expert(module, self.hidden_size))
            self.routers[side].append(every_router_row(module, self.hidden_size))
            self.ngrams[side].append(ngram_table_probe(module))
            self.indexers[side].append(indexer_probe(module, self.hidden_size, self.rotary_dim, self.indexer_tokens))
        elif id(module) in self.position_tables:
            self.positions.setdefault(side, embedding_probe(module))
        elif isinstance(module, nn.Embedding) and module.num_embeddings == self.vocab_size:
            self.embeddings.setdefault(side, embedding_probe(module))

    def stages(self, dtype: torch.dtype) -> list[LayerParity]:
        """The embedding table, then each MoE layer's experts and router (a layer dense on both sides has none),
        each PLE layer's n-gram table and each indexed layer's indexer."""
        found = [stage(EMBEDDING_ROWS, self.embeddings.get("reference"), self.embeddings.get("converted"), dtype)]
        if self.positions:  # a learned position table: its rows past the prompts' few dozen positions
            found.append(stage(POSITION_ROWS, self.positions.get("reference"), self.positions.get("converted"), dtype))
        kinds = (
            (self.experts, experts_stage),
            (self.routers, router_stage),
            (self.ngrams, ngram_stage),
            (self.indexers, indexer_stage),
        )
        for probes, name in kinds:
            theirs = probes["reference"]
            for index, actual in enumerate(probes["converted"]):
                expected = theirs[index] if index < len(theirs) else None
                if actual is not None or expected is not None:
                    found.append(stage(name(index), expected, actual, dtype))
        return found


def unreached_stages(reference: nn.Module, converted: nn.Module, dtype: torch.dtype) -> list[LayerParity]:
    """Whole models, in the same dtype: ``Probes.stages``, then ``position_stages`` and ``deepstack_stage``."""
    probes = Probes.of(converted.config)
    probes.watch_positions(reference, converted)
    for side, model in (("reference", reference), ("converted", converted)):
        probes.take(side, model.get_input_embeddings(), is_layer=False)
        if (table := position_table(model)) is not None:
            probes.take(side, table, is_layer=False)
        for _, layer in sorted(decoder_layers(model).items()):
            probes.take(side, layer, is_layer=True)
    return probes.stages(dtype) + position_stages(reference, converted, dtype) + deepstack_stage(reference, converted)


PROBED_POSITIONS = 8  # positions probed at the context's start, middle and end, and as many past it


def text_config(model: nn.Module) -> PreTrainedConfig | None:
    """The decoder's config (a vision-language or omni config's ``text_config``), or None for a model without one."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def position_table(model: nn.Module) -> nn.Embedding | None:
    """A learned position table (GPT-2's ``wpe``, the Thinker's ``embed_positions``): the embedding beside the token
    embedding with as many rows as the context; None for a model whose positions are rotary, or one written without
    transformers (no config, no ``get_input_embeddings``)."""
    context = getattr(text_config(model), "max_position_embeddings", None)
    if not isinstance(context, int) or not hasattr(model, "get_input_embeddings"):
        return None
    embeddings, parent = model.get_input_embeddings(), embeddings_parent(model)
    siblings = parent.children() if parent is not None else ()
    return next(
        (c for c in siblings if c is not embeddings and isinstance(c, nn.Embedding) and c.num_embeddings == context),
        None,
    )


def _spread(length: int) -> list[int]:
    """PROBED_POSITIONS positions at each of the start, the middle and the end of ``length``."""
    span = range(PROBED_POSITIONS)
    return sorted({*span, *(length // 2 + i for i in span), *(length - 1 - i for i in span)})


@torch.no_grad()
def rotary_probe(rotary: nn.Module, context: int, trained: int, sections: list[int] | None) -> torch.Tensor:
    """A rotary embedding's cos and sin at positions across the ``trained`` length alone (where it is shorter than
    the context: LongRoPE takes its short factors for a sequence within it, its long ones past it), across
    ``context`` (its start, middle and end), then again with as many past it, where dynamic NTK rescales; (3, 1, T)
    positions, each stream its own, where the model has multimodal ``sections``. Each call's longest position picks
    the frequencies of the whole call, as it does in a forward. Run on a copy: those types rewrite the module's
    frequencies as they go."""
    rotary = copy.deepcopy(rotary)
    within = _spread(context)
    calls = [_spread(trained)] if trained < context else []
    calls += [within, [*within, *(2 * context - 1 - i for i in range(PROBED_POSITIONS))]]
    tables = []
    for positions in calls:
        ids = torch.tensor(positions)[None]
        if sections:
            ids = torch.stack([ids, ids // 2, ids // 3])  # temporal, height, width: three different streams
        cos, sin = rotary(torch.zeros(1), ids)
        if cos.ndim == 4:  # Qwen2-VL's form: a table per stream, its sections picked in the attention (as there)
            cos, sin = (_pick_sections(table, sections) for table in (cos, sin))
        tables += [cos.flatten(), sin.flatten()]
    return torch.cat(tables)


def _pick_sections(table: torch.Tensor, sections: list[int]) -> torch.Tensor:
    """(3, B, T, dim) to (B, T, dim): each section of the rotary dims from its stream, as Qwen2-VL's
    ``apply_multimodal_rotary_pos_emb`` takes them (the sections twice over: both halves of the head)."""
    pieces = table.split(list(sections) * 2, dim=-1)
    return torch.cat([piece[index % 3] for index, piece in enumerate(pieces)], dim=-1)


def position_stages(reference: nn.Module, converted: nn.Module, dtype: torch.dtype) -> list[LayerParity]:
    """The context held equal, and both rotary embeddings compared across it (``rotary_probe``), at the relative
    tolerance of the dtype the models run in (their frequencies are held so); nothing where a side has no config or
    no rotary embedding (learned positions, a reference written without transformers)."""
    theirs, ours = text_config(reference), text_config(converted)
    context = getattr(theirs, "max_position_embeddings", None)
    if not isinstance(context, int) or ours is None:
        return []
    stages = [held_equal(CONTEXT_STAGE, context, getattr(ours, "max_position_embeddings", None))]
    rotaries = [getattr(decoder_module(model), "rotary_emb", None) for model in (reference, converted)]
    if all(isinstance(rotary, nn.Module) for rotary in rotaries):
        rope = getattr(ours, "rope_parameters", None) or {}
        trained = rope.get("original_max_position_embeddings") or context
        expected, actual = (rotary_probe(rotary, context, trained, rope.get("mrope_section")) for rotary in rotaries)
        stages.append(stage(ROTARY_STAGE, expected, actual, dtype))
    return stages


def deepstack_layers(model: nn.Module) -> int:
    """How many first decoder layers take a vision tower's DeepStack features: a Thinker's ``deepstack_layers``, or
    as many as a Qwen3-VL / Qwen3-Omni vision tower has mergers for them (``deepstack_merger_list``, one per
    ``deepstack_visual_indexes``), 0 for a model without: the modules the model runs, not the config key, which a
    Qwen3.5 config may carry unread (a review)."""
    layers = getattr(text_config(model), "deepstack_layers", None)
    if isinstance(layers, int):
        return layers
    mergers = (getattr(module, "deepstack_merger_list", None) for module in model.modules())
    return next((len(found) for found in mergers if isinstance(found, nn.ModuleList)), 0)


def deepstack_stage(reference: nn.Module, converted: nn.Module) -> list[LayerParity]:
    """The DeepStack layer count held equal, where either model has one: text prompts take no DeepStack features,
    so a count translated wrong passes every logit, and an exported graph (``--inputs-embeds``) takes as many
    feature inputs as it says."""
    theirs, ours = deepstack_layers(reference), deepstack_layers(converted)
    return [held_equal(DEEPSTACK_STAGE, theirs, ours)] if theirs or ours else []


def held_equal(name: str, expected: int, actual: int | None) -> LayerParity:
    """A count of the config the prompts cannot show (the context, DeepStack's layers) as a stage: how far apart,
    at a tolerance of 0; a count the converted model lacks is infinitely far."""
    differ = float(abs(expected - actual)) if isinstance(actual, int) else float("inf")
    return LayerParity(name, differ, differ, float(expected), 0.0, passed=differ == 0)
