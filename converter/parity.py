"""The parity gate: the converted Thinker against the source family's own transformers class, on fixed prompts.

Both models see the same token ids: the left-padded batch of ``thinker_common/parity_inputs.py`` ``gate_prompts``
(the fixed short prompts and the long ones, explicit position ids, compared only at real tokens) for the logits, then
8 greedy tokens decoded from that batch, each model with its own KV cache.
Figures per dtype: max and mean |Δlogit|, the logit scale, top-1 agreement, greedy agreement, the tolerance and the
verdict.

Two modes, the same figures: the whole models side by side (``whole-model``), when both and their activations on the
prompts fit the memory budget (``whole_model_bytes``), or
one layer at a time (``layer-by-layer``, ``converter/layer_parity.py``), which needs the memory of one layer
whatever the model's size and adds each layer's max and mean |Δ| to the report. ``parity_mode`` picks; the budget
is half the memory available, or ``THINKER_VERIFY_MEMORY`` (a size such as ``8GB``) when set.

The float32 run always happens and is strict: max |Δlogit| <= 1e-4 × max(1, logit scale) and identical greedy
continuations, and each decode step's logits held alike while both continuations have taken the same tokens (a
cache or a recurrent state carried wrong need not flip a token). The reference is loaded in the converted folder's
dtype and then widened, so that both sides hold the same rounded weights and a bfloat16 conversion is still held to
float32 exactness. A half-precision conversion is also run in its own dtype, both models alike, against that dtype's
``GATE_TOLERANCE`` and 90 % top-1 agreement. On failure, the first hidden state (output of
``embeddings`` or ``layer i``) that diverges beyond the same relative tolerance is named.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.eager import EAGER
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import GATE_TOLERANCE, gate_prompts, left_padded
from thinker_common.sizes import human_size, parse_size
from thinker_common.sources import open_source

from .layer_parity import refuse_other_weights_file, refuse_unloadable, said_of
from .parity_report import (
    BY_LAYER,
    GREEDY_ONLY,
    GREEDY_TOKENS,
    HALF_TOP1_MIN,
    IDENTICAL,
    WHOLE_MODEL,
    DtypeParity,
    ParityFailed,
    ParityReport,
    reference_missing_weights,
    reference_of_other_shapes,
    reference_overflows,
    reference_unloadable,
    refuse_short_context,
    refuse_unknown_model_type,
    write_report,
)
from .spec import Family
from .special_tokens import source_named_ids, special_id_differences
from .streamed import without_router_loss
from .unreached import unreached_stages

# The whole-model check runs when both models in float32 (8 bytes per parameter) and the prompts' logits and hidden
# states (``whole_model_bytes``) fit in the memory budget: this
# share of the memory currently available, unless the environment variable sets the budget.
VERIFY_MEMORY_SHARE = 0.5
MEMORY_BUDGET_ENV = "THINKER_VERIFY_MEMORY"


# --- loading -----------------------------------------------------------------------------------------------------


def load_reference(source: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The source family's own transformers class, from the source folder (or a weights file in it) as given."""
    source = Path(source)
    refuse_other_weights_file(source)
    if source.is_file():
        source = source.parent
    refuse_unknown_model_type(source / "config.json")
    return reference_from_pretrained(source, source, dtype=dtype)


def reference_from_pretrained(label: Path, folder: Path, **kwargs: Any) -> PreTrainedModel:
    """transformers' own class for the family from ``folder`` (``kwargs`` to ``from_pretrained``), never code shipped
    with the checkpoint (a config's auto_map); ``label`` names the source in errors.

    Loaded with ``ignore_mismatched_sizes`` and the loading info, so that tensors of other shapes than transformers
    builds for the config are named here: otherwise transformers logs them in a report (silenced on the command
    line) and raises "look at the above report!" with no report to look at.
    """
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            **EAGER,
            trust_remote_code=False,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
            **kwargs,
        )
    except Exception as err:  # transformers raises many types for a folder it cannot load; all are the folder's
        if "gguf_file" not in kwargs:  # a folder's weights: the reason by name, where it is their names
            refuse_unloadable(Path(folder), label)
            # or a file cut short or damaged since the converter read it: named by the converter's own reader
            open_source(Path(folder)).close()
        raise reference_unloadable(label, str(err)) from None
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, stored, built = mismatched[0]
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        raise reference_of_other_shapes(label, type(model).__name__, name, tuple(stored), tuple(built), more)
    # Weights transformers' class needs and the checkpoint lacks are drawn at random, and the comparison then blamed
    # the conversion ("first divergence: layer 0") for a reference that is not the checkpoint (helper-248: a
    # model_type naming another family than the weights)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise reference_missing_weights(label, type(model).__name__, missing)
    return model.eval()


