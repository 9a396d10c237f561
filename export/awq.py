"""Activation-aware scales before round-to-nearest (AWQ, Lin et al. 2023): ``thinker export --quantize`` by default
in float32 graphs, ``--awq`` / ``--no-awq`` to choose.

Round-to-nearest spends a block's few levels evenly on its input channels, while a few channels of a projection's
input are far larger than the rest and carry most of its output. AWQ multiplies each input channel of the weight by
s (the channel's mean input magnitude to a power alpha) before rounding and divides the input by s, so the channels
that matter most are rounded more finely. The division costs nothing at run time: it is folded into whatever makes
that input, so the exported graph has the same ops and bytes as plain RTN:

  group                    its projections            s folded into
  the attention's input    q_proj, k_proj, v_proj     input_layernorm's weight
  the attention's output   o_proj                     v_proj's rows (one s per key-value channel: the query heads
                                                      that share a key-value head share its values)
  the MLP's input          gate_proj, up_proj         post_attention_layernorm's weight
  the MLP's product        down_proj                  up_proj's rows (act(gate) * up is linear in up)

In float the scaled model computes the same function, to float32 rounding, which is checked on the calibration
text (the logits at ``CHECKED_POSITIONS`` of its positions) before the export reads the scaled weights
(``EQUIVALENCE_TOLERANCE``: a scale folded into the wrong place fails there). A group whose input comes from
anything else keeps s = 1, plain RTN: Gated DeltaNet layers, routed experts, an ungated MLP, hyper-connections,
per-layer embeddings, an attention with an indexer, a norm with grouped channels.
The head keeps s = 1 too (a tied head would need the embedding divided back).

Calibration needs no dataset: export/calibration_text.py's passages, through the model's own tokenizer (seeded token
ids where the folder has none), run through the model once, a part at a time (``Scaling``, over
converter/streamed.py): the memory held is the largest part's (a decoder layer, the embeddings or the head) in
float32, at any model size. Each group records its input; per group the alpha of ``ALPHAS`` whose scales give the
least squared error of the group's outputs, over ``SEARCH_ROWS`` of those inputs with the weights rounded as
onnxruntime's RTN rounds them (export/rounding.py, at the export's bits and block), is kept (searched coarse to
fine, ``best_scale``, the products in bfloat16 where the CPU has them, ``search_dtype``); alpha 0 is plain RTN, so no
group ends with more error on those rows than without.

On the real SmolLM2-135M (README, "Quantized exports") this lifts top-1 agreement with the float model over the two
benchmark texts, and lowers the mean KL divergence at int4 and int8, with the same bytes and speed.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from converter.layer_parity import THINKER_FINAL_NORMS, THINKER_HEAD, load_layered_converted
from converter.streamed import trim_freed_memory
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE
from thinker_common.progress import progress_bar
from thinker_common.side_files import has_vocabulary, tokenizer_files
from thinker_common.sources import SafetensorsSource
from thinker_common.values import value_problem

from .calibration_text import CALIBRATION_SOURCE, CALIBRATION_TEXT
from .rounding import rtn_dequantized

if TYPE_CHECKING:
    from thinker.configuration_thinker import ThinkerConfig


def search_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX: on this project's machine the search's
    products 2.5-3x faster than in float32), float32 elsewhere, where oneDNN emulates bfloat16 products, slower than
    float32's (2.2x on AVX-512 without BF16, a review measured; oneDNN's own ``_is_mkldnn_bf16_supported`` says yes
    there, so the CPU's flags are asked). On SmolLM2 bfloat16 moved a group's error by up to 1.2e-3, more than the
    smallest gap between two alphas (1.4e-4), yet every one of its 240 groups at int4 and int8 kept the alpha float32
    and float64 keep (the error is mostly common to the alphas); a near tie may still fall the other way on another
    machine, as float32's order of summation can make it, at a cost of that group's error within 0.1 %."""
    flags = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so asked with a fallback
    try:
        native = any(getattr(torch.cpu, flag)() for flag in flags)
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else torch.float32


