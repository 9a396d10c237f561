"""The parts of a model the parity prompts never reach (converter/unreached.py): an embedding row no prompt token
reads, an expert no prompt token is routed to. A fault in either leaves the prompts' logits exact; the gate fails
it by name, whole-model and layer by layer."""

from __future__ import annotations

import pytest
import torch
from convert_helpers import build_reference
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen3MoeConfig

from converter import parity
from converter.parity import check_parity
from converter.parity_report import BY_LAYER, CONTEXT_STAGE, ROTARY_STAGE, WHOLE_MODEL
from converter.unreached import EMBEDDING_ROWS, Probes, experts_stage, router_stage
from thinker_common.parity_inputs import gate_prompts

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
# Many experts, one per token: the gate's 252 prompt tokens reach about two in three of each layer's 256.
MOE = Qwen3MoeConfig(
    **TINY, num_hidden_layers=2, head_dim=8, moe_intermediate_size=8, num_experts=256, num_experts_per_tok=1
)


def prompts_of(config) -> list[list[int]]:
    """The gate's prompts for a model of ``config``."""
    return gate_prompts(config.vocab_size, config.max_position_embeddings, parity.GREEDY_TOKENS)


def changed(folder, name: str, change) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights[name])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def unrouted_expert(source, layer: int, besides: set[int] = frozenset()) -> int:
    """The last expert of ``layer`` that no position of the parity prompts is routed to, by the reference itself
    (the last: a probe that stopped short of the experts' count passed the first, a low index, a mutation run)."""
    model = build_reference(MOE)
    routed = set()
    hook = model.model.layers[layer].mlp.gate.register_forward_hook(
        lambda module, args, output: routed.update(output[2].flatten().tolist())
    )
    with torch.no_grad():
        for prompt in prompts_of(MOE):
            model(torch.tensor([prompt]))
    hook.remove()
    return max(expert for expert in range(MOE.num_experts) if expert not in routed | besides)


def only_the_probe_fails(source, converted, mode: str, stage: str):
    """The gate's verdict on ``converted``: the prompts' logits exact, and ``stage`` the first divergence named.
    Returns the float32 row."""
    report = check_parity(source, converted, mode=mode)
    fp32 = report.results[0]
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.top1_agreement == 1.0  # the prompts see nothing
    assert not report.passed and fp32.first_divergence == stage, report.table()
    return fp32


@pytest.mark.parametrize("side", ["reference", "converted"])
def test_experts_on_one_side_only_fail_their_stage(side):
    """A layer with routed experts in one model and none in the other (a conversion that dropped them, or made
    them up) is a failing stage, not a layer skipped as dense on both sides."""
    probes = Probes(hidden_size=4, vocab_size=8)
    other = "converted" if side == "reference" else "reference"
    probes.experts[side], probes.experts[other] = [torch.ones(4, 4)], [None]
    found = {stage.name: stage.passed for stage in probes.stages(torch.float32)}
    assert found.get(experts_stage(0)) is False, found  # present and failing


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_an_embedding_row_no_prompt_reads(mode, save_reference, run_convert):
    config = Qwen2Config(**{**TINY, "vocab_size": 1024}, num_hidden_layers=2, tie_word_embeddings=False)
    _, source = save_reference(config)
    converted = run_convert(source, verify=False).output
    # the last row no prompt reads: a probe of the first rows alone passed the first such row (a mutation run)
    unread = max(i for i in range(config.vocab_size) if i not in sum(prompts_of(config), []))
    assert check_parity(source, converted, mode=mode).passed
    changed(converted, "model.embed_tokens.weight", lambda table: table[unread].add_(0.5))

    only_the_probe_fails(source, converted, mode, EMBEDDING_ROWS)


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_an_expert_no_prompt_is_routed_to(mode, save_reference, run_convert):
    _, source = save_reference(MOE)
    converted = run_convert(source, verify=False).output
    expert = unrouted_expert(source, layer=1)
    assert check_parity(source, converted, mode=mode).passed
    changed(converted, "model.layers.1.mlp.experts.down_proj", lambda stack: stack[expert].mul_(3))

    fp32 = only_the_probe_fails(source, converted, mode, experts_stage(1))
    failed = [stage.name for stage in fp32.unreached if not stage.passed]
    assert failed == [experts_stage(1)], fp32.unreached


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_router_rows_no_prompt_picks(mode, save_reference, run_convert, monkeypatch):
    """Two router rows of experts no prompt token is routed to, swapped: the prompts' logits are exact (a softmax's
    sum is the same under a swap) and the experts themselves are right, but a later token aimed at one expert runs
    the other. It passed the layer-by-layer gate, and the whole-model gate failed it only through a greedy
    continuation, blaming "the final norm or the head" (a QA run); among 256 experts no continuation reaches it."""
    _, source = save_reference(MOE)
    converted = run_convert(source, verify=False).output
    first = unrouted_expert(source, layer=1)
    second = unrouted_expert(source, layer=1, besides={first})
    assert check_parity(source, converted, mode=mode).passed

    def swap(rows):
        rows[[first, second]] = rows[[second, first]]

    changed(converted, "model.layers.1.mlp.gate.weight", swap)

    fp32 = only_the_probe_fails(source, converted, mode, router_stage(1))
    assert [stage.name for stage in fp32.unreached if not stage.passed] == [router_stage(1)], fp32.unreached
    if mode == WHOLE_MODEL:  # without the probes, neither the prompts nor their continuations see the swap
        monkeypatch.setattr(parity, "unreached_stages", lambda *args: [])
        assert check_parity(source, converted, mode=mode).passed