def load_converted(folder: Path, dtype: torch.dtype | None = None) -> ThinkerForCausalLM:
    try:
        model = ThinkerForCausalLM.from_pretrained(folder, dtype=dtype or "auto", **EAGER)
    except Exception as err:  # as for the reference: whatever the folder's files make transformers raise
        raise ThinkerError(f"{folder}: the converted model does not load ({err})") from None
    return model.eval()


# --- comparison --------------------------------------------------------------------------------------------------


class Run(NamedTuple):
    """What ``run_prompts`` gives: the real positions' logits, (real tokens, vocab) in float32, the batch's hidden
    states, each row's greedy tokens, and the logits of each decode step, (B, steps - 1, vocab) in float32: step j's
    after feeding each row's token j."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    tokens: list[list[int]]
    step_logits: torch.Tensor


@torch.no_grad()
def run_prompts(model: PreTrainedModel, prompts: list[list[int]], steps: int = GREEDY_TOKENS) -> Run:
    """The left-padded batch through ``model`` (its hidden states kept), then ``steps`` greedy tokens per prompt.

    Decoding goes on from the same batch with the model's own KV cache, one token per step for every row; a model
    that returns no cache recomputes the whole sequence each step. Only the real positions' logits are kept: the
    whole batch's, at a 152k vocabulary, are 0.3 GB a copy (``whole_model_bytes`` counts what is left).
    """
    ids, mask, positions = left_padded(prompts)
    output = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, use_cache=True
    )
    logits, hidden_states, cache = output.logits[mask.bool()].float(), output.hidden_states, getattr(output, CACHE_ARG)
    tokens, step_logits = [output.logits[:, -1].argmax(-1)], []  # (B,) per step
    del output  # the whole batch's logits
    while len(tokens) < steps:
        step = tokens[-1][:, None]  # (B, 1)
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        if cache is not None:
            positions = positions[:, -1:] + 1
            output = model(
                input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_ARG: cache}
            )
        else:
            ids, positions = torch.cat([ids, step], dim=1), torch.cat([positions, positions[:, -1:] + 1], dim=1)
            output = model(input_ids=ids, attention_mask=mask, position_ids=positions)
        cache = getattr(output, CACHE_ARG)
        step_logits.append(output.logits[:, -1].float())
        tokens.append(step_logits[-1].argmax(-1))
    stacked = torch.stack(step_logits, dim=1) if step_logits else torch.zeros(len(prompts), 0, 0)
    return Run(logits, hidden_states, torch.stack(tokens, dim=1).tolist(), stacked)


def decode_steps_alike(expected: Run, actual: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The two runs' decode-step logits, (compared steps, vocab), at each row's steps up to where the greedy
    continuations part: there both models were fed the same tokens, so the logits must agree as the prompts' do
    (a cache or a recurrent state carried wrong shows only there; a greedy token need not flip for it)."""
    same = (torch.tensor(expected.tokens) == torch.tensor(actual.tokens)).int().cumprod(dim=1).bool()
    alike = same[:, : expected.step_logits.shape[1]]  # step j follows tokens 0..j
    return expected.step_logits[alike], actual.step_logits[alike]


def reference_run(reference: PreTrainedModel, prompts: list[list[int]]) -> Run:
    """``run_prompts`` on transformers' own model, which may fail on a config its class accepts but cannot run (a
    scaled RoPE sized by a partial factor it does not apply): said so, not a traceback from inside transformers."""
    with said_of(type(reference).__name__):
        return run_prompts(reference, prompts)


