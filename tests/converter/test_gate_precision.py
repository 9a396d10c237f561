"""What the gate holds beyond the prompts' logits: the decode steps' logits (a cache or a recurrent state carried
wrong, which need not flip a greedy token), and a half-precision run to its own tolerance (``GATE_TOLERANCE``: the
same kernels on both sides, so a sound conversion measures 0 or a few units of the dtype's last place).

Each test plants a bug in the Thinker's code (monkeypatched, the reference untouched) that passed the gate before:
the figures in the docstrings are the planted bugs' on these tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from references.hybrid import qwen3_5_config, qwen3_5_moe_config

import thinker.modeling_thinker as modeling
from converter import parity
from converter.parity import check_parity
from converter.parity_report import BY_LAYER, WHOLE_MODEL
from thinker_common.parity_inputs import GATE_TOLERANCE, RELATIVE_TOLERANCE


def state_through_bfloat16(monkeypatch) -> None:
    """The prefill's last recurrent state stored rounded to bfloat16 (a cache that narrows what it keeps): the
    prompts' logits come from the prefill itself and are exact; only the decode steps read the state."""
    chunked = modeling.torch_chunk_gated_delta_rule

    def rounded(*args, **kwargs):
        out, state = chunked(*args, **kwargs)
        return out, None if state is None else state.to(torch.bfloat16).to(state.dtype)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", rounded)


def test_a_state_carried_wrong_fails_the_decode_steps(save_reference, run_convert, monkeypatch):
    """float32: 4e-3 of the logit scale apart at the decode steps, the greedy tokens the same; it passed before."""
    _, source = save_reference(qwen3_5_config(), seed=1)
    converted = run_convert(source, verify=False).output
    sound = check_parity(source, converted).results[0]
    assert sound.passed and sound.decode_steps == 2 * (parity.GREEDY_TOKENS - 1)
    assert sound.decode_max_abs_diff <= 1e-6 * sound.logit_scale, sound  # transformers' own functions: exact

    state_through_bfloat16(monkeypatch)
    report = check_parity(source, converted)
    fp32 = report.results[0]
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.greedy_identical == fp32.greedy_prompts  # what passed
    assert fp32.decode_max_abs_diff > fp32.tolerance and not report.passed
    assert fp32.first_divergence == parity.GREEDY_ONLY
    assert "decode steps: max|Δlogit|" in report.table()


def router_softmax_in_half(monkeypatch) -> None:
    """The router's softmax in the model's dtype where Qwen's (and the Thinker's) runs in float32: nothing changes in
    a float32 run; in bfloat16 the routing weights lose their last bits."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        top_values, top_index = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        return logits, top_values, top_index

    monkeypatch.setattr(modeling.ThinkerTopKRouter, "forward", forward)


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_a_half_precision_bug_fails_the_bfloat16_run(mode, save_reference, run_convert, monkeypatch):
    """The router softmax in bfloat16 (Qwen3.5-MoE renormalises its top-k weights): the prompts' logits 2.5e-2 of
    the logit scale from the reference's (3.1e-2 layer by layer), within the export's tolerance (5e-2, an ONNX graph
    against float32 PyTorch) that the gate held them to before, and the decode steps 0.19. The float32 run cannot
    see it; a sound bfloat16 conversion measures 0. (On a tiny Qwen3-MoE the same bug moves the logits 9e-3 of their
    scale, under bfloat16's five ulps: the gate does not find every rounding bug, only those beyond a few ulps.)"""
    _, source = save_reference(qwen3_5_moe_config(), seed=2)
    converted = run_convert(source, dtype="bfloat16", verify=False).output
    sound = check_parity(source, converted, mode=mode).results[1]
    assert sound.dtype == "bfloat16" and sound.passed and sound.max_abs_diff == 0, sound

    router_softmax_in_half(monkeypatch)
    report = check_parity(source, converted, mode=mode)
    fp32, half = report.results
    assert fp32.passed
    scale = max(1.0, half.logit_scale)
    assert GATE_TOLERANCE[torch.bfloat16] * scale < half.max_abs_diff <= RELATIVE_TOLERANCE[torch.bfloat16] * scale
    assert not half.passed and not report.passed, report.table()


def test_verify_help_states_the_gates_own_tolerances():
    """``thinker verify --help`` writes the half-precision bounds out (its module does not import torch, for a fast
    --help): they are the table's."""
    from converter.cli import VERIFY_HELP

    def written(value: float) -> str:  # 5e-3, as the help writes it
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"

    words = " ".join(VERIFY_HELP.split())
    assert f"more than {written(GATE_TOLERANCE[torch.float32])} × max(1, logit scale)" in words
    for dtype in (torch.float16, torch.bfloat16):
        assert f"{written(GATE_TOLERANCE[dtype])} ({str(dtype).removeprefix('torch.')})" in words, words
