"""``--logits last``: the graph gives each row's last kept new position's logits, (B, 1, V), and its head multiplies
one position rather than T. Its logits are the every-position graph's at that position, bit for bit, whether the
batch is padded on the left (ours) or on the right (onnxruntime-genai's); genai takes them as they are; the export's
checks read every position from the graph with its selection left out; and verify catches a selection that takes
the last slot instead of the last real token (the model builder's ``prune_lm_head``, which genai's right padding
defeats)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export.exporter import export_model
from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate
from export.runtime import OnnxDecoder, all_positions_model
from export.verify import at_last_kept, right_padded
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import parity_batch

GENAI_SCRIPT = Path(__file__).with_name("genai_greedy.py")
CASES = [
    ("qwen3", "fused", 16),
    ("qwen3", "plain", 16),
    ("qwen3_moe", "fused", 16),
    ("gpt2", "plain", None),  # learned positions, a head with a bias
    ("qwen3_5", "fused", None),  # hybrid: linear-attention states
    ("qwen3_next", "plain", None),
]
PROMPTS = [[5, 9, 17, 33, 4, 21, 8, 7], [11, 12, 13]]


@pytest.mark.parametrize(("family", "graph", "head_dim"), CASES)
def test_last_logits_are_the_every_position_logits_at_each_rows_last_token(family, graph, head_dim, onnx_variant):
    every = OnnxDecoder(onnx_variant(family, graph=graph, head_dim=head_dim), provider="cpu")
    folder = onnx_variant(family, graph=graph, head_dim=head_dim, logits="last")
    last = OnnxDecoder(folder, provider="cpu")
    assert last.last_logits_only and not every.last_logits_only
    assert json.loads((folder / "export_report.json").read_text())["logits"] == "last"
    left = parity_batch(96)
    for ids, mask in (right_padded(*left), left):  # the left-padded batch last: its states go on decoding
        full, every_state = every.prefill(ids, mask)
        picked, last_state = last.prefill(ids, mask)
        assert picked.shape == (len(ids), 1, full.shape[-1])
        np.testing.assert_array_equal(picked[:, 0], at_last_kept(full, mask))
    token = full[:, -1].argmax(-1)
    for _ in range(3):
        step_full = every.decode_one_token(token, every_state)
        np.testing.assert_array_equal(last.decode_one_token(token, last_state), step_full)
        token = step_full.argmax(-1)
    # the export's checks read every position from the same file, with the selection left out
    twin = OnnxDecoder(folder, provider="cpu", all_positions=True)
    np.testing.assert_array_equal(twin.prefill(*left)[0], every.prefill(*left)[0])


def test_all_positions_model_needs_the_selection(onnx_variant):
    every = onnx.load(onnx_variant("qwen3", graph="plain") / "model.onnx", load_external_data=False)
    with pytest.raises(ThinkerError, match="without its /lm_head/last_position/GatherND; export the model again"):
        all_positions_model(every)
    last = onnx.load(onnx_variant("qwen3", graph="plain", logits="last") / "model.onnx", load_external_data=False)
    full = all_positions_model(last)
    assert not any(node.name.startswith("/lm_head/last_position/") for node in full.graph.node)
    assert full.graph.output[0].type.tensor_type.shape.dim[1].dim_param == "sequence_length"
    assert len(full.graph.node) == len(every.graph.node)  # the every-position graph again, node for node


@pytest.mark.parametrize(
    ("logits", "planted_in", "message"),
    [
        ("last", "export.decoder_graph.emit_last_position", r"max \|Δlogit\|"),
        (
            "all",
            "export.genai_graph.emit_last_position",
            r"model.genai.onnx \(onnxruntime-genai's graph, rows padded on the right\)",
        ),
    ],
    ids=["model.onnx", "model.genai.onnx"],
)
def test_verify_fails_on_a_selection_that_takes_the_last_slot(
    logits, planted_in, message, thinker_variant, tmp_path, monkeypatch
):
    """The builder's prune_lm_head takes the last slot: right for left-padded prompts and decode steps, a pad's
    logits for a right-padded row. Verify's left-padded batch cannot see it; its right-padded prefill does, in a
    --logits last model.onnx and in the genai graph every fused export writes (its own, cheaper
    selection for right padding, ``emit_last_position(..., right_padded=True)``)."""
    folder = thinker_variant("qwen3", head_dim=16)
    assert export_model(folder, tmp_path / "ok", logits=logits, progress=False)["verify"]["passed"]

    def last_slot(b, hidden, *_, **__):
        return b.op("Gather", hidden, b.const([-1]), axis=1)

    monkeypatch.setattr(planted_in, last_slot)
    monkeypatch.setattr(
        "export.runtime.all_positions_model", lambda model: pytest.fail("not needed by a float export's verify")
    )
    with pytest.raises(ThinkerError, match=message):
        export_model(folder, tmp_path / "planted", logits=logits, progress=False)
    assert not (tmp_path / "planted").exists()


def test_quantized_checks_read_every_position(thinker_variant, tmp_path):
    """The accuracy guard and the quantization cost score a paragraph at every position: a --logits last export
    gets the same figures as the every-position one, and its parity check covers the selection."""
    folder = thinker_variant("qwen3", head_dim=16, vocab_size=512)
    spec = QuantizeSpec(bits=4, block_size=16, accuracy_level=4)
    gate = QualityGate(0.0, 1e9)  # random weights: only the equality of the figures is asked here
    reports = {
        logits: export_model(
            folder, tmp_path / logits, quantize=spec, quality=gate, accuracy_guard=0.9, logits=logits, progress=False
        )
        for logits in ("all", "last")
    }
    for key in ("agreement_before", "agreement", "moved_to_level_1"):
        assert reports["last"]["accuracy_guard"][key] == reports["all"]["accuracy_guard"][key], key
    cost_all, cost_last = reports["all"]["verify"]["cost"], reports["last"]["verify"]["cost"]
    for key in ("top1_agreement", "perplexity_change"):
        assert cost_last[key] == pytest.approx(cost_all[key], abs=1e-6), key
    assert reports["last"]["verify"]["passed"] and reports["last"]["verify"]["graph"]["positions"] == 16


def test_genai_takes_the_last_logits_as_they_are(genai_python, thinker_variant, onnx_variant):
    """onnxruntime-genai sees the static 1 and skips its own slicing: a batch of unequal prompts, which it pads on
    the right, gives each row transformers' greedy tokens for that row alone."""
    from thinker import ThinkerForCausalLM

    new_tokens = 8
    variants = [("qwen3", "fused", 16, None), ("qwen3", "plain", 16, None), ("qwen3_5", "fused", None, "text")]
    cases = [
        {"folder": str(onnx_variant(f, graph=g, head_dim=h, positions=p, logits="last")), "prompts": PROMPTS}
        for f, g, h, p in variants
    ]
    for case in cases:
        case["max_new_tokens"] = new_tokens
    done = subprocess.run(
        [str(genai_python), str(GENAI_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for (family, _, head_dim, _), rows in zip(variants, json.loads(done.stdout), strict=True):
        overrides = {"head_dim": head_dim} if head_dim else {}
        model = ThinkerForCausalLM.from_pretrained(thinker_variant(family, **overrides)).eval()
        eos = model.config.eos_token_id
        for prompt, row in zip(PROMPTS, rows, strict=True):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                )
            expected = out[0, len(prompt) :].tolist()
            expected = expected[: expected.index(eos)] if eos in expected else expected
            assert (row[: row.index(eos)] if eos in row else row) == expected, f"{family}: {prompt}"


def test_a_graph_without_logits_is_refused_by_name(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "no_logits", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), tmp_path / "m.onnx")
    with pytest.raises(ThinkerError, match=r"m\.onnx: no logits output; export the model with `thinker export`"):
        OnnxDecoder(tmp_path / "m.onnx", provider="cpu")


# What onnxruntime's CUDA provider runs in int64 (its operator table, docs/OperatorKernels.md) among the selection's
# operators: a half graph's selection uses no other, so no node of it falls back to the CPU on CUDA.
CUDA_INT64_OPS = {
    "Shape",
    "Neg",
    "Slice",
    "Squeeze",
    "Add",
    "Range",
    "Mul",
    "ReduceMax",
    "Sub",
    "GatherND",
    "Unsqueeze",
}


def assert_picks_as_verify(b, picked: str, dtype: torch.dtype, cases) -> None:
    """Runs the selection ``b`` built (its result ``picked``) on each ``(mask, steps)`` case, hidden states numbered
    so that every slot differs, and holds each row's pick to verify's rule (``at_last_kept``)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from export.graph_builder import TORCH_TO_ONNX
    from export.verify import at_last_kept

    b.op_to("Identity", [picked], ["picked"])
    element = TORCH_TO_ONNX[dtype]
    graph = b.make_graph(
        "selection",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"]),
            helper.make_tensor_value_info("hidden", element, ["B", "T", 3]),
        ],
        [helper.make_tensor_value_info("picked", element, ["B", 1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    numpy_type = np.float32 if dtype == torch.float32 else np.float16
    for mask, steps in cases:
        hidden = np.arange(len(mask) * steps * 3).reshape(len(mask), steps, 3).astype(numpy_type)
        (actual,) = session.run(
            None, {"input_ids": np.zeros((len(mask), steps), np.int64), "attention_mask": mask, "hidden": hidden}
        )
        np.testing.assert_array_equal(actual[:, 0], at_last_kept(hidden, mask[:, -steps:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_last_position_forms_pick_each_rows_last_kept_position(dtype):
    """``emit_last_position`` alone: a left-padded row, a right-padded one, a full one and one that keeps nothing
    (its last slot), after two cached slots; then a decode step (one new slot). Both forms (float32: ArgMax; half:
    int64 operators CUDA runs) pick the same rows."""
    from export.decoder_graph import emit_last_position
    from export.graph_builder import GraphBuilder

    b = GraphBuilder(None)
    picked = emit_last_position(b, "hidden", "input_ids", "attention_mask", dtype)
    ops = {node.op_type for node in b.nodes}
    assert ("ArgMax" in ops) == (dtype == torch.float32)
    assert dtype == torch.float32 or ops <= CUDA_INT64_OPS, ops
    cases = [
        (np.array([[1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]]), 5),
        (np.array([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 1]]), 1),
    ]
    assert_picks_as_verify(b, picked, dtype, cases)


def test_the_genai_selection_picks_each_right_padded_rows_last_kept_position():
    """``emit_last_position(..., right_padded=True)``, the genai graph's selection: a step's new slots kept then
    padded, as onnxruntime-genai batches them (a right-padded prompt, a full one, one that keeps nothing: its last
    slot, after two cached slots; a decode step's one slot, behind pads inside the cache), picks what verify's rule
    picks, in two int64 operators fewer than the general form's (ReduceSum for Range, Add, Squeeze, Mul, ReduceMax),
    all of them operators CUDA runs on int64. A left-padded row, which the genai graph is not for, is not its
    case."""
    from export.decoder_graph import emit_last_position
    from export.graph_builder import GraphBuilder

    b = GraphBuilder(None)
    picked = emit_last_position(b, "hidden", "input_ids", "attention_mask", torch.float16, right_padded=True)
    ops = [node.op_type for node in b.nodes if node.op_type != "Constant"]
    assert set(ops) <= CUDA_INT64_OPS | {"ReduceSum"} and "Range" not in ops and "ReduceMax" not in ops, ops
    cases = [
        (np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]]), 5),
        (np.array([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 1]]), 1),
    ]
    assert_picks_as_verify(b, picked, torch.float16, cases)


def selection_ops(path) -> list[str]:
    graph = onnx.load(path, load_external_data=False).graph
    prefix = "/lm_head/last_position/"
    return sorted(node.op_type for node in graph.node if node.name.startswith(prefix) and node.op_type != "Constant")


def test_each_genai_graph_selects_by_the_padding_it_takes(onnx_variant):
    """The fused graph's genai model, rewired for right padding alone, selects by its cheaper rule; a plain graph's
    (Qwen3.5's, rewired only to take text positions), which takes left padding too, keeps the general one."""
    fused = onnx_variant("qwen3", dtype="float16") / "model.genai.onnx"
    assert selection_ops(fused) == ["GatherND", "Neg", "ReduceSum", "Shape", "Slice", "Sub", "Unsqueeze"]
    plain = onnx_variant("qwen3_5", graph="plain", head_dim=None) / "model.genai.onnx"
    assert "ArgMax" in selection_ops(plain) and "ReduceSum" not in selection_ops(plain)


@pytest.mark.parametrize("logits", ["last", "all"])
def test_verify_measures_a_last_logits_graphs_sensitivity_where_it_compares(
    logits, thinker_variant, onnx_variant, monkeypatch
):
    """Where a pass parts beyond the logit scale's tolerance (forced here), the rounding sensitivity is measured at
    the positions the graph is compared at: each row's last one for ``--logits last``, every kept one else."""
    import export.verify as verify

    folder, export = (
        thinker_variant("qwen3", head_dim=16),
        onnx_variant("qwen3", graph="plain", head_dim=16, logits=logits),
    )
    asked = []
    monkeypatch.setattr(verify, "beyond_scale", lambda dtype, *passes: True)
    monkeypatch.setattr(
        verify, "rounding_sensitivity", lambda model, ids, mask, last_only=False: asked.append(last_only) or 0.0
    )
    verify.verify_export(folder, export / "model.onnx", torch.float32)
    assert asked == [logits == "last"] * 2  # the batch's measure and the long prompts'