@torch.no_grad()
def compare(reference: PreTrainedModel, converted: PreTrainedModel, prompts: list[list[int]]) -> DtypeParity:
    """Run both models (which must hold the same dtype) on the prompts and measure how far apart they are."""
    dtype = converted.dtype
    theirs, ours = reference_run(reference, prompts), run_prompts(converted, prompts)
    ref_tokens, tokens = theirs.tokens, ours.tokens
    real = left_padded(prompts)[1].bool()
    ref_logits, logits = theirs.logits, ours.logits  # (real tokens, vocab)
    if not torch.isfinite(ref_logits).all():
        raise reference_overflows(type(reference).__name__, dtype, first_nonfinite(theirs.hidden_states, real))
    ref_steps, steps = decode_steps_alike(theirs, ours)
    if not torch.isfinite(ref_steps).all():
        raise reference_overflows(type(reference).__name__, dtype, "a decode step")
    diff, step_diff = (ref_logits - logits).abs_(), (ref_steps - steps).abs_()  # in place: 0.15 GB at 152k
    scale = ref_logits.abs().max().item()  # the prompts', as layer by layer
    tolerance = GATE_TOLERANCE[dtype] * max(1.0, scale)
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    decode_max = step_diff.max().item() if step_diff.numel() else 0.0
    decode_scale = ref_steps.abs().max().item() if ref_steps.numel() else 0.0
    decode_tolerance = GATE_TOLERANCE[dtype] * max(1.0, scale, decode_scale)
    decode_agrees = decode_max <= decode_tolerance  # NaN (a non-finite step of the converted model's) does not

    identical = sum(ref == conv for ref, conv in zip(ref_tokens, tokens, strict=True))
    token_agreement = sum(
        a == b for ref, conv in zip(ref_tokens, tokens, strict=True) for a, b in zip(ref, conv, strict=True)
    ) / (len(prompts) * GREEDY_TOKENS)

    max_diff = diff.max().item()
    if dtype == torch.float32:
        passed = max_diff <= tolerance and decode_agrees and identical == len(prompts)
    else:
        passed = max_diff <= tolerance and decode_agrees and top1 >= HALF_TOP1_MIN
    result = DtypeParity(
        dtype=str(dtype).removeprefix("torch."),
        max_abs_diff=max_diff,
        mean_abs_diff=diff.mean().item(),
        logit_scale=scale,
        tolerance=tolerance,
        top1_agreement=top1,
        greedy_identical=identical,
        greedy_prompts=len(prompts),
        greedy_token_agreement=token_agreement,
        passed=passed,
        decode_max_abs_diff=decode_max,
        decode_tolerance=decode_tolerance,
        decode_steps=len(steps),
    )
    result.unreached = unreached_stages(reference, converted, dtype)
    unreached = next((stage.name for stage in result.unreached if not stage.passed), None)
    if not passed and max_diff <= tolerance:  # the prompts' logits agree: say what does not
        if not decode_agrees:
            result.first_divergence = unreached or GREEDY_ONLY
        elif dtype == torch.float32 and identical < len(prompts):
            result.first_divergence = unreached or NEAR_TIE
        else:
            result.first_divergence = TOP1_BELOW.format(top1=top1, floor=HALF_TOP1_MIN)
    elif not passed:
        result.first_divergence = first_divergence(
            theirs.hidden_states, ours.hidden_states, real, dtype, converted.model.final_hidden_state
        )
        if result.first_divergence == f"layer {len(theirs.hidden_states) - 2}":
            result.first_divergence = last_layer_or_final_norm(reference, converted, prompts, real, dtype)
    elif unreached is not None:  # the prompts' logits agree; a row or an expert they never reach does not
        result.passed, result.first_divergence = False, unreached
    return result


# Where every logit compared agrees and a greedy token still parts: two near-equal logits taken the other way.
NEAR_TIE = (
    "a greedy continuation (every logit compared lies within the tolerance, but a token parts: a near tie taken the "
    "other way, float32 needing the same tokens)"
)
# Half precision: the logits within the tolerance, the top-1 tokens apart at too many positions.
TOP1_BELOW = (
    "top-1 agreement ({top1:.1%} of the prompts' positions, below {floor:.0%}; the logits within the tolerance)"
)


def first_nonfinite(hidden_states: tuple[torch.Tensor, ...], real: torch.Tensor) -> str:
    """The first hidden state (embeddings, then each layer's output) holding inf or NaN, else the head."""
    for index, hidden in enumerate(hidden_states):
        if not torch.isfinite(hidden[real]).all():
            return "the embeddings" if index == 0 else f"layer {index - 1}'s output"
    return "the head"


def states_agree(ref: torch.Tensor, conv: torch.Tensor, dtype: torch.dtype) -> bool:
    """Two hidden states (float32, the real positions) within the dtype's tolerance, relative to the reference's
    scale."""
    return (ref - conv).abs().max().item() <= GATE_TOLERANCE[dtype] * max(1.0, ref.abs().max().item())