def edit_config(folder, **changes) -> None:
    """A planted config translation bug: the converted folder's config.json as a wrong rule would have written it."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        config[key] = {**config[key], **value} if key == "rope_parameters" else value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
@pytest.mark.parametrize(
    ("rope", "change", "stage"),
    [
        # dynamic NTK rescales past the context only, which the prompts never reach: a factor translated wrong
        ({"rope_type": "dynamic", "factor": 2.0}, {"rope_parameters": {"factor": 8.0}}, ROTARY_STAGE),
        # the context itself: no logit of the model's moves, but an export's context_length does
        ({"rope_type": "default"}, {"max_position_embeddings": 128}, CONTEXT_STAGE),
    ],
    ids=["dynamic-factor", "context"],
)
def test_a_position_translation_the_prompts_never_reach(mode, rope, change, stage, save_reference, run_convert):
    """A config translated wrong where only long sequences see it (a QA run: a dynamic factor, a longrope long
    factor, the context): the prompts' logits are exact; the rotary tables across the context, or the context
    itself, fail it by name."""
    config = Qwen2Config(
        **TINY, num_hidden_layers=2, max_position_embeddings=64, rope_parameters={**rope, "rope_theta": 1e4}
    )
    _, source = save_reference(config)
    converted = run_convert(source, verify=False).output
    passing = check_parity(source, converted, mode=mode)
    assert passing.passed and "the context and the rotary tables across it" in passing.table(), passing.table()
    edit_config(converted, **change)

    only_the_probe_fails(source, converted, mode, stage)


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_multimodal_positions_the_prompts_never_give(mode, save_reference, run_convert):
    """Qwen3.5's mRoPE with its interleaved layout translated as contiguous sections: text positions (all three
    streams equal) cannot tell them apart, an image's can (2.8 logits apart on a tiny model, a QA run): the rotary
    tables on (3, B, T) positions fail it."""
    from references.hybrid import qwen3_5_config

    _, source = save_reference(qwen3_5_config())
    converted = run_convert(source, verify=False).output
    assert check_parity(source, converted, mode=mode).passed
    edit_config(converted, rope_parameters={"mrope_interleaved": False})

    report = check_parity(source, converted, mode=mode)
    assert not report.passed and report.results[0].first_divergence == ROTARY_STAGE, report.table()


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_longrope_short_factors_are_compared_within_the_trained_length(mode, save_reference, run_convert):
    """LongRoPE takes its short factors for a sequence within original_max_position_embeddings and its long ones past
    it, by the call's longest position: probed only with positions past it, a short factor translated wrong passed
    (0.46 logits apart at position 2047 of a Llama, a reviewer found). The rotary tables within the trained length
    are compared on their own."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32}
    rope |= {"short_factor": [1.0] * 4, "long_factor": [1.0, 1.5, 2.0, 2.5]}
    _, source = save_reference(
        Qwen2Config(**TINY, num_hidden_layers=2, max_position_embeddings=256, rope_parameters=rope)
    )
    converted = run_convert(source, verify=False).output
    assert check_parity(source, converted, mode=mode).passed
    edit_config(converted, rope_parameters={"short_factor": [1.0, 1.0, 1.0, 1.5]})

    report = check_parity(source, converted, mode=mode)
    assert not report.passed and ROTARY_STAGE in [
        stage.name for stage in report.results[0].unreached if not stage.passed
    ]


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_a_learned_position_row_no_prompt_reaches(mode, save_reference, run_convert):
    """GPT-2's learned position table: the prompts read its first few dozen rows, and a later row garbled passed the
    gate in both modes (2.9 logits apart at that position, a QA run). Its whole table is compared as the token
    embedding's is."""
    from transformers import GPT2Config

    from converter.parity_report import POSITION_ROWS

    _, source = save_reference(GPT2Config(vocab_size=96, n_embd=24, n_layer=2, n_head=3, n_positions=64))
    converted = run_convert(source, verify=False).output
    passing = check_parity(source, converted, mode=mode)
    assert passing.passed and "every position-embedding row" in passing.table(), passing.table()
    changed(converted, "model.embed_positions.weight", lambda table: table[63].zero_())

    only_the_probe_fails(source, converted, mode, POSITION_ROWS)


def test_a_low_frequency_short_factor_is_compared_across_the_trained_length(save_reference, run_convert):
    """A short factor translated wrong in the lowest frequency (theta 1e6): over the first eight positions its sine
    moves less than the tolerance, across the trained length's middle and end it does not; the probe takes those
    too (a mutation probing the first eight positions alone passed every test, the tiny models' theta 1e4 showing
    every factor at once)."""
    rope = {"rope_type": "longrope", "rope_theta": 1e6, "original_max_position_embeddings": 32}
    rope |= {"short_factor": [1.0] * 4, "long_factor": [1.0, 1.5, 2.0, 2.5]}
    _, source = save_reference(
        Qwen2Config(**TINY, num_hidden_layers=2, max_position_embeddings=256, rope_parameters=rope)
    )
    converted = run_convert(source, verify=False).output
    edit_config(converted, rope_parameters={"short_factor": [1.0, 1.0, 1.0, 1.5]})

    report = check_parity(source, converted)
    assert not report.passed and ROTARY_STAGE in [
        stage.name for stage in report.results[0].unreached if not stage.passed
    ], report.table()
