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

In float the scaled model computes the same function, to float32 rounding, which is checked on the first calibration
sequence before anything is written (``EQUIVALENCE_TOLERANCE``: a scale folded into the wrong place fails there). A
group whose input comes from anything else keeps s = 1, plain RTN: Gated DeltaNet layers, routed experts, an
ungated MLP, hyper-connections, per-layer embeddings, an attention with an indexer, a norm with grouped channels.
The head keeps s = 1 too (a tied head would need the embedding divided back).

Calibration needs no dataset: the float model writes its own text, seeded sampling from ``CALIBRATION_PROMPTS``
(seeded token ids where the folder has no tokenizer), and one forward pass over it records each group's input. Per
group the alpha of ``ALPHAS`` whose scales give the least squared error of the group's outputs, over ``SEARCH_ROWS``
of those inputs with the weights rounded as onnxruntime's RTN rounds them (export/rounding.py, at the export's bits
and block), is kept; alpha 0 is plain RTN, so no group ends with more error on those rows than without. The model
must fit in memory whole, in float32; where it does not, the export quantizes with plain RTN and says so.

On the real SmolLM2-135M (README, "Quantized exports") this lifts top-1 agreement with the float model over the two
benchmark texts from 69.6 % to 80.6 % at int4 and from 95.4 % to 96.9 % at int8, and halves the mean KL divergence
at both, with the same bytes and speed.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE
from thinker_common.progress import progress_bar
from thinker_common.side_files import has_vocabulary, tokenizer_files
from thinker_common.sources import SafetensorsSource
from thinker_common.values import value_problem

from .rounding import rtn_dequantized