CALIBRATION_SEED = 0  # the search rows' sample, and the ids of a folder without a tokenizer
UNTOKENIZED_TOKENS = 512
# alpha from 0 (plain RTN) to 1, and the calibration rows each group's error is measured over (a seeded sample): on
# SmolLM2 at int4, AWQ's own grid of 21 over 512 rows took twice the time for the same fidelity (mean KL 0.150 /
# 0.137 on the two benchmark texts, against 0.148 / 0.132, in one-off exports while choosing).
ALPHAS = tuple(step / 10 for step in range(11))
SEARCH_ROWS = 256
SEARCH_DTYPE = search_dtype()
SHARD_BYTES = 2**31  # the staged copy is read back by the export alone: files any file system takes (FAT32: 4 GiB)
MAGNITUDE_RANGE = 1e4  # the widest ratio of two channels' mean input magnitudes the scales follow
# What the weights held at once (held_bytes) take beside them: a layer's activations over the calibration, its
# groups' recorded rows, the search's rounded copies.
MEMORY_FACTOR = 1.5
# The positions whose logits the equivalence check compares, a seeded sample of the calibration's (the first of the
# search rows' draw): a fold that does not cancel moves every position's logits, and the head over all ~600 of them,
# in both models, took 0.8 s of SmolLM2's scales.
CHECKED_POSITIONS = 64
LOGIT_ROWS = 64  # positions of the logits compared at a time
EQUIVALENCE_TOLERANCE = RELATIVE_TOLERANCE[torch.float32]  # x max(1, max |logit|): the float32 export's own bar
# The attention's children whose inputs are what AWQ scales: anything else reading the attention's input (an
# indexer) would be left reading the divided input, so such layers keep s = 1.
PLAIN_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})


@dataclass
class ScaleGroup:
    """Projections that read one input, the producer ``fold`` divides by s, and ``shared`` (None, or a map that
    makes s equal where channels must share one). ``record`` takes the input as calibration runs: its mean
    magnitude per channel over every row, and the rows ``keep`` names (their indices over the whole calibration, in
    order; None: every row) for the search, so that memory holds the search's rows only."""

    name: str
    projections: list[nn.Linear]
    fold: Callable[[torch.Tensor], None]
    layer: int = 0  # the decoder layer it belongs to
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep: torch.Tensor | None = None
    seen: int = 0
    magnitude_sum: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)
    weights: tuple[str, ...] = ()  # the projections' weights, as the Thinker folder names them (scale_groups)

    def record(self, inputs: torch.Tensor) -> None:
        inputs = inputs.reshape(-1, inputs.shape[-1]).float()
        total = inputs.abs().sum(0, dtype=torch.float64)
        self.magnitude_sum = total if self.magnitude_sum is None else self.magnitude_sum + total
        if self.keep is None:
            self.rows.append(inputs.clone())
        else:
            here = self.keep[(self.keep >= self.seen) & (self.keep < self.seen + len(inputs))] - self.seen
            self.rows.append(inputs[here].clone())
        self.seen += len(inputs)

    def release(self) -> None:
        self.magnitude_sum, self.rows = None, []


@dataclass
class ScaledModel:
    """What ``scale_for_rounding`` did: the folder written, the figures export_report.json records, and the
    weights whose scales were searched for rounding in blocks of its ``coarse_block_size`` (``coarse``)."""

    folder: Path
    report: dict
    coarse: frozenset[str] = frozenset()


def foldable_norm(norm: nn.Module) -> bool:
    from thinker.modeling_thinker import ThinkerRMSNorm

    return isinstance(norm, ThinkerRMSNorm) and norm.group_size is None


def divide_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """The norm's output divided by ``s``: its weight, or ``1 + weight`` for a zero-centred one."""
    if norm.zero_centered:
        norm.weight.copy_((1.0 + norm.weight.double()) / s - 1.0)
    else:
        norm.weight.copy_(norm.weight.double() / s)


def divide_rows(linear: nn.Linear, s: torch.Tensor) -> None:
    """The projection's output channels divided by ``s``: its weight's rows and its bias."""
    linear.weight.copy_(linear.weight.double() / s[:, None])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias.double() / s)


