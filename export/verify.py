"""``thinker export --verify``: onnxruntime against the PyTorch Thinker, step by step.

The left-padded batch of ``common/parity_inputs.py`` goes through prefill and then several single-token decode
steps in both runtimes, each fed the same (PyTorch-greedy) tokens. Logits are compared at every kept position; pads
carry no meaning in either runtime and are left out. The tolerance is relative to the logit scale, as in DESIGN.md,
and the same as the converter's parity gate (``RELATIVE_TOLERANCE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.parity_inputs import RELATIVE_TOLERANCE, parity_batch
from common.progress import progress_bar
from thinker.modeling_thinker import CACHE_ARG

from .runtime import OnnxDecoder, cuda_usable, position_ids_from_mask

DECODE_STEPS = 6


@dataclass
class Agreement:
    """Running figures over every compared position."""

    max_abs_diff: float = 0.0
    abs_diff_sum: float = 0.0
    logit_scale: float = 0.0
    positions: int = 0
    top1_equal: int = 0
    per_step: list[float] = field(default_factory=list)

    def add(self, reference: np.ndarray, candidate: np.ndarray) -> None:
        """Adds (N, V) logits of the same N positions."""
        diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
        self.max_abs_diff = max(self.max_abs_diff, float(diff.max()))
        self.abs_diff_sum += float(diff.mean(axis=-1).sum())
        self.logit_scale = max(self.logit_scale, float(np.abs(reference).max()))
        self.positions += reference.shape[0]
        self.top1_equal += int((reference.argmax(-1) == candidate.argmax(-1)).sum())
        self.per_step.append(float(diff.max()))

    def figures(self) -> dict:
        return {
            "max_abs_diff": self.max_abs_diff,
            "mean_abs_diff": self.abs_diff_sum / max(self.positions, 1),
            "logit_scale": self.logit_scale,
            "top1_agreement": self.top1_equal / max(self.positions, 1),
            "positions": self.positions,
            "max_abs_diff_per_step": self.per_step,  # prefill first, then each decode step
        }


@torch.no_grad()
def compare_decoders(
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    steps: int = DECODE_STEPS,
    on_step: Callable[[], object] | None = None,
) -> dict:
    """Prefill + ``steps`` decode steps in PyTorch and onnxruntime; figures over every kept position (of a
    ``--logits last`` graph's prefill: each row's last kept position, all it gives). ``on_step`` is called after the
    prefill and after each decode step (a progress bar's ``update``)."""
    on_step = on_step or (lambda: None)
    agreement = Agreement()
    mask = torch.from_numpy(attention_mask)
    positions = torch.from_numpy(position_ids_from_mask(attention_mask))
    out = model(input_ids=torch.from_numpy(input_ids), attention_mask=mask, position_ids=positions, use_cache=True)
    reference = out.logits.float().numpy()
    candidate, state = decoder.prefill(input_ids, attention_mask)
    if decoder.last_logits_only:
        agreement.add(at_last_kept(reference, attention_mask), candidate[:, 0])
        # Left padding puts every row's last token in the last slot; onnxruntime-genai pads on the right, where
        # only the mask tells a row's last token from its pads: the same rows padded so, prefill only.
        add_right_padded_prefill(agreement, model, decoder, input_ids, attention_mask)
    else:
        kept = attention_mask.astype(bool)
        agreement.add(reference[kept], candidate[kept])
    on_step()

    past, next_position = getattr(out, CACHE_ARG), positions[:, -1:] + 1
    token = reference[:, -1].argmax(-1)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(
            input_ids=torch.from_numpy(token[:, None]),
            attention_mask=mask,
            position_ids=next_position,
            use_cache=True,
            **{CACHE_ARG: past},
        )
        reference = out.logits[:, -1].float().numpy()
        agreement.add(reference, decoder.decode_one_token(token, state))
        past, next_position, token = getattr(out, CACHE_ARG), next_position + 1, reference.argmax(-1)
        on_step()
    return {"batch": int(input_ids.shape[0]), "decode_steps": steps, **agreement.figures()}


def add_right_padded_prefill(
    agreement: Agreement,
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
) -> None:
    """The left-padded batch's rows padded on the right instead, prefilled by both: each row's last real token's
    logits (what a ``--logits last`` graph gives) into ``agreement``."""
    ids, mask = right_padded(input_ids, attention_mask)
    positions = torch.from_numpy(position_ids_from_mask(mask))
    out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=positions)
    agreement.add(at_last_kept(out.logits.float().numpy(), mask), decoder.prefill(ids, mask)[0][:, 0])


def right_padded(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same rows with their kept slots moved to the front, in order: padded on the right instead."""
    order = np.argsort(1 - attention_mask, axis=1, kind="stable")
    return np.take_along_axis(input_ids, order, 1), np.take_along_axis(attention_mask, order, 1)


def at_last_kept(logits: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """(B, V): each row of (B, T, V) ``logits`` at its last position the mask keeps (0 for a row that keeps none),
    the position a ``--logits last`` graph picks."""
    numbered = attention_mask * np.arange(1, attention_mask.shape[1] + 1)
    return logits[np.arange(len(logits)), np.maximum(numbered.max(axis=1) - 1, 0)]


def verify_export(
    model_dir: Path,
    onnx_path: Path,
    dtype: torch.dtype,
    threads: int | None = None,
    progress: bool = False,
) -> dict:
    """The figures for the export report; ``passed`` is False beyond tolerance (``failure`` says how), None when it
    could not run. ``progress``: a bar over loading both models, the prefill and the decode steps. (A quantized
    export has its own checks: export/quantized_verify.py.)"""
    from thinker import ThinkerForCausalLM

    if dtype == torch.bfloat16 and not cuda_usable():
        return {
            "passed": None,
            "skipped": "onnxruntime's CPU execution provider has no bfloat16 kernels; verify where CUDA is available",
        }
    with progress_bar(2 + DECODE_STEPS, "verifying", unit="step", enabled=progress) as bar:
        decoder = OnnxDecoder(onnx_path, threads=threads)
        model = ThinkerForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        bar.update()
        input_ids, attention_mask = parity_batch(model.config.vocab_size)
        figures = compare_decoders(model, decoder, input_ids, attention_mask, on_step=bar.update)
    result = {
        "provider": decoder.device,
        "reference": f"PyTorch ThinkerForCausalLM, {str(dtype).removeprefix('torch.')}, CPU",
        **figures,
    }
    result["tolerance"] = RELATIVE_TOLERANCE[dtype] * max(1.0, figures["logit_scale"])
    result["passed"] = figures["max_abs_diff"] <= result["tolerance"]
    result["failure"] = f"max |Δlogit| {figures['max_abs_diff']:.3g} > tolerance {result['tolerance']:.3g}"
    if result["passed"]:
        del result["failure"]
    return result
