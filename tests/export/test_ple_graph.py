"""Qwen3.8's PLE layer (export/ple_graph.py) exported alone and run by onnxruntime (CPU) against the PyTorch Thinker's
``ThinkerPLELayer`` driven through a real transformers cache, the way ``ThinkerModel.forward`` drives it (ids at pads
made eos, the 2-D padding mask of ``create_recurrent_attention_mask``): prefill and decode of a left-padded batch with
eos inside the rows, a first chunk shorter than the n-gram context, chunked prefill; both states carried step to
step and compared after every step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import component_session
from onnx import TensorProto
from seeded_weights import randomize_parameters
from transformers import DynamicCache
from transformers.masking_utils import create_recurrent_attention_mask

from export.graph_builder import TORCH_TO_ONNX, GraphBuilder, WeightFile, value_info
from export.ple_graph import emit_ple
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG

EOS, PAD = 1, 0
VOCAB = 40
LAYER = 1  # the second PLE layer: its tables' primes continue from the first's
FLOAT32_TOLERANCE = 1e-5  # max |Δ|, the addition and the conv state
FLOAT16_TOLERANCE = 2e-2
NAMES = ("streams", "ple_ids", "keep", "starts", "past_ngram", "past_conv")
OUTPUTS = ("addition", "present_ngram", "present_conv")


def tiny_config(**overrides) -> ThinkerConfig:
    """Qwen3.8's PLE shapes, tiny: four streams, 2- and 3-grams in two tables each, a kernel-4 conv of dilation 3
    (a 9-column window), zero-centred norms, PLE on both (linear-attention) layers."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        hc_count=4,
        hc_lowrank=4,
        ple_layer_ids=[1, 2],
        ple_embed_dim=16,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=16,
        norm_zero_centered=True,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return ThinkerConfig(**(fields | overrides))


def tiny_model(config: ThinkerConfig, dtype: torch.dtype) -> ThinkerForCausalLM:
    """Random weights, the PLE layer's all random too (its conv starts at zero, its norms at a scale of one)."""
    torch.manual_seed(0)
    model = ThinkerForCausalLM(config).eval()
    randomize_parameters(model.model.layers[LAYER].ple, seed=1)
    return model.to(dtype)


def export_ple(config: ThinkerConfig, model: ThinkerForCausalLM, dtype: torch.dtype, folder: Path):
    """``emit_ple`` alone as a model: the streams, ids, keep mask, start flag and past states in; the addition and
    the present states out."""
    weights = WeightFile(folder / "ple.onnx.data")
    b = GraphBuilder(weights)
    state = model.state_dict()

    def matmul(x: str, name: str, weight: torch.Tensor) -> str:
        return b.op("MatMul", x, b.weight(name, weight.contiguous()))

    with b.scope(f"model/layers.{LAYER}/ple"):
        out = emit_ple(b, config, LAYER, dtype, state.__getitem__, matmul, *NAMES, *OUTPUTS[1:])
    b.op_to("Identity", [out], [OUTPUTS[0]])
    model_dtype, width = TORCH_TO_ONNX[dtype], config.hc_count * config.hidden_size
    ngram, conv = ngram_state_shape(config, "batch"), conv_state_shape(config, "batch")
    inputs = [
        value_info("streams", model_dtype, ["batch", "seq", width]),
        value_info("ple_ids", TensorProto.INT64, ["batch", "seq"]),
        value_info("keep", model_dtype, ["batch", "seq", 1]),
        value_info("starts", TensorProto.BOOL, []),
        value_info("past_ngram", TensorProto.INT64, ngram),
        value_info("past_conv", model_dtype, conv),
    ]
    outputs = [
        value_info("addition", model_dtype, ["batch", "seq", width]),
        value_info("present_ngram", TensorProto.INT64, ngram),
        value_info("present_conv", model_dtype, conv),
    ]
    return component_session(b, weights, "ple", inputs, outputs, folder)


def ngram_state_shape(config: ThinkerConfig, batch):
    return [batch, config.ngram_size - 1]


def conv_state_shape(config: ThinkerConfig, batch):
    return [batch, config.hc_count * config.hidden_size, (config.ple_conv_kernel_size - 1) * config.ngram_size]


