"""The routing follower, the providers' labels and options, an ONNX folder's context and external data,
genai_config.json's fixed fields and the greedy continuation pass, held directly (a mutation run of export/routing.py,
export/continuation.py, export/providers.py, export/onnx_folder.py and export/genai_config.py found each changeable
without a failing test).

The follower is driven on a bare router (two layers of ``ThinkerTopKRouter``, no model run), the folder checks on
graphs of one initializer; only the continuation test exports a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_helpers import make_config
from onnx import TensorProto, helper, numpy_helper

from export.genai_config import make_genai_config, no_eos_note
from export.half_spread import HALF_SPREAD_MARGIN
from export.names import GENAI_CONFIG_FILE, MODEL_FILE, ROPE_TABLE
from export.onnx_folder import check_external_data, folder_context
from export.providers import CPU, CUDA, CUDA_PROVIDER, load_session, provider_label, session_options
from export.routing import ROUTER_TOLERANCE, RouteFollower
from thinker.modeling_thinker import ThinkerTopKRouter
from thinker_common.errors import ThinkerError

# --- export/routing.py: the follower on a bare router --------------------------------------------------------------


class Routers(torch.nn.Module):
    """Two layers' routers, named as a Thinker model names them (``layers.{i}.mlp.gate``)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for seed in range(2):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.gate = ThinkerTopKRouter(config)
            with torch.no_grad():
                generator = torch.Generator().manual_seed(seed)
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator))
            layer.mlp.gate.weight.requires_grad_(False)
            self.layers.append(layer)


@pytest.fixture
def routers():
    config = make_config("qwen3_moe")  # top 2 of 4 experts, renormalised
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (4, 2, True)
    return Routers(config)


