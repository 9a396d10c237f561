"""Qwen3.8's QSA indexer (export/indexer_graph.py) exported alone and run by onnxruntime (CPU) against the PyTorch
Thinker's ``ThinkerQSAIndexer`` with its ``DynamicCache``: the slots each query keeps, slot for slot, and the carried
index keys, bit for bit, through a left-padded prefill and decode steps fed the graph's own present keys, and
through a chunked prefill whose first chunk holds no complete block.

The batch's rows are padded by 0 and 7 slots, so their blocks start out of step. With keep = 8 // 4 = 2 blocks,
the 44-token prefill prunes from 12 visible tokens on; early queries see fewer than two blocks (TopK's k clamped,
picks of unseen blocks dropped). The seeds are fixed: with two index heads a query's relu scores tie at zero for
some blocks, and where such a tie decides (fewer than two blocks above zero among four or more) the graph keeps
the lower block index and torch.topk a value-dependent one (the module docstring); these inputs have no such query,
which ``test_inputs_have_no_deciding_tie`` checks, so a mismatch here is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import component_session
from onnx import TensorProto
from seeded_weights import randomize_parameters
from transformers import DynamicCache

import export.indexer_graph as indexer_graph
from export.decoder_graph import rotary_dim
from export.graph_builder import TORCH_TO_ONNX, GraphBuilder, WeightFile, value_info
from export.indexer_graph import emit_indexer_selection
from thinker.configuration_thinker import ThinkerConfig
from thinker.modeling_thinker import ThinkerQSAIndexer, ThinkerRotaryEmbedding, lowest_block_wins_ties, rotate

PADS = (0, 7)  # left padding of each row: block alignment differs between them
PREFILL = 44  # slots of the prefill, padding included
DECODE_STEPS = 6
CHUNKS = (3, 17, 20)  # the first: no complete block yet (NB = 0)
PREFILL_THEN_DECODE = [PREFILL] + [1] * DECODE_STEPS
HIDDEN_SEED = 3  # no choice of these inputs rests on a tie torch.topk breaks its own way (module docstring)
TIED_SEED = 1  # one that does: query 16 of row 0 sees four blocks, each scoring 0
PREFIX = "model.layers.0.self_attn.indexer"
INT64_MAX = 2**63 - 1  # Slice's "to the end"


def indexer_config() -> ThinkerConfig:
    """Two index heads of 16, RoPE on their first 8 channels (partial_rotary_factor 0.5 of the attention's 16),
    blocks of 4, a budget of 8 (two blocks), zero-centred norms (Qwen3.8's)."""
    return ThinkerConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        layer_types=["indexed_attention"],
        indexer_n_heads=2,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        norm_zero_centered=True,
    )


def seeded_indexer(config: ThinkerConfig, seed: int = 0) -> ThinkerQSAIndexer:
    indexer = randomize_parameters(ThinkerQSAIndexer(config, layer_idx=0), seed=seed)
    with torch.no_grad():  # zero-centred weights are offsets from one: small ones, as a checkpoint's
        for norm in (indexer.q_layernorm, indexer.k_layernorm):
            norm.weight.sub_(1.0)
    return indexer.eval()


# --- the graph --------------------------------------------------------------------------------------------------
def indexer_session(
    config: ThinkerConfig, indexer: ThinkerQSAIndexer, dtype: torch.dtype, folder: Path, builder=GraphBuilder
):
    """An onnxruntime CPU session of a graph holding the emitter alone: inputs hidden, cos, sin, visible,
    past_index_keys; outputs selected and present_index_keys."""
    weights = WeightFile(folder / "indexer.onnx.data")
    b = builder(weights)
    state = {f"{PREFIX}.{name}": tensor.detach().to(dtype) for name, tensor in indexer.state_dict().items()}

    def matmul(x: str, name: str, weight: torch.Tensor) -> str:
        return b.op("MatMul", x, b.weight(name, weight))

    with b.scope("indexer"):
        selected = emit_indexer_selection(
            b, config, 0, dtype, state.__getitem__, matmul, "hidden", "cos", "sin", "visible",
            "past_index_keys", "present_index_keys",
        )  # fmt: skip
    b.op_to("Identity", [selected], ["selected"])
    onnx_dtype, rot, dim = TORCH_TO_ONNX[dtype], rotary_dim(config), config.indexer_head_dim
    inputs = [
        value_info("hidden", onnx_dtype, ["batch", "seq", config.hidden_size]),
        value_info("cos", onnx_dtype, ["batch", "total", rot]),
        value_info("sin", onnx_dtype, ["batch", "total", rot]),
        value_info("visible", TensorProto.BOOL, ["batch", "seq", "total"]),
        value_info("past_index_keys", onnx_dtype, ["batch", 1, "past", dim]),
    ]
    outputs = [
        value_info("selected", TensorProto.BOOL, ["batch", "seq", "total"]),
        value_info("present_index_keys", onnx_dtype, ["batch", 1, "total", dim]),
    ]
    return component_session(b, weights, "indexer", inputs, outputs, folder, threads=1)


# --- the inputs -------------------------------------------------------------------------------------------------
@dataclass
class Sequence:
    """A left-padded batch over its whole length: every slot's hidden state, RoPE tables and kept flag."""

    hidden: torch.Tensor  # (B, L, C)
    cos: torch.Tensor  # (B, L, rot)
    sin: torch.Tensor
    kept: torch.Tensor  # (B, L) bool

    def visible(self, past: int, end: int) -> torch.Tensor:
        """(B, S, T) bool for the new slots past .. end - 1: causal and padding."""
        causal = torch.arange(end)[None, :] <= torch.arange(past, end)[:, None]
        return causal[None] & self.kept[:, None, :end]


def padded_sequence(config: ThinkerConfig, length: int, dtype: torch.dtype, seed: int = HIDDEN_SEED) -> Sequence:
    """Rows padded on the left by PADS; positions count the kept slots (pads at 1, as generate() numbers them)."""
    kept = torch.ones(len(PADS), length, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        kept[row, :pad] = False
    positions = (kept.long().cumsum(-1) - 1).masked_fill(~kept, 1)
    hidden = torch.randn(len(PADS), length, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    cos, sin = ThinkerRotaryEmbedding(config)(hidden.to(dtype), positions)
    return Sequence(hidden.to(dtype), cos, sin, kept)


# --- running both ----------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    """What ``run_steps`` found over every step."""

    slots: int = 0  # slots compared (query x key)
    mismatches: int = 0
    differing: set[tuple[int, int]] = field(default_factory=set)  # (row, query slot) of the queries that differ
    pruned: int = 0  # queries whose kept slots are fewer than their visible ones
    keys_diff: float = 0.0  # the largest |Δ| of present_index_keys against the PyTorch cache's, relative to their scale


def run_steps(session, indexer: ThinkerQSAIndexer, sequence: Sequence, steps: list[int], config) -> Comparison:
    """Runs the graph and the PyTorch indexer over consecutive steps of the given sizes, the graph fed its own
    present keys, and compares every step's choice slot for slot and the keys with the cache's."""
    cache = DynamicCache(config=config)
    batch, dim = sequence.hidden.shape[0], config.indexer_head_dim
    past_keys = np.zeros((batch, 1, 0, dim), dtype=sequence.hidden.numpy().dtype)  # the first forward: P = 0
    result, past = Comparison(), 0
    for size in steps:
        end = past + size
        visible = sequence.visible(past, end)
        cos, sin = sequence.cos[:, :end], sequence.sin[:, :end]
        with torch.no_grad():
            expected = indexer(sequence.hidden[:, past:end], (cos, sin), visible[:, None], cache)[:, 0]
        feeds = {
            "hidden": sequence.hidden[:, past:end].numpy(),
            "cos": cos.numpy(),
            "sin": sin.numpy(),
            "visible": visible.numpy(),
            "past_index_keys": past_keys,
        }
        selected, past_keys = session.run(None, feeds)
        result.slots += selected.size
        differs = selected != expected.numpy()
        result.mismatches += int(differs.sum())
        result.differing |= {(row, past + i) for row, i in zip(*differs.any(-1).nonzero(), strict=True)}
        result.pruned += int((expected.sum(-1) < visible.sum(-1)).sum())
        expected_keys = cache.layers[0].indexer_keys.numpy().astype(np.float64)
        scale = max(1.0, float(np.abs(expected_keys).max()))
        result.keys_diff = max(result.keys_diff, float(np.abs(past_keys[:, 0] - expected_keys).max()) / scale)
        past = end
    return result


# The keys are a projection, a norm and a rotation: bit for bit on some CPUs, a few units in the last place apart on
# others (onnxruntime's and PyTorch's kernels sum in different orders; an AMD EPYC here), relative to their scale.
KEYS_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("steps", [PREFILL_THEN_DECODE, list(CHUNKS)], ids=["prefill-decode", "chunked"])
def test_selection_matches_pytorch(tmp_path, steps):
    config = indexer_config()
    indexer = seeded_indexer(config)
    sequence = padded_sequence(config, sum(steps), torch.float32)
    result = run_steps(indexer_session(config, indexer, torch.float32, tmp_path), indexer, sequence, steps, config)
    assert result.pruned > 0, "the budget never pruned: the comparison would not test the choice"
    assert result.mismatches == 0, f"{result.mismatches} of {result.slots} slots chosen differently"
    assert result.keys_diff <= KEYS_TOLERANCE[torch.float32], (
        f"present_index_keys {result.keys_diff:.3g} from PyTorch's"
    )


def test_float16_graph(tmp_path):
    """The half graph runs and chooses as the half PyTorch indexer (same inputs, same seeds)."""
    config = indexer_config()
    indexer = seeded_indexer(config).half()
    sequence = padded_sequence(config, sum(PREFILL_THEN_DECODE), torch.float16)
    session = indexer_session(config, indexer, torch.float16, tmp_path)
    result = run_steps(session, indexer, sequence, PREFILL_THEN_DECODE, config)
    assert result.mismatches == 0, f"{result.mismatches} of {result.slots} slots chosen differently"
    assert result.keys_diff <= KEYS_TOLERANCE[torch.float16], (
        f"present_index_keys {result.keys_diff:.3g} from PyTorch's"
    )


def test_planted_bug_is_caught(tmp_path, monkeypatch):
    """Block keys rotated at the block's last slot instead of its first: the comparison must see it."""

    def last_slots(b, block_slots):
        return b.op("Slice", block_slots, b.const([-1]), b.const([INT64_MAX]), b.const([2]))

    monkeypatch.setattr(indexer_graph, "_emit_block_starts", last_slots)
    config = indexer_config()
    indexer = seeded_indexer(config)
    sequence = padded_sequence(config, sum(PREFILL_THEN_DECODE), torch.float32)
    session = indexer_session(config, indexer, torch.float32, tmp_path)
    assert run_steps(session, indexer, sequence, PREFILL_THEN_DECODE, config).mismatches > 0


def deciding_ties(indexer: ThinkerQSAIndexer, sequence: Sequence, end: int) -> dict[tuple[int, int], int]:
    """{(row, query): complete blocks it sees} for the queries of slots 0 .. end - 1 whose choice a tie decides:
    fewer than ``keep`` of the blocks they see whole score above zero, and more than ``keep`` blocks (the
    reference's own scores, ``reference_selection``'s steps)."""
    keep, ratio = indexer.budget // indexer.compress_ratio, indexer.compress_ratio
    visible = sequence.visible(0, end)
    hidden = sequence.hidden[:, :end]
    batch, seq = hidden.shape[:2]
    ties = {}
    with torch.no_grad():
        q, keys = indexer.index_qk_proj(hidden).split([indexer.num_heads * indexer.head_dim, indexer.head_dim], -1)
        q = indexer.q_layernorm(q.view(batch, seq, indexer.num_heads, -1))
        q = rotate(q, sequence.cos[:, :end, None], sequence.sin[:, :end, None]).float()
        for row in range(batch):
            for i in range(end):
                slots = visible[row, i].nonzero().flatten()
                complete = len(slots) // ratio
                if complete <= keep:
                    continue
                blocks = slots[: complete * ratio].view(complete, ratio)
                pooled = keys[row, blocks].float().mean(1).to(keys.dtype)
                starts = blocks[:, 0]
                block_keys = rotate(indexer.k_layernorm(pooled), sequence.cos[row, starts], sequence.sin[row, starts])
                scores = torch.relu(q[row, i] @ block_keys.float().T).sum(0)
                if (scores > 0).sum() < keep:
                    ties[row, i] = complete
    return ties


def test_inputs_have_no_deciding_tie():
    """The inputs above have ties that decide only among three blocks, where torch.topk keeps the lower index as the
    graph does (its insertion sort is stable), and some such, so that agreement is tested too."""
    config = indexer_config()
    indexer = seeded_indexer(config)
    for length in (sum(PREFILL_THEN_DECODE), sum(CHUNKS)):
        ties = deciding_ties(indexer, padded_sequence(config, length, torch.float32), length)
        assert ties and set(ties.values()) == {3}, ties


def test_ties_are_the_only_difference(tmp_path):
    """Where a tie among four or more blocks decides, torch.topk may keep other blocks than the graph's lower
    indices: with TIED_SEED the choices differ at such a query, and at no other."""
    config = indexer_config()
    indexer = seeded_indexer(config)
    sequence = padded_sequence(config, sum(PREFILL_THEN_DECODE), torch.float32, seed=TIED_SEED)
    session = indexer_session(config, indexer, torch.float32, tmp_path)
    result = run_steps(session, indexer, sequence, PREFILL_THEN_DECODE, config)
    ties = deciding_ties(indexer, sequence, sequence.hidden.shape[1])
    assert result.differing, "no difference: TIED_SEED no longer shows the tie"
    assert result.differing <= {query for query, blocks in ties.items() if blocks > 3}, (result.differing, ties)
    # with the Thinker's ties to the earlier blocks (what the export's checks compare against), none differs
    with lowest_block_wins_ties():
        assert not run_steps(session, indexer, sequence, PREFILL_THEN_DECODE, config).differing


class HigherIndexOnTies(GraphBuilder):
    """A builder whose TopK keeps the higher index among equal values, as a provider may: ONNX leaves the choice
    open, onnxruntime's CPU keeps the lower index and its CUDA provider did not (an H200,
    bench/results/gpu-tests-h200-session7.xml). Its TopK runs over the reversed axis, the indices mapped back."""

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        if op_type != "TopK" or not attrs.get("largest", 1):
            return super().op(op_type, *inputs, outputs=outputs, **attrs)
        values, k = inputs
        last = super().op("Sub", super().op("Shape", values, start=-1), super().const([1]))
        ends, back = super().const([-INT64_MAX - 1]), super().const([-1])
        flipped = super().op("Slice", values, back, ends, back, back)
        top, index = super().op("TopK", flipped, k, outputs=2, **attrs)
        return top, super().op("Sub", last, index)


def test_the_choice_rests_on_no_tie_topk_breaks(tmp_path):
    """Blocks scoring 0 tie (TIED_SEED has queries whose choice such a tie decides, among four blocks): a TopK that
    keeps the higher index among equal values chooses as the CPU's, the lower-index rule the Thinker's checks take
    (``lowest_block_wins_ties``), so the graph's choice is the same on every provider."""
    config = indexer_config()
    indexer = seeded_indexer(config)
    sequence = padded_sequence(config, sum(PREFILL_THEN_DECODE), torch.float32, seed=TIED_SEED)
    session = indexer_session(config, indexer, torch.float32, tmp_path, builder=HigherIndexOnTies)
    with lowest_block_wins_ties():
        result = run_steps(session, indexer, sequence, PREFILL_THEN_DECODE, config)
    assert result.pruned > 0
    assert not result.differing, result.differing
