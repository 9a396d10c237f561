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
from transformers import Qwen3Config, Qwen3ForCausalLM

import thinker.modeling_thinker as modeling
from converter import layer_parity, parity
from converter.parity import check_parity
from converter.parity_report import BY_LAYER, GREEDY_ONLY, LAYER_DECODE_STEPS, WHOLE_MODEL
from thinker import ThinkerForCausalLM
from thinker_common.parity_inputs import GATE_TOLERANCE, fixed_prompts


def state_through_bfloat16(monkeypatch) -> None:
    """The prefill's last recurrent state stored rounded to bfloat16 (a cache that narrows what it keeps): the
    prompts' logits come from the prefill itself and are exact; only the decode steps read the state."""
    chunked = modeling.torch_chunk_gated_delta_rule

    def rounded(*args, **kwargs):
        out, state = chunked(*args, **kwargs)
        return out, None if state is None else state.to(torch.bfloat16).to(state.dtype)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", rounded)


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_a_state_carried_wrong_fails_the_decode_steps(mode, save_reference, run_convert, monkeypatch):
    """float32: 4e-3 of the logit scale apart at the decode steps, the greedy tokens the same; it passed before,
    and layer by layer (which ran no decode step) every stage agreed."""
    _, source = save_reference(qwen3_5_config(), seed=1)
    converted = run_convert(source, verify=False).output
    checked = check_parity(source, converted, mode=mode)
    sound = checked.results[0]
    steps = parity.GREEDY_TOKENS - 1 if mode == WHOLE_MODEL else LAYER_DECODE_STEPS
    assert sound.passed and sound.decode_steps == len(checked.prompts) * steps
    assert sound.decode_max_abs_diff <= 1e-6 * sound.logit_scale, sound  # transformers' own functions: exact

    state_through_bfloat16(monkeypatch)
    report = check_parity(source, converted, mode=mode)
    fp32 = report.results[0]
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.top1_agreement == 1  # what passed
    assert all(stage.passed for stage in fp32.layers)
    assert fp32.decode_max_abs_diff > fp32.tolerance and not report.passed
    assert fp32.first_divergence == GREEDY_ONLY
    assert "decode steps: max|Δlogit|" in report.table()


def test_a_decode_path_wrong_fails_layer_by_layer(save_reference, run_convert, monkeypatch):
    """The one-step delta rule (decode) without its q/k L2 norm, the chunked one (prompts) with it (a QA run's
    mutation): every stage on the prompts agrees exactly, the decode steps are 7 logits apart. Layer by layer ran no
    decode step, and passed it."""
    _, source = save_reference(qwen3_5_config(), seed=1)
    converted = run_convert(source, verify=False).output
    one_step = modeling.torch_recurrent_gated_delta_rule
    monkeypatch.setattr(
        modeling,
        "torch_recurrent_gated_delta_rule",
        lambda *args, **kwargs: one_step(*args, **{**kwargs, "use_qk_l2norm_in_kernel": False}),
    )
    report = check_parity(source, converted, mode=BY_LAYER)
    fp32 = report.results[0]
    assert all(stage.passed and stage.max_abs_diff == 0 for stage in fp32.layers), fp32.layers
    assert not report.passed and fp32.first_divergence == GREEDY_ONLY
    assert fp32.decode_max_abs_diff > 100 * fp32.decode_tolerance


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
    """The router softmax in bfloat16 (Qwen3.5-MoE renormalises its top-k weights): the prompts' logits 0.21 of the
    logit scale from the reference's in both modes and the decode steps 0.16 (on the fixed prompts alone, before the
    long ones joined them, 3.1e-2: within the export's tolerance, 5e-2, an ONNX graph against float32 PyTorch, that
    the gate held them to before). The float32 run cannot see it; a sound bfloat16 conversion measures 0. The gate
    does not find every rounding bug, only those beyond a few of the dtype's ulps."""
    _, source = save_reference(qwen3_5_moe_config(), seed=2)
    converted = run_convert(source, dtype="bfloat16", verify=False).output
    sound = check_parity(source, converted, mode=mode).results[1]
    assert sound.dtype == "bfloat16" and sound.passed and sound.max_abs_diff == 0, sound

    router_softmax_in_half(monkeypatch)
    report = check_parity(source, converted, mode=mode)
    fp32, half = report.results
    assert fp32.passed
    scale = max(1.0, half.logit_scale)
    assert GATE_TOLERANCE[torch.bfloat16] * scale < half.max_abs_diff
    assert not half.passed and not report.passed, report.table()