def hidden(tokens: int, size: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(tokens, size, generator=torch.Generator().manual_seed(seed))


def reference_probs(router: ThinkerTopKRouter, states: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.nn.functional.linear(states, router.weight).float(), dim=-1)


def second_and_third_swapped(probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The graph's probabilities: the reference's, with the second and third experts of ``rows`` traded (the graph
    routes those tokens to the reference's third expert in place of its second)."""
    graph = probs.clone()
    for row in rows:
        order = probs[row].argsort(descending=True)
        graph[row, order[1]], graph[row, order[2]] = probs[row, order[2]], probs[row, order[1]]
    return graph


def test_the_follower_takes_the_graphs_experts_at_the_references_weights(routers):
    """A token whose graph picks another second expert is routed to the graph's two experts, weighted by the
    reference's own probabilities of them (renormalised, in the reference's order); the others route as the
    reference does. The figures: one choice followed, and the largest gap between the routers' probabilities."""
    router = routers.layers[0].mlp.gate
    states = hidden(3, router.weight.shape[1])
    probs = reference_probs(router, states)
    graph = second_and_third_swapped(probs, [1])
    follower = RouteFollower(routers, {0: ("probe", True)})
    kept = torch.ones(3, dtype=torch.bool)
    _, weights, experts = follower.routed(router, states, graph, True, kept)
    order = probs.argsort(-1, descending=True)
    assert experts[1].tolist() == [order[1, 0].item(), order[1, 2].item()]  # the graph's experts, the reference's order
    for row in (0, 2):
        assert experts[row].tolist() == order[row, :2].tolist()
    expected = probs.gather(-1, experts)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
    assert follower.followed == 1
    gap = float((probs[1, order[1, 1]] - probs[1, order[1, 2]]).abs())
    assert follower.router_max_abs_diff == pytest.approx(gap, abs=1e-6)
    follower.settle()  # the step's end: no shadow ran, so the gap is held to ROUTER_TOLERANCE as it is
    assert follower.figures() == {
        "routes_followed": 1,
        "router_max_abs_diff": follower.router_max_abs_diff,
        "router_max_abs_diff_beyond_spread": follower.router_max_abs_diff,
        "routers_excused": 0,
    }


def test_a_routers_distance_within_twice_the_shadows_own_is_excused(routers):
    """A shadow run's routers (the half-precision run, the perturbed float32 ones) lie from the reference's as far as
    rounding moves them, token by token; at the step's end a graph router's distance within HALF_SPREAD_MARGIN times
    that is excused, and the rest held to ROUTER_TOLERANCE (a tiny Qwen3-Next's sound float16 graph lay 0.307 from
    the reference at one token where PyTorch's own float16 run lay 0.297: a QA build's refusal)."""
    router = routers.layers[0].mlp.gate
    states = hidden(3, router.weight.shape[1])
    probs = reference_probs(router, states)
    graph = probs.clone()
    graph[1] = probs[1].roll(1)  # far off at tokens 1 and 2
    graph[2] = probs[2].roll(1)
    distance = (graph - probs).abs().amax(-1)
    assert (distance[1:] > ROUTER_TOLERANCE).all(), distance
    follower = RouteFollower(routers, {0: ("probe", True)})
    kept = torch.ones(3, dtype=torch.bool)
    follower.routed(router, states, graph, True, kept)
    follower.recording = False  # a shadow run: token 1's router input moved (negated), tokens 0 and 2 not
    moved = states.clone()
    moved[1] = -states[1]
    follower.routed(router, moved, graph, True, kept)
    shadow = (reference_probs(router, moved) - probs).abs().amax(-1)
    torch.testing.assert_close(follower.router_spreads[0], shadow)
    assert shadow[1] >= distance[1] / HALF_SPREAD_MARGIN and shadow[2] == 0
    follower.recording = True
    follower.settle()
    figures = follower.figures()
    assert figures["routers_excused"] == 1 and figures["router_max_abs_diff"] == pytest.approx(float(distance.max()))
    assert figures["router_max_abs_diff_beyond_spread"] == pytest.approx(float(distance[2]))
    assert figures["router_first_layer_beyond"] == 0  # token 2: nothing moved the shadow's router there
    assert (follower.pending, follower.router_spreads) == ({}, {})  # the next step starts afresh


def test_a_shadow_run_takes_the_routes_but_leaves_the_figures(routers):
    """While a shadow run (the half-precision spread) takes the graph's routes, nothing is counted."""
    router = routers.layers[0].mlp.gate
    states = hidden(3, router.weight.shape[1])
    graph = second_and_third_swapped(reference_probs(router, states), [0, 2])
    follower = RouteFollower(routers, {0: ("probe", True)})
    follower.recording = False
    _, _, experts = follower.routed(router, states, graph, True, torch.ones(3, dtype=torch.bool))
    assert (follower.followed, follower.router_max_abs_diff) == (0, 0.0)
    assert experts.sort(-1).values.tolist() == torch.topk(graph, 2).indices.sort(-1).values.tolist()  # still followed


def test_each_layer_follows_its_own_probe_over_the_kept_tokens_of_each_side(routers):
    """Within ``reference``: layer 1 follows its probe, whose kept tokens (the graph's left-padded rows) are the
    reference's kept tokens (its right-padded rows) in the same order; layer 0, unprobed, routes on its own."""
    assert sorted(RouteFollower(routers, {}).layer_of.values()) == [0, 1]
    gate0, gate1 = (layer.mlp.gate for layer in routers.layers)
    reference_mask = np.array([[1, 1, 0], [1, 1, 1]])
    graph_mask = np.array([[0, 1, 1], [1, 1, 1]])
    states = hidden(6, gate1.weight.shape[1])
    kept = torch.from_numpy(reference_mask.reshape(-1).astype(bool))
    probs = reference_probs(gate1, states)
    swapped = second_and_third_swapped(probs[kept], [0, 3])
    graph = torch.zeros(6, probs.shape[-1])
    graph[torch.from_numpy(graph_mask.reshape(-1).astype(bool))] = swapped
    probed = {"probe1": graph.reshape(2, 3, -1).numpy()}
    follower = RouteFollower(routers, {1: ("probe1", True)})
    with follower.reference(probed, graph_mask, reference_mask):
        _, _, experts1 = gate1(states)
        _, _, experts0 = gate0(states)
    expected = probs.topk(2).indices
    expected[kept] = torch.topk(swapped, 2).indices
    assert experts1.sort(-1).values.tolist() == expected.sort(-1).values.tolist()
    assert experts0.tolist() == reference_probs(gate0, states).topk(2).indices.tolist()
    assert follower.followed == 2
    _, _, again = gate1(states)
    assert again.tolist() == probs.topk(2).indices.tolist()


# --- export/providers.py --------------------------------------------------------------------------------------------


def test_a_load_error_names_the_device_the_session_was_asked_for():
    """The message for a kernel the provider lacks names CUDA whenever the list does (with its options or bare), and
    advises a CPU dtype only for the CPU."""
    assert provider_label([CUDA_PROVIDER, CPU]) == "CUDA"
    assert provider_label([CUDA, CPU]) == "CUDA"
    assert provider_label([CPU]) == "CPU (export float16 or float32 for CPU)"


def bfloat16_matmul() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 2])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x2"], ["y"])], "g", [x], [y])
    graph.input.append(helper.make_tensor_value_info("x2", TensorProto.BFLOAT16, [2, 2]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def test_a_bfloat16_graph_on_the_cpu_is_refused_with_the_dtype_advice(tmp_path):
    path = tmp_path / MODEL_FILE
    with pytest.raises(ThinkerError) as caught:
        load_session(path, bfloat16_matmul(), session_options(1), [CPU])
    message = str(caught.value)
    assert message.startswith(f"{path}: onnxruntime cannot run it on CPU (export float16 or float32 for CPU): ")


def test_undecodable_bytes_in_onnxruntimes_error_are_one_line(tmp_path, monkeypatch):
    """onnxruntime's error for some damaged files quotes bytes Python cannot decode: a UnicodeDecodeError, told as
    a damaged export."""
    import export.providers

    def damaged(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(export.providers.ort, "InferenceSession", damaged)
    path = tmp_path / MODEL_FILE
    with pytest.raises(ThinkerError, match="cannot load it \\(the file is damaged\\); export the model again"):
        load_session(path, b"", session_options(1), [CPU])


def test_a_cuda_session_that_falls_back_to_the_cpu_is_no_cuda(monkeypatch):
    """Where onnxruntime lists CUDA but a CUDA session quietly runs on the CPU (a GPU without its libraries), CUDA is
    not usable: "auto" must not call the CPU a GPU."""
    import export.providers

    class FellBack:
        def __init__(self, source, options, providers):
            self.asked = providers

        def run(self, outputs, feeds):
            return [-feeds["x"]]

        def get_providers(self):
            return [CPU]

    monkeypatch.setattr(export.providers.ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(export.providers.ort, "InferenceSession", FellBack)
    assert export.providers.cuda_usable.__wrapped__() is False
    FellBack.get_providers = lambda self: [CUDA, CPU]
    assert export.providers.cuda_usable.__wrapped__() is True


def test_session_options_default_to_the_physical_cores_and_errors_only():
    from export.providers import physical_cores

    options = session_options()
    assert (options.intra_op_num_threads, options.log_severity_level) == (physical_cores(), 3)
    assert session_options(2).intra_op_num_threads == 2


# --- export/onnx_folder.py ------------------------------------------------------------------------------------------


def graph_with(folder: Path, rows: int | None = 64) -> Path:
    """A model.onnx of one node, holding a RoPE table of ``rows`` rows (none for None)."""
    folder.mkdir(exist_ok=True)
    tables = [numpy_helper.from_array(np.zeros((rows, 4), np.float32), ROPE_TABLE)] if rows else []
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g", [x], [x], tables)
    graph.output[0].name = "y"
    onnx.save(helper.make_model(graph), folder / MODEL_FILE)
    return folder


@pytest.mark.parametrize(
    ("config", "genai", "rows", "expected"),
    [
        (64, None, 64, (64, "max_position_embeddings")),  # the table's own length: the config says it
        (32, None, 64, (32, "max_position_embeddings")),
        (100, None, 64, (64, "the RoPE table rows of model.onnx")),
        (None, 48, 64, (48, f"context_length in {GENAI_CONFIG_FILE}")),
        (None, 64, 64, (64, f"context_length in {GENAI_CONFIG_FILE}")),
        (None, 48, None, (48, f"context_length in {GENAI_CONFIG_FILE}")),  # no table: the file alone
        (None, None, 64, (64, "the RoPE table rows of model.onnx")),
    ],
)
def test_the_folder_context_and_the_key_that_says_so(config, genai, rows, expected, tmp_path):
    folder = graph_with(tmp_path / "onnx", rows)
    if config is not None:
        (folder / "config.json").write_text(json.dumps({"max_position_embeddings": config}))
    if genai is not None:
        (folder / GENAI_CONFIG_FILE).write_text(json.dumps({"model": {"context_length": genai}}))
    assert folder_context(folder) == expected


def test_an_empty_model_file_is_told_from_a_graph_without_nodes(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ThinkerError, match=r"not a readable ONNX model \(the file is empty\); export it again"):
        check_external_data(empty)
    bare = tmp_path / "bare.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [])), bare)
    with pytest.raises(ThinkerError, match=r"not a readable ONNX model \(it holds no graph\); export it again"):
        check_external_data(bare)


# --- export/genai_config.py ----------------------------------------------------------------------------------------


def test_the_search_runs_one_greedy_sequence_by_default():
    """The fixed search keys: one beam, one sequence, no length or diversity penalty, no minimum length (an eos may
    end the first step), so that genai decodes as ``generate()`` does with the folder's defaults."""
    search = make_genai_config(make_config("qwen3"), None)["search"]
    fixed = ("num_beams", "num_return_sequences", "length_penalty", "diversity_penalty", "min_length", "early_stopping")
    assert {key: search[key] for key in fixed} == {
        "num_beams": 1,
        "num_return_sequences": 1,
        "length_penalty": 1.0,
        "diversity_penalty": 0.0,
        "min_length": 0,
        "early_stopping": True,
    }


def test_the_session_runs_on_every_core_of_the_machine_that_runs_it_unless_told():
    options = make_genai_config(make_config("qwen3"), None)["model"]["decoder"]["session_options"]
    assert options == {"log_id": "onnxruntime-genai", "intra_op_num_threads": 0, "provider_options": []}


def test_a_multimodal_type_gets_every_vision_token_id_as_none():
    """The qwen3_5 types' position code scans prompts for the image, video and vision-start ids: each is -1 (none),
    as the pad id 0 they default to would open spans in a padded batch."""
    model = make_genai_config(make_config("qwen3_5"), None, positions="multimodal")["model"]
    assert model["type"] == "qwen3_5_text"
    assert {key: model[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id")} == dict.fromkeys(
        ("image_token_id", "video_token_id", "vision_start_token_id"), -1
    )


def test_a_hybrid_model_names_each_state_for_its_own_kind():
    decoder = make_genai_config(make_config("qwen3_5"), None)["model"]["decoder"]
    assert decoder["inputs"]["past_conv_names"] == "past_key_values.%d.conv_state"
    assert decoder["inputs"]["past_recurrent_names"] == "past_key_values.%d.recurrent_state"
    assert decoder["outputs"]["present_conv_names"] == "present.%d.conv_state"
    assert decoder["outputs"]["present_recurrent_names"] == "present.%d.recurrent_state"


def test_an_eos_of_minus_one_is_no_eos_and_the_report_says_so():
    """-1, a common way to say "none", is outside the vocabulary: genai_config.json stops at the pad id, and the
    note says so (as for an eos left unset or past the vocabulary)."""
    config = make_config("qwen3", eos_token_id=-1, pad_token_id=0, bos_token_id=1)
    assert make_genai_config(config, None)["model"]["eos_token_id"] == 0
    note = no_eos_note(config, None)
    assert note and "within its vocabulary (-1)" in note and "token 0" in note, note
    assert no_eos_note(config, {"eos_token_id": [-1, 2]}) is None  # one id within it is enough


# --- export/continuation.py ----------------------------------------------------------------------------------------


class Negated:
    """An OnnxDecoder whose one-token steps come back negated (their argmax another token than the reference's),
    recording the tokens it is fed."""

    def __init__(self, decoder) -> None:
        self.decoder, self.fed = decoder, []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def decode_one_token(self, token, state):
        self.fed.append(np.asarray(token).tolist())
        return -self.decoder.decode_one_token(token, state)


def test_the_continuation_compares_every_continued_position_and_decodes_the_references_tokens(
    thinker_variant, onnx_variant
):
    """The pass compares each of the continued positions, then each decode step, and feeds both runtimes the
    reference's greedy token (not the graph's); a half-precision MoE graph's routing figures come back with it."""
    from export.continuation import compare_continuation
    from export.routing import ROUTER_TOLERANCE, checked_probes
    from export.runtime import OnnxDecoder
    from thinker import ThinkerForCausalLM
    from thinker_common.parity_inputs import CONTINUATION_DECODE_STEPS, CONTINUATION_LENGTHS

    folder = onnx_variant("qwen3_next", dtype="float16", graph="plain", head_dim=None)
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3_next")).eval()
    decoder = Negated(OnnxDecoder(folder, provider="cpu", probes=checked_probes(folder / MODEL_FILE, torch.float16)))
    added = []
    figures = compare_continuation(model, decoder, lambda reference, candidate, spread: added.append(reference))
    first, then = CONTINUATION_LENGTHS
    assert (figures["prompt_length"], figures["continued_by"]) == (first, then)
    assert [a.shape[0] for a in added] == [then] + [1] * CONTINUATION_DECODE_STEPS
    assert decoder.fed == [[int(a[-1].argmax())] for a in added[:-1]]
    assert 0 < figures["router_max_abs_diff"] <= ROUTER_TOLERANCE and figures["routes_followed"] >= 0, figures


def test_a_boolean_eos_is_no_eos_and_the_report_says_so():
    config = make_config("qwen3", eos_token_id=None, pad_token_id=0, bos_token_id=1)
    assert make_genai_config(config, {"eos_token_id": True})["model"]["eos_token_id"] == 0
    note = no_eos_note(config, {"eos_token_id": True})
    assert note and "token 0" in note, note


def test_a_replayed_shadow_step_gives_back_its_routers_spread(routers):
    """A second graph's comparison of the same steps reads the shadow's spreads back rather than running it again
    (export/half_spread.py ``HalfShadow.rewind``): its routers' spread is read back with them, where the first
    comparison's follower kept it, so the second graph's routers are excused as the first's."""

    class Shadow:  # HalfShadow's bookkeeping alone
        def __init__(self) -> None:
            self.router_spreads, self.step, self.replayed = [], 0, False

        def spread(self, reference_logits, graph_distance=None, **inputs):
            self.step += 1
            self.replayed = self.step <= len(self.router_spreads)
            return np.zeros(1)

    shadow, measured = Shadow(), torch.tensor([0.0, 0.3, 0.01])
    first = RouteFollower(routers, {0: ("probe", True)})
    first.router_spreads = {0: measured}  # what its shadow runs measured during the step
    first.spread(shadow, torch.zeros(1))
    assert shadow.router_spreads == [{0: measured}]
    shadow.step = 0  # rewound
    second = RouteFollower(routers, {0: ("probe", True)})
    second.spread(shadow, torch.zeros(1))
    assert second.router_spreads == {0: measured} and len(shadow.router_spreads) == 1


def far_graph(router: ThinkerTopKRouter, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph's probabilities, every token's far off the reference's (rolled by one expert), and how far."""
    probs = reference_probs(router, states)
    graph = probs.roll(1, dims=-1)
    distance = (graph - probs).abs().amax(-1)
    assert (distance > ROUTER_TOLERANCE).all(), distance
    return graph, distance


def test_the_excuse_is_twice_the_shadows_spread_not_once(routers):
    """Token 0's shadow moved 0.6 of the graph's distance (excused at twice, not at once), token 1's 0.45 (not
    excused: held, and failing), token 2's not at all."""
    router = routers.layers[0].mlp.gate
    states = hidden(3, router.weight.shape[1])
    graph, distance = far_graph(router, states)
    follower = RouteFollower(routers, {0: ("probe", True)})
    follower.routed(router, states, graph, True, torch.ones(3, dtype=torch.bool))
    follower.router_spreads = {0: distance * torch.tensor([0.6, 0.45, 0.0])}
    follower.settle()
    figures = follower.figures()
    assert figures["routers_excused"] == 1
    assert figures["router_max_abs_diff_beyond_spread"] == pytest.approx(float(distance[1:].max()))


def test_the_shadows_spread_is_the_furthest_of_its_runs(routers):
    """Two shadow runs of a step (the half run, a perturbed one), each moving another token's router: the spread
    is the furthest at each token, not the last run's or the nearest."""
    router = routers.layers[0].mlp.gate
    states = hidden(3, router.weight.shape[1])
    graph, _ = far_graph(router, states)
    follower = RouteFollower(routers, {0: ("probe", True)})
    kept = torch.ones(3, dtype=torch.bool)
    follower.routed(router, states, graph, True, kept)
    follower.recording = False
    first, second = states.clone(), states.clone()
    first[1], second[2] = -states[1], -states[2]
    follower.routed(router, first, graph, True, kept)
    follower.routed(router, second, graph, True, kept)
    probs = reference_probs(router, states)
    moved = [(reference_probs(router, run) - probs).abs().amax(-1) for run in (first, second)]
    torch.testing.assert_close(follower.router_spreads[0], torch.maximum(*moved))


def test_an_excused_layer_is_not_named_and_the_furthest_step_beyond_is_kept(routers):
    """Layer 0 far off but excused, layer 1 beyond at 0.3, then quieter steps: the failure names layer 1, at 0.3."""
    follower = RouteFollower(routers, {0: ("probe", True), 1: ("probe", True)})
    follower.pending = {0: (None, torch.tensor([0.5])), 1: (None, torch.tensor([0.3]))}
    follower.router_spreads = {0: torch.tensor([0.3])}
    follower.settle()
    for quiet in (0.01, 0.02):
        follower.pending = {layer: (None, torch.tensor([quiet])) for layer in (1, 0)}
        follower.settle()
    figures = follower.figures()
    assert figures["router_first_layer_beyond"] == 1
    assert figures["router_max_abs_diff_beyond_spread"] == pytest.approx(0.3)
    assert figures["routers_excused"] == 1