def first_divergence(
    expected: tuple[torch.Tensor, ...],
    actual: tuple[torch.Tensor, ...],
    real: torch.Tensor,
    dtype: torch.dtype,
    final_norm: Callable[[torch.Tensor], torch.Tensor],
) -> str:
    """The first hidden state (embeddings, then each layer's output) that differs beyond tolerance.

    The last layer's output is compared both as is and after the converted model's ``final_norm`` (its final norm, or
    the hyper-connections' last mix): transformers' classes report it normalised (GPT-2, and in transformers 5
    Qwen and Llama too), a class of its own may not. When every hidden state agrees, the difference lies in the
    final norm or the head; where the last disagrees, ``last_layer_or_final_norm`` tells which.
    """
    if len(expected) != len(actual):
        return f"hidden-state count ({len(expected)} reference, {len(actual)} converted): the layer counts differ"

    def agree(ref: torch.Tensor, conv: torch.Tensor) -> bool:
        return states_agree(ref[real].float(), conv[real].float(), dtype)

    for index, (ref, conv) in enumerate(zip(expected[:-1], actual[:-1], strict=True)):
        if not agree(ref, conv):
            return "embeddings" if index == 0 else f"layer {index - 1}"
    last = len(expected) - 2
    if not (agree(expected[-1], actual[-1]) or agree(expected[-1], final_norm(actual[-1]))):
        return f"layer {last}"
    return "the final norm or the head (every layer's output agrees)"


@torch.no_grad()
def last_layer_or_final_norm(
    reference: PreTrainedModel, converted: PreTrainedModel, prompts: list[list[int]], real: torch.Tensor, dtype
) -> str:
    """Where ``first_divergence`` found the last hidden state apart: the last layer, or the final norm after it.
    transformers reports the last hidden state with the final norm applied (Qwen, Llama), so a wrong final norm
    looked like a wrong last layer (a QA run); the last decoder layer's own output, taken by a hook on each side,
    tells the two apart."""
    from .unreached import decoder_layers

    ids, mask, positions = left_padded(prompts)
    layers = [decoder_layers(model) for model in (reference, converted)]
    last = len(layers[1]) - 1
    if not all(layers) or len(layers[0]) != len(layers[1]):
        return f"layer {last}"
    outputs: list[torch.Tensor] = []
    for model, stack in zip((reference, converted), layers, strict=True):
        hook = stack[max(stack)].register_forward_hook(
            lambda _module, _inputs, out: outputs.append((out[0] if isinstance(out, tuple) else out)[real].float())
        )
        try:
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
        finally:
            hook.remove()
    ref, conv = outputs[0], outputs[-1]
    if ref.shape == conv.shape and states_agree(ref, conv, dtype):
        return "the final norm or the head (every layer's output agrees)"
    return f"layer {last}"


def check_parity(
    source: Path,
    converted: Path,
    family: Family | None = None,
    mode: str = WHOLE_MODEL,
    dtype: torch.dtype | None = None,
) -> ParityReport:
    """Compare ``converted`` with the reference loaded from ``source``: float32, plus the converted dtype if half.

    The reference is the family's own loader when it declares one (a sub-model of a multimodal checkpoint), else
    ``AutoModelForCausalLM``; a family without any transformers class cannot be verified here. ``mode``:
    ``WHOLE_MODEL``, or ``BY_LAYER`` (``converter/layer_parity.py``). ``dtype``: the one both sides are loaded in
    (their weights rounded to it alike), the converted folder's unless given; the way back gives the dtype it wrote,
    where ``converted`` is the float32 Thinker it was written from.
    """
    if family is not None and family.no_reference:
        raise ThinkerError(f"cannot verify a {family.name} conversion: {family.no_reference}")
    if mode == BY_LAYER:
        from .layer_parity import check_parity_by_layer

        return check_parity_by_layer(Path(source), Path(converted), family, dtype)
    model = load_converted(converted, dtype)
    dtype = model.dtype
    loader = family.reference if family is not None and family.reference is not None else load_reference
    reference = loader(Path(source), dtype)
    without_router_loss(reference)
    without_router_loss(model)
    refuse_short_context(model.config.max_position_embeddings)
    prompts = gate_prompts(model.config.vocab_size, model.config.max_position_embeddings, GREEDY_TOKENS)
    report = ParityReport(
        reference=type(reference).__name__,
        converted=type(model).__name__,
        prompts=prompts,
        special_tokens=special_id_differences(
            getattr(reference, "config", None), model.config, source_named_ids(source)
        ),
    )
    if dtype != torch.float32:
        report.results.append(compare(reference, model, prompts))
    # Widened in place: the same rounded weights on both sides, compared in float32. ``.to`` rather than ``.float``,
    # which transformers refuses for models loaded from GGUF (marked quantized although dequantized on load).
    report.results.insert(0, compare(reference.to(torch.float32), model.to(torch.float32), prompts))
    return report