def scale_groups(model: nn.Module) -> list[ScaleGroup]:
    """The groups of ``model`` (a ThinkerForCausalLM) whose scales fold away exactly (the module docstring's table)."""
    from thinker.modeling_thinker import ThinkerMLP

    config = model.config
    groups = []
    for index, layer in enumerate(model.model.layers):
        if getattr(layer, "hyper_connections", False) or hasattr(layer, "ple"):
            continue
        prefix = f"model.layers.{index}"
        attention = getattr(layer, "self_attn", None)
        if attention is not None and {name for name, _ in attention.named_children()} <= PLAIN_ATTENTION:
            q, k, v, o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
            if foldable_norm(layer.input_layernorm):
                fold = partial(divide_norm, layer.input_layernorm)
                groups.append(ScaleGroup(f"{prefix}.self_attn.q_proj|k_proj|v_proj", [q, k, v], fold, index))
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            head_dim = o.in_features // heads
            if v.out_features == kv_heads * head_dim:
                shape = (kv_heads, heads // kv_heads, head_dim)

                def shared(s: torch.Tensor, shape: tuple[int, int, int] = shape) -> torch.Tensor:
                    """One s per key-value channel (the mean over the query heads that read it), repeated."""
                    return s.reshape(shape).mean(1, keepdim=True).expand(shape).reshape(-1)

                def fold(s: torch.Tensor, v: nn.Linear = v, shape: tuple[int, int, int] = shape) -> None:
                    divide_rows(v, s.reshape(shape)[:, 0].reshape(-1))

                groups.append(ScaleGroup(f"{prefix}.self_attn.o_proj", [o], fold, index, shared))
        mlp = layer.mlp
        if isinstance(mlp, ThinkerMLP) and mlp.gated:
            if foldable_norm(layer.post_attention_layernorm):
                fold = partial(divide_norm, layer.post_attention_layernorm)
                groups.append(ScaleGroup(f"{prefix}.mlp.gate_proj|up_proj", [mlp.gate_proj, mlp.up_proj], fold, index))
            down = ScaleGroup(f"{prefix}.mlp.down_proj", [mlp.down_proj], partial(divide_rows, mlp.up_proj), index)
            groups.append(down)
    module_names = {id(module): name for name, module in model.named_modules()}
    for group in groups:
        group.weights = tuple(f"{module_names[id(p)]}.weight" for p in group.projections)
    return groups


def reads_whole_blocks(group: ScaleGroup, block: int) -> bool:
    """Whether every projection of ``group`` reads whole blocks of ``block``: none narrower than it, which the
    quantizer would leave float, and none padded. Such a group is scaled and rounded in blocks of a coarse block."""
    return all(projection.in_features % block == 0 for projection in group.projections)


def coarse_weights(config: ThinkerConfig, coarse_block_size: int) -> frozenset[str]:
    """The weights ``scale_for_rounding`` scales for rounding in blocks of ``coarse_block_size`` (its
    ``ScaledModel.coarse``) where it runs, from the model's structure alone: the Thinker of ``config`` built on the
    meta device (no memory, no weights read), its groups as ``scale_groups`` finds them. The export's memory plan,
    made before the scales, counts the graph's size with them (export/exporter.py ``planned_layout``)."""
    from thinker.modeling_thinker import ThinkerForCausalLM

    with torch.device("meta"):
        model = ThinkerForCausalLM(copy.deepcopy(config))  # a model's init sets fields of its config
    groups = scale_groups(model)
    return frozenset(name for group in groups if reads_whole_blocks(group, coarse_block_size) for name in group.weights)


def calibration_ids(model_dir: Path, config) -> tuple[torch.Tensor, str]:
    """The calibration's token ids, (windows, T), and where they come from: CALIBRATION_TEXT through the folder's
    tokenizer, or seeded ids where it has none that fits the model; one row, or where the text is longer than the
    model's context, as many whole windows of the context as it fills (a model of short context still calibrates on
    the whole text)."""
    ids = None
    if has_vocabulary(tokenizer_files(model_dir)):
        from transformers import AutoTokenizer

        ids = torch.tensor(AutoTokenizer.from_pretrained(model_dir)(CALIBRATION_TEXT)["input_ids"])
        source = CALIBRATION_SOURCE
    if ids is None or not len(ids) or int(ids.max()) >= config.vocab_size:
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        ids = torch.randint(config.vocab_size, (UNTOKENIZED_TOKENS,), generator=generator)
        source = "seeded token ids (the folder has no tokenizer that fits the model)"
    width = min(len(ids), config.max_position_embeddings)
    return ids[: len(ids) // width * width].reshape(-1, width), source


def best_scale(group: ScaleGroup, bits: int, block_size: int) -> tuple[torch.Tensor, float, float, float]:
    """The group's scales (in, float64), its alpha, and the squared output error over the search rows with them and
    with plain RTN (alpha 0). The inputs are not rounded as accuracy level 4 rounds them: searched so, SmolLM2's
    int4 and int8 exports came out no closer to the float model (one-off exports while choosing: mean KL 0.149 /
    0.131 and 0.002 / 0.002 on the two benchmark texts, as without).

    Coarse to fine: every other alpha of ``ALPHAS``, then the two beside the best of those; 7 or 8 alphas measured
    of 11, the search's time cut by a third. On SmolLM2 the error is not always unimodal in alpha (32 of its 240
    groups at int4 and int8), but this kept the best alpha of the whole grid in 239 of them; the other (int8,
    layer 23's o_proj) ended with 1.6 % more error in that group than the grid's best."""
    inputs = torch.cat(group.rows)
    magnitude = group.magnitude_sum / group.seen
    # A channel that is (nearly) always 0 would, centred below, push every other scale up by orders of magnitude:
    # the scales span at most MAGNITUDE_RANGE ** alpha (AutoAWQ clamps them too).
    magnitude = magnitude.clamp_min(float(magnitude.max()) / MAGNITUDE_RANGE).clamp_min(1e-30)
    weights = [projection.weight.detach() for projection in group.projections]  # float32, as onnxruntime rounds

    def scales_of(alpha: float) -> torch.Tensor:
        s = magnitude**alpha
        if group.shared is not None:
            s = group.shared(s)
        return s / (s.max() * s.min()).sqrt()  # centred on 1 in log scale: neither the weights nor the inputs drift

    def error_of(alpha: float) -> float:
        # (x / s) Q(W s)^T - x W^T is (x / s) (Q(W s) - W s)^T: the rounding's own error through the inputs, one
        # product, in SEARCH_DTYPE, without the exact outputs beside it
        scales = scales_of(alpha).float()
        divided, error = (inputs / scales).to(SEARCH_DTYPE), 0.0
        for weight in weights:
            scaled = weight * scales
            rounding = rounded(scaled, bits, block_size).sub_(scaled)
            outputs = (divided @ rounding.to(SEARCH_DTYPE).T).float()
            error += float(outputs.square_().sum(dtype=torch.float64))
        return error

    def least(errors: dict[int, float]) -> int:
        """The alpha (its index) of least finite error, the smaller on a tie; plain RTN where none is finite."""
        finite = [index for index, error in errors.items() if math.isfinite(error)]
        return min(finite, key=lambda index: (errors[index], index), default=0)

    errors = {index: error_of(ALPHAS[index]) for index in range(0, len(ALPHAS), 2)}
    coarse = least(errors)
    for index in (coarse - 1, coarse + 1):
        if 0 <= index < len(ALPHAS):
            errors[index] = error_of(ALPHAS[index])
    best = least(errors)
    return scales_of(ALPHAS[best]), ALPHAS[best], errors[best], errors[0]


def rounded(weight: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """(out, in) ``weight`` after onnxruntime's symmetric RTN along its input axis, back in its shape."""
    blocks = rtn_dequantized(weight, bits, block_size)
    return blocks.reshape(weight.shape[0], -1)[:, : weight.shape[1]]


def scale_for_rounding(
    model_dir: Path,
    output: Path,
    bits: int,
    block_size: int,
    progress: bool = False,
    graph_dtype: torch.dtype = torch.float32,
    coarse_block_size: int | None = None,
) -> ScaledModel | None:
    """Writes ``model_dir``'s Thinker, its groups scaled for rounding at ``bits`` in blocks of ``block_size``, to
    ``output`` (a Thinker folder: float32 weights, every other file of ``model_dir`` copied); returns it with its
    figures, or None where no group of the model folds (nothing to scale). ``coarse_block_size``: the groups whose
    inputs are whole blocks of it are scaled for rounding in those blocks instead (``ScaledModel.coarse`` names their
    weights; export/quantize.py ``SCALED_INT4_BLOCK_SIZE`` says why). A weight the scales take beyond what
    ``graph_dtype`` holds is refused here, by name, rather than blamed on the folder's own weights later; so is a
    fold that changes the model's function, and ``output`` is then removed."""
    started = time.perf_counter()
    # sdpa, transformers' default: the scaled model is compared with the float one, not with a reference, and over
    # the calibration's ~600 positions eager attention took 40 % of the forward passes
    streamed = load_layered_converted(model_dir, torch.float32, attention="sdpa")
    try:
        blocks = (block_size, coarse_block_size)
        done = write_scaled_copy(streamed, model_dir, output, bits, blocks, progress, graph_dtype)
    finally:
        streamed.close()
    if done is None:
        return None
    report, coarse = done
    return ScaledModel(output, report | {"seconds": round(time.perf_counter() - started, 1)}, coarse)


def write_scaled_copy(
    streamed,
    model_dir: Path,
    output: Path,
    bits: int,
    blocks: tuple[int, int | None],
    progress: bool,
    graph_dtype: torch.dtype,
) -> tuple[dict, frozenset[str]] | None:
    """``scale_for_rounding``'s work on ``streamed``, ``model_dir`` read a unit at a time: the figures and the
    weights scaled for the coarse block (``blocks``: the block size and the coarse one, or None), or None."""
    from converter.shards import ShardLayout, ShardWriter

    groups = scale_groups(streamed.model)
    if not groups:
        return None
    ids, calibration = calibration_ids(model_dir, streamed.model.config)
    if ids.numel() > SEARCH_ROWS:  # the same rows for every group
        keep = seeded_rows(ids.numel(), SEARCH_ROWS)
        for group in groups:
            group.keep = keep
    source = SafetensorsSource(model_dir)  # the staged copy's plan, and the files refusals name
    output.mkdir(parents=True)
    try:
        planned = [(name, source.shape(name), staged_dtype(source.dtype(name))) for name in source.names()]
        with (
            ShardWriter(output, ShardLayout(planned, SHARD_BYTES)) as writer,
            progress_bar(len(streamed.layers), "activation-aware scales", unit="layer", enabled=progress) as bar,
            torch.no_grad(),
        ):
            scaling = Scaling(streamed, source, writer, groups, bits, blocks, graph_dtype, bar)
            with scaling.recording(), streamed.streaming(scaling.observe):
                final = streamed.model.model(input_ids=ids, use_cache=False).last_hidden_state  # the decoder
                scaling.compare_logits(final, seeded_rows(ids.numel(), CHECKED_POSITIONS))
            scaling.write_unread()
            writer.close()
        limit = EQUIVALENCE_TOLERANCE * max(1.0, scaling.logit_scale)
        if not scaling.logit_difference <= limit:
            raise ThinkerError(
                f"the activation-aware scales changed the float model's logits by {scaling.logit_difference:.3g} "
                f"(limit {limit:.3g}) on its calibration text: a scale was folded where it does not cancel; "
                "export with --no-awq, and report this model's config"
            )
        for path in sorted(model_dir.iterdir()):  # config.json, the tokenizer, generation config, card, code
            if path.is_file() and not is_weights_file(path.name):
                shutil.copyfile(path, output / path.name)
    except BaseException:
        shutil.rmtree(output, ignore_errors=True)  # a half-written scaled copy is never read
        raise
    finally:
        source.close()
    figures = {
        "groups": len(groups),
        "calibration": calibration,
        "calibration_tokens": ids.numel(),
        "alpha_median": sorted(scaling.alphas)[len(scaling.alphas) // 2],
        "error_vs_rtn_median": round(sorted(scaling.gains)[len(scaling.gains) // 2], 4),  # error against alpha 0
        "logit_difference": scaling.logit_difference,
    }
    return figures, frozenset(scaling.coarse)


class Scaling:
    """The search, the folds and the staged copy, as the calibration runs through ``streamed`` (converter/streamed.py:
    a model built without weights, each unit (a decoder layer, the embeddings, the final norm, the head) read from
    the folder just before it runs and let go just after), so that the memory held is one unit's, at any size.

    Each unit's tensors are checked for NaN and Inf as they arrive (``check_values``). While a layer runs, its groups
    record their inputs; after it (``observe``), each group's scales are searched, folded and applied, the scaled
    layer runs too, on the scaled model's own hidden states (``scaled``), and the layer is written to the staged copy.
    The float model's hidden states go on to the next layer, so every group's inputs are the float model's, as the
    search needs; the scaled model's go on beside them through the final norm and the head, whose logits are compared
    with the float model's (``logit_difference``, ``logit_scale``): a fold that does not cancel shows wherever it is."""

    def __init__(
        self,
        streamed,
        source: SafetensorsSource,
        writer,
        groups: list[ScaleGroup],
        bits: int,
        blocks: tuple[int, int | None],
        graph_dtype: torch.dtype,
        bar,
    ) -> None:
        self.streamed, self.source, self.writer, self.bar = streamed, source, writer, bar
        self.bits, self.graph_dtype = bits, graph_dtype
        self.block_size, self.coarse_block_size = blocks
        self.coarse: set[str] = set()  # the weights scaled for rounding in blocks of coarse_block_size
        self.groups: dict[str, list[ScaleGroup]] = {}
        for group in groups:
            self.groups.setdefault(f"model.layers.{group.layer}", []).append(group)
        self.scaled: torch.Tensor | None = None
        self.logit_difference = self.logit_scale = 0.0
        self.alphas: list[float] = []
        self.gains: list[float] = []
        self.names = set(source.names())  # once: per tensor, source.names() builds a list of them all
        self.written: set[str] = set()
        self.listening = True
        streamed.after_load = self.check_values

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Each group records its first projection's input while the float layer runs (not the scaled one's)."""
        hooks = [
            group.projections[0].register_forward_pre_hook(partial(self.record, group))
            for groups in self.groups.values()
            for group in groups
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def record(self, group: ScaleGroup, module: nn.Module, args: tuple) -> None:
        if self.listening:
            group.record(args[0])

    def check_values(self, unit) -> None:
        """Refuses a unit's NaN or Inf, naming the tensor and its file, before anything runs on it."""
        for name in unit.tensors:
            problem = value_problem(self.streamed.get_tensor(name), torch.float32)
            if problem:
                where = self.source.file_of(name) if name in self.names else self.source.root
                raise ThinkerError(f"{where}: tensor {name!r} {problem}; the folder is corrupt")

    def observe(self, unit, args: tuple, kwargs: dict, output) -> None:
        """After ``unit`` ran in float, while its weights are loaded: scales a layer, or takes the scaled model's
        hidden states through the final norm; then writes the unit's tensors."""
        if unit.is_layer:
            self.scale_layer(unit, args, kwargs)
        elif unit.name in THINKER_FINAL_NORMS:
            final = unit.module.forward(self.scaled)  # forward: not this unit's hooks again
            self.scaled = final[0] if isinstance(final, tuple) else final  # the mixer's: (hidden, weights)
        for name in unit.tensors:
            if name in self.names:
                self.write(name, self.streamed.get_tensor(name))

    def scale_layer(self, unit, args: tuple, kwargs: dict) -> None:
        if self.scaled is None:  # the first layer's input, the embeddings: the same in both models
            self.scaled = args[0]
        too_wide = self.beyond_graph_dtype(unit.tensors)  # before the scales: the folder's own, the export's to refuse
        for group in self.groups.get(unit.name, []):
            block = self.block_of(group)
            if block != self.block_size:
                self.coarse.update(group.weights)
            s, alpha, error, plain = best_scale(group, self.bits, block)
            group.fold(s)
            for projection in group.projections:
                projection.weight.copy_(projection.weight.double() * s)
            group.release()
            self.alphas.append(alpha)
            self.gains.append(error / plain if plain > 0 else 1.0)
        for name in sorted(self.beyond_graph_dtype(unit.tensors) - too_wide):
            values = value_problem(self.streamed.get_tensor(name), self.graph_dtype).removeprefix("holds ")
            raise ThinkerError(f"the activation-aware scales take tensor {name!r} to {values}; export with --no-awq")
        self.listening = False
        try:
            self.scaled = unit.module.forward(self.scaled, *args[1:], **kwargs)  # forward: not this unit's hooks
        finally:
            self.listening = True
        trim_freed_memory()  # the layer before's weights and this one's search, freed inside the heap
        self.bar.update()

    def block_of(self, group: ScaleGroup) -> int:
        """The block ``group``'s projections are rounded in: the coarse one where it covers them
        (``reads_whole_blocks``), else the block size."""
        coarse = self.coarse_block_size
        return coarse if coarse and reads_whole_blocks(group, coarse) else self.block_size

    def compare_logits(self, final: torch.Tensor, positions: torch.Tensor) -> None:
        """The scaled model's logits against the float model's (from ``final``, its last hidden state) at
        ``positions`` (indices over every window's, in order), the head loaded as a unit of its own and the logits
        of both made a block of positions at a time: the decoder runs without its head, since the whole (windows,
        T, vocabulary) block of logits beside the head would outgrow a unit (0.37 GB for a vocabulary of 152k)."""
        (unit,) = [unit for unit in self.streamed.units if unit.name == THINKER_HEAD]
        float_states = final.reshape(-1, final.shape[-1])[positions]
        scaled_states = self.scaled.reshape(-1, self.scaled.shape[-1])[positions]
        self.streamed.load_unit(unit)
        try:
            for start in range(0, len(positions), LOGIT_ROWS):
                expected = unit.module.forward(float_states[start : start + LOGIT_ROWS])
                logits = unit.module.forward(scaled_states[start : start + LOGIT_ROWS])
                # NaN kept once seen (Python's max(0.0, nan) is 0.0): a fold that overflows must fail the check
                self.logit_difference = nan_max(self.logit_difference, float((logits - expected).abs().max()))
                self.logit_scale = nan_max(self.logit_scale, float(expected.abs().max()))
            self.observe(unit, (), {}, None)  # an untied head's weight into the staged copy
        finally:
            self.streamed.drop_unit(unit)

    def write_unread(self) -> None:
        """The folder's tensors no unit ran with (an audio projection, names the model does not have), unchanged."""
        for name in self.source.names():
            if name not in self.written:
                tensor = self.source.load(name)
                self.write(name, tensor.to(staged_dtype(tensor.dtype)))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.write(name, tensor.detach())
        self.written.add(name)

    def beyond_graph_dtype(self, names: list[str]) -> set[str]:
        """The tensors of ``names`` that hold values the graph's dtype cannot (float16's range); none in float32."""
        if self.graph_dtype != torch.float16:
            return set()
        return {name for name in names if value_problem(self.streamed.get_tensor(name), self.graph_dtype)}


def seeded_rows(total: int, count: int) -> torch.Tensor:
    """``count`` of ``total`` row indices, in order: a sample drawn with CALIBRATION_SEED (every row where
    ``total`` is at most ``count``). Two counts draw from one permutation, so the smaller sample is in the larger."""
    drawn = torch.randperm(total, generator=torch.Generator().manual_seed(CALIBRATION_SEED))[:count]
    return drawn.sort().values


def nan_max(a: float, b: float) -> float:
    """The larger of two figures, NaN where either is."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def staged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The staged copy's dtype of a tensor stored in ``dtype``: float32 for floating point (the search's and the
    export's), any other kept."""
    return torch.float32 if dtype.is_floating_point else dtype


def held_bytes(model_dir: Path) -> int:
    """The most bytes of weights the scales hold at once, in float32: the largest unit's (converter/streamed.py:
    a decoder layer, or a module outside the layers, the embeddings or an untied head), counted from the folder's
    tensor names and shapes without building the model."""
    source = SafetensorsSource(model_dir)
    try:
        units: dict[str, int] = {}
        for name in source.names():
            parts = name.split(".")
            unit = ".".join(parts[:3]) if name.startswith("model.layers.") else name.rpartition(".")[0]
            units[unit] = units.get(unit, 0) + math.prod(source.shape(name))
    finally:
        source.close()
    return 4 * max(units.values(), default=0)


def is_weights_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth"))