# Short starts in a few registers (prose, a date, code, a story); the model writes the rest.
CALIBRATION_PROMPTS = ("The", "In 1887,", "def main():", "Once upon a time")
CALIBRATION_NEW_TOKENS = 128  # per prompt: 512 tokens written, about 516 calibration rows per group
CALIBRATION_SEED = 0
# alpha from 0 (plain RTN) to 1, and the calibration rows each group's error is measured over (a seeded sample): on
# SmolLM2 at int4, AWQ's own grid of 21 over 512 rows took twice the time for the same fidelity (mean KL 0.150 /
# 0.137 on the two benchmark texts, against 0.148 / 0.132, in one-off exports while choosing).
ALPHAS = tuple(step / 10 for step in range(11))
SEARCH_ROWS = 256
SHARD_BYTES = 5 * 2**30  # the staged copy is read back by the export alone: any shard size does
MAGNITUDE_RANGE = 1e4  # the widest ratio of two channels' mean input magnitudes the scales follow
# The float32 model, its logits on the calibration text and every group's recorded inputs, against its weights' bytes.
MEMORY_FACTOR = 1.5
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
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep: torch.Tensor | None = None
    seen: int = 0
    magnitude_sum: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)

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
    """What ``scale_for_rounding`` did: the folder written and the figures export_report.json records."""

    folder: Path
    report: dict


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
                groups.append(ScaleGroup(f"{prefix}.self_attn.q_proj|k_proj|v_proj", [q, k, v], fold))
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            head_dim = o.in_features // heads
            if v.out_features == kv_heads * head_dim:
                shape = (kv_heads, heads // kv_heads, head_dim)

                def shared(s: torch.Tensor, shape: tuple[int, int, int] = shape) -> torch.Tensor:
                    """One s per key-value channel (the mean over the query heads that read it), repeated."""
                    return s.reshape(shape).mean(1, keepdim=True).expand(shape).reshape(-1)

                def fold(s: torch.Tensor, v: nn.Linear = v, shape: tuple[int, int, int] = shape) -> None:
                    divide_rows(v, s.reshape(shape)[:, 0].reshape(-1))

                groups.append(ScaleGroup(f"{prefix}.self_attn.o_proj", [o], fold, shared))
        mlp = layer.mlp
        if isinstance(mlp, ThinkerMLP) and mlp.gated:
            if foldable_norm(layer.post_attention_layernorm):
                fold = partial(divide_norm, layer.post_attention_layernorm)
                groups.append(ScaleGroup(f"{prefix}.mlp.gate_proj|up_proj", [mlp.gate_proj, mlp.up_proj], fold))
            groups.append(ScaleGroup(f"{prefix}.mlp.down_proj", [mlp.down_proj], partial(divide_rows, mlp.up_proj)))
    return groups


def calibration_ids(model: nn.Module, model_dir: Path, progress: bool = False) -> list[torch.Tensor]:
    """Text the float ``model`` writes itself (``progress``: a bar over its steps): seeded sampling of
    ``CALIBRATION_NEW_TOKENS`` (fewer where the context is shorter) after each of
    ``CALIBRATION_PROMPTS`` (or, without a tokenizer, after seeded token ids), each a 1-D tensor of ids."""
    config = model.config
    if has_vocabulary(tokenizer_files(model_dir)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        starts = [torch.tensor(tokenizer(prompt)["input_ids"]) for prompt in CALIBRATION_PROMPTS]
    else:
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        starts = [torch.randint(config.vocab_size, (2,), generator=generator) for _ in CALIBRATION_PROMPTS]
    eos = config.eos_token_id if config.eos_token_id is not None else []
    width = max(len(start) for start in starts)
    new_tokens = max(1, min(CALIBRATION_NEW_TOKENS, config.max_position_embeddings - width))  # within the context
    sampling = GenerationConfig(
        do_sample=True,
        temperature=0.9,
        top_p=0.95,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # an end-of-text token would cut the calibration short
        eos_token_id=eos,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
    )
    # One batch, left-padded (generate's layout for a decoder), sampled in ``new_tokens`` steps.
    batch = torch.full((len(starts), width), sampling.pad_token_id)
    mask = torch.zeros((len(starts), width), dtype=torch.long)
    for row, start in enumerate(starts):
        batch[row, width - len(start) :], mask[row, width - len(start) :] = start, 1
    with (
        torch.random.fork_rng(devices=[]),  # the caller's random state is left as it was
        progress_bar(new_tokens, "calibrating on the model's own text", unit="token", enabled=progress) as bar,
    ):
        torch.manual_seed(CALIBRATION_SEED)
        steps = LogitsProcessorList([CountSteps(bar)])
        written = model.generate(batch, attention_mask=mask, generation_config=sampling, logits_processor=steps)
    return [row[width - len(start) :] for row, start in zip(written, starts, strict=True)]


class CountSteps(LogitsProcessor):
    """Moves a progress bar by one each generation step, the scores untouched."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.bar.update()
        return scores


def best_scale(group: ScaleGroup, bits: int, block_size: int) -> tuple[torch.Tensor, float, float, float]:
    """The group's scales (in, float64), its alpha, and the squared output error over the search rows with them and
    with plain RTN (alpha 0). The inputs are not rounded as accuracy level 4 rounds them: searched so, SmolLM2's
    int4 and int8 exports came out no closer to the float model (one-off exports while choosing: mean KL 0.149 /
    0.131 and 0.002 / 0.002 on the two benchmark texts, as without)."""
    inputs = torch.cat(group.rows)
    magnitude = group.magnitude_sum / group.seen
    # A channel that is (nearly) always 0 would, centred below, push every other scale up by orders of magnitude:
    # the scales span at most MAGNITUDE_RANGE ** alpha (AutoAWQ clamps them too).
    magnitude = magnitude.clamp_min(float(magnitude.max()) / MAGNITUDE_RANGE).clamp_min(1e-30)
    weights = [projection.weight.detach() for projection in group.projections]  # float32, as the search's products
    exact = [inputs @ weight.T for weight in weights]
    best = (math.inf, torch.ones_like(magnitude), 0.0)  # where no alpha gives a finite error: plain RTN
    plain = math.inf
    for alpha in ALPHAS:
        s = magnitude**alpha
        if group.shared is not None:
            s = group.shared(s)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1 in log scale: neither the weights nor the inputs drift
        scales = s.float()
        divided = inputs / scales
        error = sum(
            float(((divided @ rounded(weight * scales, bits, block_size).T - reference).double() ** 2).sum())
            for weight, reference in zip(weights, exact, strict=True)
        )
        if alpha == 0:
            plain = error
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2], best[0], plain


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
) -> ScaledModel | None:
    """Writes ``model_dir``'s Thinker, its groups scaled for rounding at ``bits`` in blocks of ``block_size``, to
    ``output`` (a Thinker folder: float32 weights, every other file of ``model_dir`` copied); returns it with its
    figures, or None where no group of the model folds (nothing to scale). A weight the scales take beyond what
    ``graph_dtype`` holds is refused here, by name, rather than blamed on the folder's own weights later."""
    from thinker import ThinkerForCausalLM

    started = time.perf_counter()
    # transformers' default attention (sdpa): the scaled model is checked against itself, not against a reference
    model = ThinkerForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refuse_values(model, model_dir, torch.float32, "the folder is corrupt")  # before calibration samples from it
    groups = scale_groups(model)
    if not groups:
        return None
    with torch.no_grad():
        ids = calibration_ids(model, model_dir, progress)
        rows = sum(len(sequence) for sequence in ids)
        if rows > SEARCH_ROWS:  # a seeded sample of the rows, the same for every group
            generator = torch.Generator().manual_seed(CALIBRATION_SEED)
            keep = torch.randperm(rows, generator=generator)[:SEARCH_ROWS].sort().values
            for group in groups:
                group.keep = keep
        hooks = [
            group.projections[0].register_forward_pre_hook(lambda module, args, group=group: group.record(args[0]))
            for group in groups
        ]
        try:
            # Every sequence feeds the search; the first one's logits are kept for the check below (a fold is per
            # channel and linear, so one sequence shows a wrong one, and the others' logits would cost memory).
            reference = model(ids[0][None]).logits[0]
            for sequence in ids[1:]:
                model.model(sequence[None])  # the decoder alone: the head has no group
        finally:
            for hook in hooks:
                hook.remove()
        alphas, gains = [], []
        with progress_bar(len(groups), "activation-aware scales", unit="group", enabled=progress) as bar:
            for group in groups:
                s, alpha, error, plain = best_scale(group, bits, block_size)
                group.fold(s)
                for projection in group.projections:
                    projection.weight.copy_(projection.weight.double() * s)
                group.release()
                alphas.append(alpha)
                gains.append(error / plain if plain > 0 else 1.0)
                bar.update()
        after = model(ids[0][None]).logits[0]
        difference, scale = float((after - reference).abs().max()), float(reference.abs().max())
        del after, reference
    limit = EQUIVALENCE_TOLERANCE * max(1.0, scale)
    if not difference <= limit:
        raise ThinkerError(
            f"the activation-aware scales changed the float model's logits by {difference:.3g} (limit {limit:.3g}) "
            "on its calibration text: a scale was folded where it does not cancel; export with --no-awq, and "
            "report this model's config"
        )
    if graph_dtype == torch.float16:
        refuse_values(model, None, graph_dtype, "export with --no-awq")
    output.mkdir(parents=True)
    write_scaled(model, model_dir, output)
    written = {path.name for path in output.iterdir()}
    for path in sorted(model_dir.iterdir()):  # the tokenizer, generation config, card, license, code
        if path.is_file() and path.name not in written and not is_weights_file(path.name):
            shutil.copyfile(path, output / path.name)
    tokens = sum(len(sequence) for sequence in ids)
    report = {
        "groups": len(groups),
        "calibration_tokens": tokens,
        "alpha_median": sorted(alphas)[len(alphas) // 2],
        "error_vs_rtn_median": round(sorted(gains)[len(gains) // 2], 4),  # squared output error against alpha 0
        "logit_difference": difference,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return ScaledModel(output, report)


def write_scaled(model: nn.Module, model_dir: Path, output: Path) -> None:
    """The scaled model as a Thinker folder: config.json, and in float32 the tensors ``model_dir`` stores, under
    their names, written one at a time (converter/shards.py: ``save_pretrained`` would hold every tensor's bytes
    at once, the model's size again at the export's peak)."""
    from converter.shards import ShardLayout, ShardWriter

    source = SafetensorsSource(model_dir)
    try:
        names = source.names()
    finally:
        source.close()
    held = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    tensors = {name: held[name].detach() for name in names}
    layout = ShardLayout([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], SHARD_BYTES)
    with ShardWriter(output, layout) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.close()
    model.config.save_pretrained(output)


def refuse_values(model: nn.Module, model_dir: Path | None, dtype: torch.dtype, advice: str) -> None:
    """Raises, naming the tensor (and its file in ``model_dir``; None: as scaled), where a parameter holds NaN or
    Inf, or values ``dtype`` cannot hold."""
    for name, parameter in model.named_parameters():
        problem = value_problem(parameter.detach(), dtype)
        if problem:
            if model_dir is None:
                values = problem.removeprefix("holds ")
                raise ThinkerError(f"the activation-aware scales take tensor {name!r} to {values}; {advice}")
            source = SafetensorsSource(model_dir)
            try:
                stored = source.file_of(name) if name in source.names() else model_dir
            finally:
                source.close()
            raise ThinkerError(f"{stored}: tensor {name!r} {problem}; {advice}")


def is_weights_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth"))