def test_verify_help_states_the_gates_own_tolerances():
    """``thinker verify --help`` writes the half-precision bounds out (its module does not import torch, for a fast
    --help): they are the table's."""
    from converter.cli import VERIFY_HELP

    def written(value: float) -> str:  # 1e-2, as the help writes it
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"

    words = " ".join(VERIFY_HELP.split())
    assert f"more than {written(GATE_TOLERANCE[torch.float32])} × max(1, logit scale)" in words
    for dtype in (torch.float16, torch.bfloat16):
        assert f"{written(GATE_TOLERANCE[dtype])} ({str(dtype).removeprefix('torch.')})" in words, words


DENSE = Qwen3Config(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def near_ties(monkeypatch, positions: slice, nudge: float, rows: int | slice = 0) -> None:
    """Both models' prefill logits made to hold an exact tie between their two best tokens at ``positions`` of
    ``rows``, the Thinker's runner-up then nudged above by ``nudge`` of the scale: a near tie taken the other way,
    inside the tolerance."""
    for cls, up in ((Qwen3ForCausalLM, 0.0), (ThinkerForCausalLM, nudge)):
        forward = cls.forward

        def tied(self, *args, _forward=forward, _nudge=up, **kwargs):
            output = _forward(self, *args, **kwargs)
            if kwargs.get("output_hidden_states"):  # the parity check's prefill
                logits = output.logits[rows, positions]
                best = logits.topk(2, dim=-1)
                runner_up = best.values[..., :1] + _nudge * output.logits.abs().max()
                logits.scatter_(-1, best.indices[..., 1:], runner_up)
            return output

        monkeypatch.setattr(cls, "forward", tied)


def test_a_near_tie_is_named_as_one(save_reference, run_convert, monkeypatch):
    """float32: a greedy token parting at a near tie, every logit compared within the tolerance and no decode step
    apart, is named a near tie, not the decode steps (a review: it read "a decode step on a generated token
    differs" beside a table line saying none did)."""
    _, source = save_reference(DENSE)
    converted = run_convert(source, verify=False).output
    near_ties(monkeypatch, slice(-1, None), 1e-6)  # row 0's last position: its first greedy token
    report = check_parity(source, converted)
    fp32 = report.results[0]
    assert not fp32.passed and fp32.greedy_identical == fp32.greedy_prompts - 1
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.decode_max_abs_diff <= fp32.decode_tolerance
    assert fp32.first_divergence == parity.NEAR_TIE, report.table()


def test_top1_below_its_floor_is_named_as_such(save_reference, run_convert, monkeypatch):
    """Half precision: the logits within the tolerance and the top-1 tokens apart at most positions is named by the
    top-1 agreement, not by a walk of hidden states that all agree ("the final norm or the head")."""
    _, source = save_reference(DENSE)
    converted = run_convert(source, dtype="bfloat16", verify=False).output
    near_ties(monkeypatch, slice(None), 5e-3, rows=slice(None))  # every position, about a bfloat16 ulp up
    half = check_parity(source, converted).results[1]
    assert half.dtype == "bfloat16" and not half.passed and half.top1_agreement < parity.HALF_TOP1_MIN
    assert half.max_abs_diff <= half.tolerance
    assert half.first_divergence == parity.TOP1_BELOW.format(top1=half.top1_agreement, floor=parity.HALF_TOP1_MIN)


def gated_norm_in_half(monkeypatch) -> None:
    """The Gated DeltaNet's output norm taking its gate's activation, and the product, in the model's dtype where
    Qwen's (and the Thinker's) widen them to float32 (a QA run's mutation)."""

    def forward(self, hidden_states, gate):
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype) * self.act_fn(gate)

    monkeypatch.setattr(modeling.ThinkerRMSNormGated, "forward", forward)


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_a_half_precision_bug_the_long_prompts_show_fails_the_float16_run(
    mode, save_reference, run_convert, monkeypatch
):
    """The gated norm in float16 on a Qwen3.5: on the fixed prompts alone (the gate's prompts before the long ones
    joined them) 2.9e-3 of the logit scale, under float16's 1e-2, and it passes; beside the long ones 1.6e-2, in
    both modes, and it fails."""
    _, source = save_reference(qwen3_5_config(), seed=1)
    converted = run_convert(source, dtype="float16", verify=False).output
    gated_norm_in_half(monkeypatch)
    with monkeypatch.context() as short:
        for module in (parity, layer_parity):
            short.setattr(module, "gate_prompts", lambda vocab_size, context, reserve: fixed_prompts(vocab_size))
        before = check_parity(source, converted, mode=mode)
    half = before.results[1]
    assert before.passed and half.dtype == "float16", before.table()

    report = check_parity(source, converted, mode=mode)
    half = report.results[1]
    assert half.max_abs_diff > half.tolerance and not report.passed, report.table()