# --- the two sides, one step at a time ----------------------------------------------------------------------------
class TorchPLE:
    """``ThinkerPLELayer`` as ``ThinkerModel.forward`` calls it: the linear-attention padding mask (None for a single
    token or an unpadded mask), ids at its zeros made eos, a ``DynamicCache(config=...)`` carrying both states."""

    def __init__(self, model: ThinkerForCausalLM) -> None:
        self.config, self.ple = model.config, model.model.layers[LAYER].ple
        self.cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def step(self, streams: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kwargs = {CACHE_ARG: self.cache}
        padding = create_recurrent_attention_mask(self.config, streams, mask, **kwargs)
        if padding is not None:
            ids = torch.where(padding.bool(), ids, EOS)
        return self.ple(streams, ids, self.cache, padding)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(n-gram ids, conv window), as the graph carries them."""
        return self.cache.get_conv_state(LAYER, state_idx=2), self.cache.get_conv_state(LAYER, state_idx=1)


class OnnxPLE:
    """The exported layer with its states, zeros to start; ``starts`` is true on the first step, unless
    ``ignore_start`` (a planted bug: the zero past read as the context)."""

    def __init__(self, session, config: ThinkerConfig, batch: int, dtype: np.dtype, ignore_start: bool = False):
        self.session, self.dtype, self.first = session, dtype, not ignore_start
        self.ngram = np.zeros(ngram_state_shape(config, batch), np.int64)
        self.conv = np.zeros(conv_state_shape(config, batch), dtype)

    def step(self, streams: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        new = mask[:, -ids.shape[1] :].numpy()
        feeds = {
            "streams": streams.numpy(),
            "ple_ids": np.where(new == 1, ids.numpy(), EOS),  # as the decoder graph hands them: pads are eos
            "keep": new[..., None].astype(self.dtype),  # PaddingMasks.keep
            "starts": np.array(self.first),
            "past_ngram": self.ngram,
            "past_conv": self.conv,
        }
        self.first = False
        addition, self.ngram, self.conv = self.session.run(list(OUTPUTS), feeds)
        return addition


@dataclass(frozen=True)
class Scenario:
    lengths: tuple[int, ...]  # each row's real tokens in the prompt, left-padded to the longest
    chunks: tuple[int, ...]  # the prompt's forwards, in columns
    decode_steps: int
    eos_at: tuple[tuple[int, int], ...] = ()  # (row, column of the padded prompt) holding eos


SCENARIOS = {
    # row 1 padded by 4; an eos inside each row, one right after row 1's pads; an eos decoded in row 0 (step 2)
    "left-padded": Scenario(lengths=(10, 6), chunks=(10,), decode_steps=4, eos_at=((0, 3), (1, 5), (1, 8))),
    # one token, fewer than the n - 1 of context: the cached context is padded with eos, then a longer chunk
    "short-first-chunk": Scenario(lengths=(5, 5), chunks=(1, 4), decode_steps=4, eos_at=((1, 2),)),
    # row 1's first chunk is all padding and its second starts with two pads
    "chunked": Scenario(lengths=(11, 5), chunks=(4, 7), decode_steps=4, eos_at=((0, 5), (1, 9))),
}


def run(torch_side: TorchPLE, onnx_side: OnnxPLE, scenario: Scenario, width: int, dtype: torch.dtype) -> dict:
    """Every step of ``scenario`` on both sides: the largest |Δ| of the addition and of the conv state, and whether
    every n-gram state was equal."""
    generator = torch.Generator().manual_seed(7)
    batch, columns = len(scenario.lengths), max(scenario.lengths)
    prompt = torch.randint(2, VOCAB, (batch, columns), generator=generator)
    for row, column in scenario.eos_at:
        prompt[row, column] = EOS
    mask = torch.zeros(batch, columns, dtype=torch.int64)
    for row, length in enumerate(scenario.lengths):
        mask[row, columns - length :] = 1
    prompt = torch.where(mask.bool(), prompt, PAD)
    decoded = torch.randint(2, VOCAB, (batch, scenario.decode_steps), generator=generator)
    decoded[0, min(2, scenario.decode_steps - 1)] = EOS
    steps, start = [], 0
    for size in scenario.chunks:
        steps.append((prompt[:, start : start + size], mask[:, : start + size]))
        start += size
    for i in range(scenario.decode_steps):
        steps.append((decoded[:, i : i + 1], torch.cat([mask, torch.ones(batch, i + 1, dtype=torch.int64)], 1)))

    diffs = {"addition": 0.0, "conv state": 0.0, "ngram states equal": True}
    for ids, seen in steps:
        streams = torch.randn(batch, ids.shape[1], width, generator=generator).to(dtype)
        reference = torch_side.step(streams, ids, seen).float().numpy()
        ours = onnx_side.step(streams, ids, seen).astype(np.float32)
        ngram, conv = torch_side.states()
        diffs["addition"] = max(diffs["addition"], float(np.abs(reference - ours).max()))
        diffs["conv state"] = max(diffs["conv state"], float(np.abs(conv.float().numpy() - onnx_side.conv).max()))
        diffs["ngram states equal"] &= np.array_equal(ngram.numpy(), onnx_side.ngram)
    return diffs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(dtype, **config overrides)`` -> (config, model, session), made once per module."""
    made = {}

    def get(dtype: torch.dtype = torch.float32, **overrides):
        key = (dtype, tuple(sorted(overrides.items())))
        if key not in made:
            config = tiny_config(**overrides)
            model = tiny_model(config, dtype)
            made[key] = config, model, export_ple(config, model, dtype, tmp_path_factory.mktemp("ple"))
        return made[key]

    return get


def check(exported, scenario: Scenario, dtype: torch.dtype = torch.float32, ignore_start: bool = False, **overrides):
    config, model, session = exported(dtype, **overrides)
    numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
    onnx_side = OnnxPLE(session, config, len(scenario.lengths), numpy_dtype, ignore_start)
    return run(TorchPLE(model), onnx_side, scenario, config.hc_count * config.hidden_size, dtype)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ple_matches_the_pytorch_thinker(exported, name):
    diffs = check(exported, SCENARIOS[name])
    assert diffs["ngram states equal"], diffs
    assert max(diffs["addition"], diffs["conv state"]) <= FLOAT32_TOLERANCE, diffs


def test_ple_with_plain_norms(exported):
    """Norms that scale by w after the cast back (not zero-centred)."""
    diffs = check(exported, SCENARIOS["left-padded"], norm_zero_centered=False)
    assert diffs["ngram states equal"], diffs
    assert max(diffs["addition"], diffs["conv state"]) <= FLOAT32_TOLERANCE, diffs


def test_ple_float16(exported):
    diffs = check(exported, SCENARIOS["chunked"], dtype=torch.float16)
    assert diffs["ngram states equal"], diffs
    assert max(diffs["addition"], diffs["conv state"]) <= FLOAT16_TOLERANCE, diffs


def test_a_start_that_reads_the_zero_past_is_caught(exported):
    """Planted bug: the first forward hashing the zeros it is handed (the pad id) as its context instead of eos.
    Only the first n - 1 positions' n-grams change, and the check sees it."""
    diffs = check(exported, SCENARIOS["left-padded"], ignore_start=True)
    assert diffs["addition"] > 100 * FLOAT32_TOLERANCE, diffs
