"""``--verify``'s deep-cache pass (export/deep_cache.py): decode steps after a cache reaching the end of the context.

The long prompts reach a cache of about 150 slots. A window of 600 keys built into the plain graph's attention mask
(the fused graphs' windows are an attribute, read off the graph: test_verify_long_prompts.py) passes them and the
fixed prompts, and moves nothing a prompt of the check could afford; behind 1016 random slots the decode steps at the
context's last positions see it. Each plant goes into a sound export, which passes first. The models hold 1024
positions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
import torch
from export_helpers import window_of
from onnx import helper

from export.deep_cache import NOT_RUN_INDEXED, deep_cache_slots, deep_slot_bytes, not_run_reason, slots_within
from export.exporter import export_model
from export.names import GENAI_MODEL_FILE, MODEL_FILE
from export.quantize import QuantizeSpec
from export.quantized_verify import verify_quantized_export
from export.verify import DEEP_PASSES, LONG_PASSES, verify_export
from thinker import ThinkerConfig
from thinker_common.parity_inputs import DEEP_CACHE_SLOTS, DEEP_DECODE_STEPS, DEEP_PROMPT_LENGTH

CONTEXT = 1024
WINDOW = 600  # wider than the long prompts' cache (141 tokens and 3 steps), narrower than the deep one


@pytest.fixture(scope="module")
def exports(tmp_path_factory, thinker_variant):
    """``exports(family, graph, dtype, quantize=None)`` -> (Thinker folder, its unverified export), made once."""
    root, made = tmp_path_factory.mktemp("deep-cache"), {}

    def get(family: str, graph: str, dtype: str = "float32", quantize: QuantizeSpec | None = None):
        key = (family, graph, dtype, quantize)
        if key not in made:
            shape = {"head_dim": 16} if family == "qwen3" else {}  # the fused kernels' smallest head
            folder = thinker_variant(family, max_position_embeddings=CONTEXT, **shape)
            output = root / f"{family}-{graph}-{len(made)}"
            export_model(folder, output, dtype=dtype, graph=graph, quantize=quantize, verify=False, progress=False)
            made[key] = folder, output
        return made[key]

    return get


def mask_window(keys: int):
    """The plain graph's attention mask also hides every slot ``keys`` or more before the query's: a window."""

    def plant(graph: onnx.GraphProto) -> None:
        nodes = list(graph.node)
        at = next(i for i, node in enumerate(nodes) if node.op_type == "LessOrEqual" and "attn_mask" in node.name)
        causal = nodes[at]
        key_slot, query_slot = causal.input
        allowed, name = causal.output[0], causal.name
        causal.output[0] = f"{name}/unwindowed"
        graph.initializer.append(helper.make_tensor(f"{name}/window", onnx.TensorProto.INT64, [], [keys]))
        window = [
            helper.make_node("Sub", [query_slot, f"{name}/window"], [f"{name}/oldest"]),
            helper.make_node("Greater", [key_slot, f"{name}/oldest"], [f"{name}/in_window"]),
            helper.make_node("And", [causal.output[0], f"{name}/in_window"], [allowed]),
        ]
        del graph.node[:]
        graph.node.extend([*nodes[: at + 1], *window, *nodes[at + 1 :]])

    return plant


def planted(export: Path, tmp_path: Path, name: str, edit) -> Path:
    copy = shutil.copytree(export, tmp_path / "planted")
    model = onnx.load(copy / name, load_external_data=False)
    edit(model.graph)
    onnx.save_model(model, copy / name)
    return copy


def assert_reaches_the_context(figures: dict) -> None:
    slots = CONTEXT - DEEP_PROMPT_LENGTH - DEEP_DECODE_STEPS
    assert figures["random_slots"] == slots and figures["cache_slots"] == slots + DEEP_PROMPT_LENGTH
    assert figures["step_positions"] == [CONTEXT - DEEP_DECODE_STEPS, CONTEXT - 1]  # the context's last positions
    assert figures["positions"] == DEEP_DECODE_STEPS and len(figures["max_abs_diff_per_step"]) == DEEP_DECODE_STEPS


@pytest.mark.parametrize(
    "family, graph, dtype",
    [("qwen3", "plain", "float32"), ("qwen3_5", "plain", "float32"), ("qwen3", "fused", "float16")],
)  # fmt: skip
def test_a_sound_export_passes_far_into_its_context(family, graph, dtype, exports):
    folder, export = exports(family, graph, dtype)
    result = verify_export(folder, export / MODEL_FILE, getattr(torch, dtype))
    assert result["passed"], result
    for key in DEEP_PASSES:
        if key in result:
            assert_reaches_the_context(result[key])
            assert result[key]["max_abs_diff"] <= result[key]["tolerance"]
    assert "deep_cache" in result  # (the fused float32 graphs: the genai test below)


def test_a_window_in_the_plain_mask_is_caught_behind_the_deep_cache(exports, tmp_path):
    folder, export = exports("qwen3", "plain")
    bad = planted(export, tmp_path, MODEL_FILE, mask_window(WINDOW))
    result = verify_export(folder, bad / MODEL_FILE, torch.float32)
    assert result["passed"] is False
    figures = result["deep_cache"]
    first, last = figures["step_positions"]
    assert result["failure"].startswith(
        f"model.onnx after a cache of {figures['cache_slots']} slots, at positions {first} to {last}: max |Δlogit|"
    ), result["failure"]
    assert figures["max_abs_diff"] > 10 * figures["tolerance"], figures
    # the fixed and the long prompts alone would have passed it
    assert result["max_abs_diff"] <= result["tolerance"]
    for key in LONG_PASSES:
        if key in result:
            assert result[key]["max_abs_diff"] <= result[key]["tolerance"]


def test_a_window_in_genai_graph_fails_its_deep_pass_too(exports, tmp_path):
    """Read off the graph already (test_verify_long_prompts.py); its decode steps far into the cache see it."""
    folder, export = exports("qwen3", "fused")
    bad = planted(export, tmp_path, GENAI_MODEL_FILE, window_of(WINDOW))
    result = verify_export(folder, bad / MODEL_FILE, torch.float32)
    assert result["passed"] is False
    assert f"{DEEP_PASSES['genai_graph_deep_cache']} after a cache of" in result["failure"], result["failure"]
    figures = result["genai_graph_deep_cache"]
    assert figures["max_abs_diff"] > 10 * figures["tolerance"], figures
    assert result["deep_cache"]["max_abs_diff"] <= result["deep_cache"]["tolerance"]  # model.onnx: sound


def test_the_quantized_graph_check_runs_the_deep_pass(exports, tmp_path):
    folder, export = exports("qwen3", "plain", quantize=QuantizeSpec(bits=8, block_size=16))
    sound = verify_quantized_export(folder, export / MODEL_FILE, torch.float32, 8)
    assert sound["passed"], sound
    assert_reaches_the_context(sound["graph"]["deep_cache"])
    bad = planted(export, tmp_path, MODEL_FILE, mask_window(WINDOW))
    result = verify_quantized_export(folder, bad / MODEL_FILE, torch.float32, 8)
    assert result["passed"] is False
    assert "model.onnx after a cache of" in result["failure"], result["failure"]
    assert result["graph"]["max_abs_diff"] <= result["graph"]["tolerance"]  # the batch alone would have passed it


def test_where_the_pass_reaches_and_what_it_holds():
    assert deep_cache_slots(40960, None) == DEEP_CACHE_SLOTS
    assert deep_cache_slots(40960, 512) == 512 - DEEP_PROMPT_LENGTH - DEEP_DECODE_STEPS  # the graph's tables
    assert deep_cache_slots(40960, None, most=100) == 100  # as memory allows
    assert deep_cache_slots(4, None) == 0
    config = ThinkerConfig(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=40960,
    )  # fmt: skip
    values = 2 * 2 * 2 * 32  # a slot: two full-attention layers' keys and values
    assert deep_slot_bytes(config, torch.float32) == values * (2 * 4 + 2 * 4)
    assert deep_slot_bytes(config, torch.float16) == values * (2 * 4 + 2 * 2 + 2 + 4 + 4)  # the shadow: 2 caches
    assert deep_slot_bytes(config, torch.float32, torch.float64) == values * (2 * 8 + 2 * 4)  # the second opinion
    assert slots_within(100 * deep_slot_bytes(config, torch.float32), config, torch.float32) == 100
    assert slots_within(10**15, config, torch.float32) == DEEP_CACHE_SLOTS
    assert slots_within(-5, config, torch.float32) == 0
    assert not_run_reason(config, torch.float32) is None and not_run_reason(config, torch.bfloat16)
    linear = ThinkerConfig(num_hidden_layers=2, layer_types=["linear_attention"] * 2)  # no slot to hold
    assert deep_slot_bytes(linear, torch.float32) == 0 and slots_within(0, linear, torch.float32) == DEEP_CACHE_SLOTS


def test_the_pass_goes_as_deep_as_memory_allows(exports, monkeypatch):
    """A budget that holds the check's models and 300 slots more: the pass runs 300 deep, rather than the check being
    refused; one that holds no slot says so."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import WHOLE, held_bytes

    folder, export = exports("qwen3", "plain")
    config = ThinkerConfig.from_pretrained(folder)
    whole = held_bytes(folder, torch.float32)[0]
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(whole + 300 * deep_slot_bytes(config, torch.float32)))
    result = verify_export(folder, export / MODEL_FILE, torch.float32, plan=WHOLE)
    assert result["passed"] and result["deep_cache"]["random_slots"] == 300, result["deep_cache"]
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(whole))
    result = verify_export(folder, export / MODEL_FILE, torch.float32, plan=WHOLE)
    assert result["passed"] and "holds no slot" in result["deep_cache"]["not_run"]


def test_qwen3_8_says_why_the_pass_does_not_run(thinker_variant):
    from thinker import ThinkerConfig as Config

    folder = thinker_variant("qwen4_exp")
    assert not_run_reason(Config.from_pretrained(folder), torch.float32) == NOT_RUN_INDEXED
