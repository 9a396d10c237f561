"""What a parity check reports, in either mode (``converter/parity.py`` whole-model, ``converter/layer_parity.py``
layer by layer): the figures per dtype and per stage, the verdict, the table printed and ``parity.json``; and the
guard both modes' reference loading shares.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from thinker_common.errors import ThinkerError
from thinker_common.staging import write_atomically

IDENTICAL = "every tensor bit for bit what converting the source writes"

PARITY_FILE = "parity.json"
# `thinker verify`'s failing report, written beside a folder's parity.json rather than over it (below)
FAILED_PARITY_FILE = "parity.failed.json"
GREEDY_TOKENS = 8
# Layer by layer each decode step reads both models from disk again (the whole-model check holds them in memory and
# runs GREEDY_TOKENS), so it runs two: the first reads back the cache and recurrent state the prompts wrote, the
# second what a decode step wrote.
LAYER_DECODE_STEPS = 2
HALF_TOP1_MIN = 0.9  # half precision: share of positions whose argmax must agree
WHOLE_MODEL, BY_LAYER = "whole-model", "layer-by-layer"
# Where the prompts' logits agree and a decode step's do not: a token the prompts do not hold, fed back in a decode
# step, meets a part of the model they do not reach (the probes of converter/unreached.py find the known ones by
# name), or the decode path itself differs (a cache or a recurrent state carried wrong). Either mode.
GREEDY_ONLY = (
    "the decode steps (the prompts' logits agree; a decode step on a generated token differs: a part the prompts "
    "do not reach, or the cache)"
)


class ParityFailed(ThinkerError):
    """Raised when the converted model does not match its reference; carries the report to print."""

    def __init__(self, message: str, report: ParityReport) -> None:
        super().__init__(message)
        self.report = report


# What to do where transformers gives no reference for a source: convert it unchecked.
NO_VERIFY = "convert with --no-verify"


class NoReference(ThinkerError):
    """Raised where there is no reference to check a conversion against; its words end in what to do, NO_VERIFY,
    which ``thinker verify`` of a folder already so converted says otherwise (``instead``)."""

    def instead(self, advice: str) -> ThinkerError:
        """The same words, with ``advice`` in place of NO_VERIFY."""
        return ThinkerError(str(self).replace(NO_VERIFY, advice))


def reference_unloadable(label: object, reason: str) -> NoReference:
    """transformers cannot load the reference of ``label`` (a source), for ``reason``: said alike by the whole
    model's load and the layer check's."""
    return NoReference(
        f"{label}: the reference model does not load with transformers ({reason}), so there is no reference to "
        f"verify against; {NO_VERIFY}"
    )


def reference_of_other_shapes(
    label: object, built_class: str, name: str, stored: tuple, built: tuple, more: str = ""
) -> NoReference:
    """transformers builds ``built_class`` from ``label`` with tensors of other shapes than it holds (``name``, the
    first, as stored and as built; ``more``: how many more): said alike by both checks."""
    return NoReference(
        f"{label}: transformers builds {built_class} from it with tensors of other shapes than it holds "
        f"({name}: {stored} in the checkpoint, {built} in transformers' model{more}), so there is no reference to "
        f"verify against; {NO_VERIFY}"
    )


def reference_missing_weights(label: object, built_class: str, missing: list[str]) -> NoReference:
    """transformers builds ``built_class`` from ``label`` and finds ``missing`` (sorted) nowhere in it: that class
    is not the checkpoint's (config.json's model_type names another model than its weights), so no reference."""
    more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
    return NoReference(
        f"{label}: transformers builds {built_class} from it, and the checkpoint lacks weights that class needs "
        f"({', '.join(missing[:2])}{more}), so there is no reference to verify against; check that config.json's "
        f"model_type names the model of these weights, or {NO_VERIFY}"
    )


# The stages that compare positions beyond the prompts' (converter/unreached.py ``position_stages``).
POSITION_ROWS = "every position-embedding row"
CONTEXT_STAGE = "the context (max_position_embeddings)"
ROTARY_STAGE = "the rotary tables across the context"
# A vision-language model's DeepStack: how many first decoder layers take the vision tower's features (text prompts
# take none, so only the count is compared: converter/unreached.py ``deepstack_stage``).
DEEPSTACK_STAGE = "the DeepStack layers (deepstack_layers)"


@dataclass
class LayerParity:
    """One stage of the layer-by-layer check: the converted model's stage run on the reference's input to it."""

    name: str  # "embeddings", "layer 3", "final norm and head"
    max_abs_diff: float
    mean_abs_diff: float
    scale: float  # max |output| of the reference's stage
    tolerance: float
    passed: bool
    stream_max_abs_diff: float | None = None  # each model on its own hidden states: the difference accumulated


@dataclass
class DtypeParity:
    dtype: str
    max_abs_diff: float
    mean_abs_diff: float
    logit_scale: float
    tolerance: float
    top1_agreement: float
    greedy_identical: int | None  # prompts whose whole continuation agrees (None: not run, layer by layer)
    greedy_prompts: int | None
    greedy_token_agreement: float | None
    passed: bool
    first_divergence: str | None = None
    # the decode steps' logits, held to the same relative tolerance as the prompts', of the larger of the two scales:
    # whole-model at each row's greedy steps before the two continuations part (both models fed the same tokens);
    # layer by layer at LAYER_DECODE_STEPS steps, both models fed the reference's greedy token
    decode_max_abs_diff: float | None = None
    decode_tolerance: float | None = None
    decode_steps: int | None = None  # how many (row, step) logits that compares
    layers: list[LayerParity] = field(default_factory=list)  # layer by layer only
    # what the prompts cannot reach, compared on inputs of its own: the embedding table, every expert
    # (converter/unreached.py)
    unreached: list[LayerParity] = field(default_factory=list)


@dataclass
class ParityReport:
    reference: str
    converted: str
    prompts: list[list[int]]
    results: list[DtypeParity] = field(default_factory=list)
    mode: str = WHOLE_MODEL
    mode_note: str = ""  # why this mode, when it was not asked for
    # ``thinker verify``'s exact check (converter/weights_check.py): IDENTICAL, or the first tensor and row that
    # differ from what converting the source writes; None where it did not run (a conversion writes them itself)
    weights: str | None = None
    # the bos/eos/pad ids that differ from the reference's, ``key (reference -> converted)``
    # (converter/special_tokens.py): no logit shows them
    special_tokens: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            all(result.passed for result in self.results)
            and self.weights in (None, IDENTICAL)
            and not self.special_tokens
        )

    @property
    def rounding_note(self) -> str:
        """For a half-precision conversion: what its rows compare, which is not what the rounding costs."""
        half = next((result.dtype for result in self.results if result.dtype != "float32"), None)
        if half is None:
            return ""
        return (
            f"Both models hold the weights as the folder stores them, in {half} (or wider, where it stores a tensor "
            "wider): the float32 row proves the mapping, "
            f"the {half} row the model run in {half}; where the source's weights were wider, neither measures what "
            f"rounding them to {half} costs."
        )

    def to_json(self) -> str:
        data = asdict(self)
        data["passed"] = self.passed
        if self.rounding_note:
            data["rounding_note"] = self.rounding_note
        data["greedy_tokens"] = GREEDY_TOKENS if self.mode == WHOLE_MODEL else None  # layer by layer: none run
        return json.dumps(data, indent=2) + "\n"

    def table(self) -> str:
        columns = ("dtype", "max|Δlogit|", "mean|Δlogit|", "tolerance", "top-1", "greedy")
        header = "{:<9} {:>11} {:>12} {:>9} {:>6} {:>7}  result".format(*columns)
        rows = [f"parity ({self.mode}): {self.converted} vs {self.reference}", header]
        for r in self.results:
            verdict = "pass" if r.passed else f"FAIL (first divergence: {r.first_divergence})"
            greedy = "—" if r.greedy_identical is None else f"{r.greedy_identical}/{r.greedy_prompts}"
            rows.append(
                f"{r.dtype:<9} {r.max_abs_diff:>11.3g} {r.mean_abs_diff:>12.3g} {r.tolerance:>9.2g} "
                f"{r.top1_agreement:>6.1%} {greedy:^7}  {verdict}"
            )
        for r in self.results:
            if r.decode_steps is not None:
                took = (
                    f"the {r.decode_steps} steps both models took on the same tokens (of {r.greedy_prompts} × "
                    f"{GREEDY_TOKENS - 1})"
                    if r.greedy_prompts is not None
                    else f"{r.decode_steps // LAYER_DECODE_STEPS} rows × {LAYER_DECODE_STEPS} steps after the prompts, "
                    "both models fed the reference's greedy token"
                )
                rows.append(
                    f"{r.dtype}: decode steps: max|Δlogit| {r.decode_max_abs_diff:.3g} (tolerance "
                    f"{r.decode_tolerance:.2g}) over {took}"
                )
        for r in self.results:
            if r.layers:
                # a NaN difference ranks first (max() never picks a NaN key after a number)
                worst = max(r.layers, key=lambda layer: _ranked(layer.max_abs_diff / layer.tolerance))
                where = (
                    "every stage identical (max|Δ| 0)"
                    if worst.max_abs_diff == 0
                    else f"largest max|Δ| against its tolerance at {worst.name}: {worst.max_abs_diff:.3g} "
                    f"(tolerance {worst.tolerance:.2g})"
                )
                rows.append(f"{r.dtype}: {len(r.layers)} stages compared on the reference's inputs; {where}")
        for r in self.results:
            if r.unreached:
                failing = [stage.name for stage in r.unreached if not stage.passed]
                verdict = f"FAIL at {', '.join(failing[:3])}" if failing else "pass"
                names = {stage.name for stage in r.unreached}
                parts = ["every embedding row"] + [POSITION_ROWS] * (POSITION_ROWS in names)
                for what, suffix in (
                    ("the experts", ": every expert"),
                    ("the routers", ": every router row"),
                    ("the n-gram tables", ": every n-gram row"),
                    ("the indexers", ": the indexer's choice"),
                ):
                    count = sum(stage.name.endswith(suffix) for stage in r.unreached)
                    parts += [f"{what} of {count} layers"] if count else []
                parts += [what for name, what in POSITIONS_SAID if name in names]
                reached = ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]
                rows.append(f"{r.dtype}: {reached}, beyond the prompts' reach, on inputs of their own: {verdict}")
        if self.weights is not None:
            rows.append(f"weights: {self.weights}")
        if self.special_tokens:
            rows.append(f"special tokens: FAIL, not the reference's: {', '.join(self.special_tokens)}")
        if self.rounding_note:
            rows.append(self.rounding_note)
        return "\n".join(rows)


POSITIONS_SAID = (
    (CONTEXT_STAGE, "the context"),
    (ROTARY_STAGE, "the rotary tables across it"),
    (DEEPSTACK_STAGE, "the DeepStack layers"),
)


def write_report(report: ParityReport, path: Path) -> None:
    """Written beside and renamed over: `thinker verify` updates a finished folder, which a kill must not damage."""
    write_atomically(Path(path), report.to_json())


def refuse_unknown_model_type(config_path: Path) -> None:
    """The reference is transformers' own class for the config's model_type; for a type it does not know, it would
    look for code in the folder (auto_map), which is never run here."""
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # transformers reports an unreadable config itself
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise NoReference(
            f"{config_path}: model_type {model_type!r} is not one transformers knows, so --verify has no reference "
            "to compare with (code shipped with a checkpoint, its auto_map, is never run); correct model_type, or "
            f"{NO_VERIFY}"
        )


def refuse_short_context(context: int | None) -> None:
    """The gate's prompts cut to one id still need GREEDY_TOKENS positions with their greedy tokens: a model whose
    context holds fewer (a toy GPT-2's ``n_positions``) is refused by name, where its class failed past its table."""
    if context is not None and context < GREEDY_TOKENS:
        raise NoReference(
            f"a context of {context} positions (max_position_embeddings) cannot hold the parity check's prompt and its "
            f"{GREEDY_TOKENS} greedy tokens, so there is nothing to verify it on; {NO_VERIFY}"
        )


def reference_fails(reference: str, err: Exception) -> NoReference:
    """The error for transformers' own class failing on the parity prompts, which may happen on a config it accepts
    but cannot run (a scaled RoPE sized by a partial factor it does not apply): it is the reference's, not the
    conversion's, and said so, not a traceback from inside transformers."""
    reason = " ".join(str(err).split())[:300]
    return NoReference(
        f"transformers' {reference} fails on the parity prompts ({type(err).__name__}: {reason}), so there is no "
        f"reference to verify against: its class cannot run this config; {NO_VERIFY} if the model is meant as it is"
    )


def reference_overflows(reference: str, dtype: Any, stage: str) -> ThinkerError:
    """The error for a reference that computes inf or NaN from ``stage`` on: no difference to measure, and nothing
    the conversion did (the converted model computes the same)."""
    name = str(dtype).removeprefix("torch.")
    advice = (
        "convert with --dtype bfloat16 or float32"
        if name != "float32"
        else "the checkpoint's weights are broken: get it again"
    )
    return ThinkerError(
        f"transformers' own {reference} computes inf or NaN in {name} on the parity prompts (from {stage} on), so "
        f"there is no reference to compare with: the model overflows {name}; {advice}"
    )


def _ranked(ratio: float) -> float:
    """A stage's difference over its tolerance for ranking, a NaN (a stage gone NaN) above every number."""
    return math.inf if math.isnan(ratio) else ratio