def parity_gate(
    reference: Path,
    converted: Path,
    family: Family | None,
    report_path: Path,
    failure: str,
    mode: str = WHOLE_MODEL,
    mode_note: str = "",
    dtype: torch.dtype | None = None,
    failed_path: Path | None = None,
    weights: str | None = None,
) -> ParityReport:
    """``check_parity``, its report written to ``report_path`` (a failing one to ``failed_path``, where given);
    ``ParityFailed(failure)`` when it fails. ``weights``: the exact check's verdict (``thinker verify``), recorded in
    the report and failing it unless IDENTICAL."""
    report = check_parity(reference, converted, family, mode, dtype)
    report.mode_note = mode_note
    report.weights = weights
    write_report(report, report_path if report.passed or failed_path is None else failed_path)
    if not report.passed:
        where = next((r.first_divergence for r in report.results if not r.passed and r.first_divergence), None)
        detail = f"; first divergence: {where}" if where else ""
        if weights not in (None, IDENTICAL):
            detail += f"; {weights}"
        if report.special_tokens:
            detail += f"; special token ids not the reference's: {', '.join(report.special_tokens)}"
        raise ParityFailed(failure + detail, report)
    return report


def memory_budget(share: float = VERIFY_MEMORY_SHARE) -> int:
    """Bytes a check may use: ``THINKER_VERIFY_MEMORY`` when set, else ``share`` of the available memory."""
    configured = os.environ.get(MEMORY_BUDGET_ENV)
    if configured:
        try:
            return parse_size(configured.strip())
        except ThinkerError as err:  # parse_size's reason, the variable named
            raise ThinkerError(f"{MEMORY_BUDGET_ENV}={configured!r}: {err}") from None
    import psutil  # a dependency of accelerate, which transformers' loading uses

    return int(share * psutil.virtual_memory().available)


def refuse_bad_memory_setting() -> None:
    """``THINKER_VERIFY_MEMORY`` read before any work, whichever mode the check takes: a check asked for layer by
    layer never read it, so a mistyped value passed unseen (a QA run)."""
    if os.environ.get(MEMORY_BUDGET_ENV):
        memory_budget()


def whole_model_bytes(num_parameters: int, config: ThinkerConfig, reference_only: int = 0) -> int:
    """What the whole-model check holds at its peak: both models in float32, each one's hidden states over the gate's
    batch, and the logits. Those are the batch's whole (B, T, vocab) block while the model's forward returns it, next
    to both models' real positions: measured at 2.1 blocks (a 152k vocabulary, 0.34 GB a block, is 0.7 GB above
    the weights); three are counted, for room. ``num_parameters``: the decoder's; ``reference_only``: the source's
    parameters beside it (a vision-language or omni source's encoders, which its reference class also builds, once
    in float32; a talker or a multi-token-prediction block it does not build is counted all the same, erring on the
    layer check's side)."""
    prompts = gate_prompts(config.vocab_size, config.max_position_embeddings, GREEDY_TOKENS)
    slots = len(prompts) * max(map(len, prompts))
    hidden_states = 2 * (config.num_hidden_layers + 1) * slots * config.hidden_size * 4
    return 8 * num_parameters + 4 * reference_only + hidden_states + 3 * slots * config.vocab_size * 4


def parity_mode(
    num_parameters: int, config: ThinkerConfig, budget: int | None = None, reference_only: int = 0
) -> tuple[str, str]:
    """(mode, note): whole-model when its check (``whole_model_bytes``, both models in float32 and the prompts'
    activations) fits the budget (default ``memory_budget()``), else layer by layer, with a note saying why."""
    needed = whole_model_bytes(num_parameters, config, reference_only)
    if budget is not None:
        source = "as given"
    elif os.environ.get(MEMORY_BUDGET_ENV):
        source = f"{MEMORY_BUDGET_ENV}"
    else:
        source = f"{VERIFY_MEMORY_SHARE:.0%} of the memory available"
    budget = memory_budget() if budget is None else budget
    if needed <= budget:
        return WHOLE_MODEL, ""
    return BY_LAYER, (
        f"verifying layer by layer: the whole-model check (the reference and converted models in float32, and the "
        f"prompts' logits and hidden states) needs ~{human_size(needed)}, more than the {human_size(budget)} budget "
        f"({source})"
    )
