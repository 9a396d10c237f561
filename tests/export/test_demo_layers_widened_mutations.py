"""Behaviour of export/demo.py, export/layer_models.py and export/widened.py that a mutation run found unchecked:
the figures and folders ``thinker demo`` prints, the advice its context refusal gives at each boundary, the
refusals it makes before any work, the one-layer model's folder, and the widened copy's weights file."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from thinker_common.cli import main
from thinker_common.errors import ThinkerError

PROMPT = "The capital of France is"  # 5 tokens for SmolLM2's tokenizer (tests/test_demo.py)


# --- thinker demo: what run_demo prints and where it generates, its slow steps replaced ----------------------------
@pytest.fixture
def fake_steps(monkeypatch):
    """The conversion and the export replaced by stand-ins that write nothing and report fixed figures; the GGUF is
    the real SmolLM2 one (its context is read off it). Records each call."""
    calls = SimpleNamespace(convert=[], export=[], generate=[])

    def convert(source, output, **options):
        calls.convert.append((Path(source), Path(output), options))
        return SimpleNamespace(parity=SimpleNamespace(table=lambda: "PARITY TABLE"))

    def export_model(folder, output, **options):
        calls.export.append((Path(folder), Path(output), options))
        return {"verify": {"max_abs_diff": 3.25e-5, "tolerance": 1e-4}, "nodes": 321, "export_seconds": 4.56}

    def generate(folder, prompt, tokens):
        calls.generate.append((Path(folder), prompt, tokens))
        print(" Paris.")

    monkeypatch.setattr("converter.convert.convert", convert)
    monkeypatch.setattr("export.exporter.export_model", export_model)
    calls.generate_function = generate
    return calls


def test_the_demo_prints_its_figures_and_runs_step_4_on_the_onnx_folder(fake_steps, tmp_path, capsys):
    """Step 3's line gives max |Δlogit| and the tolerance each in its place; step 2 continues with the Thinker folder
    and step 4 with the ONNX folder, both with the -n asked for (step 4 on the Thinker folder printed the same answer
    twice and ran no onnxruntime); the work folder is made with its parents."""
    from converter.families.gguf import smollm2_gguf_path
    from export.demo import run_demo

    workdir = tmp_path / "a" / "b" / "demo"  # its parents do not exist yet
    run_demo(workdir, PROMPT, 7, fake_steps.generate_function)
    thinker_dir, onnx_dir = workdir / "smollm2-135m-thinker", workdir / "smollm2-135m-onnx"
    assert [call[:2] for call in fake_steps.convert] == [(smollm2_gguf_path(), thinker_dir)]
    assert fake_steps.convert[0][2]["verify"] is True
    assert [call[:2] for call in fake_steps.export] == [(thinker_dir, onnx_dir)]
    assert fake_steps.export[0][2]["verify"] is True and fake_steps.export[0][2]["dtype"] == "float32"
    assert fake_steps.generate == [(thinker_dir, PROMPT, 7), (onnx_dir, PROMPT, 7)]
    out, err = capsys.readouterr()
    assert "PARITY TABLE\n" in out
    assert (
        "onnxruntime vs PyTorch, prefill + decode on a left-padded batch: max |Δlogit| 3.25e-05 (tolerance 1.0e-04), "
        "321 nodes, 4.6 s\n"
    ) in out
    assert out.count(f"{PROMPT} Paris.\n") == 2
    assert f"[2/4] generate with transformers from {thinker_dir}" in err
    assert f"[4/4] generate with onnxruntime from {onnx_dir}" in err


def test_the_next_steps_name_each_folder_under_its_own_label(tmp_path):
    """The Thinker folder is the one transformers loads and the ONNX folder the one onnxruntime runs: each under its
    label, and the Python line loads the Thinker folder (the ONNX folder has no PyTorch weights)."""
    from export.demo import next_steps

    thinker_dir, onnx_dir = tmp_path / "thinker", tmp_path / "onnx"
    lines = next_steps(Path("/models/smollm2.gguf"), thinker_dir, onnx_dir).splitlines()
    assert f"  Thinker folder (transformers):                {thinker_dir}" in lines
    assert f"  ONNX folder (onnxruntime, onnxruntime-genai): {onnx_dir}" in lines
    python = [line for line in lines if "from_pretrained" in line]
    assert python == [
        f"  in Python, after `import thinker`: AutoModelForCausalLM.from_pretrained({str(thinker_dir)!r})"
    ]


# --- thinker demo: refusals before any work -------------------------------------------------------------------------
@pytest.fixture
def no_conversion(monkeypatch):
    """A refusal before step 1 is the test's point: a demo that reaches its conversion fails at once (not after
    the minute the real one takes)."""

    def convert(*args, **kwargs):
        raise AssertionError("the demo reached its conversion")

    monkeypatch.setattr("converter.convert.convert", convert)


def test_a_blank_prompt_is_refused_as_empty(no_conversion, tmp_path):
    """Spaces alone are no text to continue: refused as the empty prompt is, before the work folder is made."""
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "work"), "--prompt", "   "])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "--prompt is empty; give the text the demo continues, or leave --prompt out" in result.output
    assert "[1/4]" not in result.output and not (tmp_path / "work").exists()


def test_a_thinker_folder_of_the_users_is_refused_before_the_conversion(no_conversion, tmp_path):
    """The demo's Thinker folder, as its ONNX folder (tests/test_demo.py): a folder of the user's there is refused in
    the demo's terms before step 1, untouched."""
    mine = tmp_path / "work" / "smollm2-135m-thinker"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (
        f"--workdir {tmp_path / 'work'}: smollm2-135m-thinker there is not one of the demo's folders "
        "(no README.md model card of thinker's), which a run replaces; pass another --workdir"
    ) in result.output
    assert "[1/4]" not in result.output
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


TOKENIZERS: dict = {}  # AutoTokenizer.from_pretrained's answers in this module, by its arguments


@pytest.fixture
def check_context(monkeypatch):
    """``_check_context`` on the real SmolLM2 GGUF, its tokenizer built once for the module's cases (seconds each)."""
    from transformers import AutoTokenizer

    from converter.families.gguf import smollm2_gguf_path
    from export.demo import _check_context

    original = AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in TOKENIZERS:
            TOKENIZERS[key] = original(*args, **kwargs)
        return TOKENIZERS[key]

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    return functools.partial(_check_context, smollm2_gguf_path())


@pytest.mark.parametrize(
    ("max_new_tokens", "context", "advice"),
    [
        # the prompt fills the context: one new token fits (its last is never fed back)
        (2, 5, "needs 6 positions, beyond SmolLM2's context of 5; ask for at most -n 1"),
        # the prompt alone is one past the context: no -n fits, and -n 1 cannot be lowered
        (1, 4, "needs 5 positions, beyond SmolLM2's context of 4; shorten the prompt to at most 4 tokens"),
        (2, 4, "needs 6 positions, beyond SmolLM2's context of 4; shorten the prompt to at most 3 tokens or lower -n"),
        # -n takes the whole context: a prompt of one token still fits beside it
        (4, 4, "needs 8 positions, beyond SmolLM2's context of 4; shorten the prompt to at most 1 tokens or lower -n"),
        (
            5,
            4,
            "needs 9 positions, beyond SmolLM2's context of 4; lower -n to at most 4 and shorten the prompt to fit"
            " beside it",
        ),
    ],
)
def test_the_context_refusal_advises_what_fits_at_each_boundary(check_context, max_new_tokens, context, advice):
    """The advice at the edges between its three kinds, on a context made small enough to reach them with the
    5-token prompt: each is the most that fits, and the message ends there."""
    with pytest.raises(ThinkerError) as refused:
        check_context(PROMPT, max_new_tokens, context)
    message = str(refused.value)
    assert message.startswith(f"--prompt is 5 tokens, and with -n {max_new_tokens} that ")
    assert message.endswith(advice), message


def test_a_prompt_of_more_tokens_than_characters_is_counted_in_tokens(check_context):
    """Three parrots are 3 characters, 12 bytes and 9 tokens: the quick bound counts bytes (a token holds at least
    one), so the prompt is tokenized and -n 8190 refused, as step 2 would refuse it after the conversion."""
    with pytest.raises(ThinkerError) as refused:
        check_context("\U0001f99c" * 3, 8190, 8192)
    assert str(refused.value) == (
        "--prompt is 9 tokens, and with -n 8190 that needs 8198 positions, beyond SmolLM2's context of 8192; "
        "ask for at most -n 8184"
    )


# --- export/layer_models.py: one Gated DeltaNet layer as a model ------------------------------------------------------
def test_a_layer_model_goes_into_a_new_folder_with_the_hybrid_io_names_and_types(tmp_path):
    """The folder is made with its parents (bench/bench_linear_attention.py names one); a float16 layer takes and
    gives its conv state in float16 and its recurrent state in float32, as the module's docstring lists."""
    import onnx
    import torch
    from onnx import TensorProto
    from test_linear_attention_graph import gated_deltanet, linear_config

    from export.layer_models import write_gated_deltanet_model
    from export.linear_attention_graph import GatedDeltaNetDims

    config = linear_config()
    dims = GatedDeltaNetDims.from_config(config)
    params = dict(gated_deltanet(config).named_parameters())
    folder = tmp_path / "layers" / "layer-0"
    path = write_gated_deltanet_model(folder, dims, params, dtype=torch.float16)
    assert path == folder / "model.onnx"
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "model.onnx.data"]
    graph = onnx.load(str(path)).graph
    half, single, int64 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT64
    assert [(v.name, v.type.tensor_type.elem_type) for v in graph.input] == [
        ("hidden_states", half),
        ("attention_mask", int64),
        ("past_key_values.0.conv_state", half),
        ("past_key_values.0.recurrent_state", single),
    ]
    assert [(v.name, v.type.tensor_type.elem_type) for v in graph.output] == [
        ("output", half),
        ("present.0.conv_state", half),
        ("present.0.recurrent_state", single),
    ]


@pytest.mark.parametrize("form", ["plain", "fused"])
def test_a_layer_model_imports_the_operator_sets_it_uses(form, tmp_path):
    """The fused form runs onnxruntime's com.microsoft LinearAttention, so its model imports that domain (onnxruntime
    forgives the omission; onnx's checker and other runtimes do not); the plain form imports the standard set alone."""
    import onnx
    from test_linear_attention_graph import FORMS, gated_deltanet, linear_config

    from export.graph_walk import all_nodes
    from export.layer_models import write_gated_deltanet_model
    from export.linear_attention_graph import GatedDeltaNetDims

    config = linear_config()
    params = dict(gated_deltanet(config).named_parameters())
    path = write_gated_deltanet_model(tmp_path, GatedDeltaNetDims.from_config(config), params, graph_class=FORMS[form])
    model = onnx.load(str(path), load_external_data=False)
    used = {node.domain for node in all_nodes(model.graph)}
    imported = {opset.domain: opset.version for opset in model.opset_import}
    assert used <= set(imported), (used, imported)
    assert sorted(imported) == (["", "com.microsoft"] if form == "fused" else [""])


# --- export/widened.py: the float32 copy's weights file ------------------------------------------------------------
def test_the_widened_weights_are_aligned_and_packed(onnx_variant, tmp_path):
    """The copy holds every file of the export. Each of its tensors starts on a 64-byte boundary (onnxruntime maps
    the file; onnx's own writer aligns so), holds 4 bytes a value, and the file is those tensors and their padding
    alone: each tensor written once, though both graphs read it."""
    import numpy as np
    import onnx
    from onnx import TensorProto

    from export.graph_walk import all_graphs
    from export.widened import widened_folder

    shipped = onnx_variant("qwen3", "bfloat16", head_dim=16)
    widened_folder(shipped, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in shipped.iterdir())
    places = set()
    for name in ("model.onnx", "model.genai.onnx"):
        for body in all_graphs(onnx.load(tmp_path / name, load_external_data=False).graph):
            for tensor in body.initializer:
                if tensor.data_location == TensorProto.EXTERNAL:
                    entry = {item.key: item.value for item in tensor.external_data}
                    assert entry["location"] == "model.onnx.data"
                    offset, length = int(entry["offset"]), int(entry["length"])
                    assert offset % 64 == 0, (tensor.name, offset)
                    assert length == 4 * int(np.prod(tensor.dims)), tensor.name
                    places.add((offset, length))
    spans = sorted(places)
    assert len(spans) > 10
    for (offset, length), (following, _) in zip(spans, spans[1:], strict=False):
        assert offset + length <= following < offset + length + 64, (offset, length, following)
    assert spans[0][0] == 0
    assert (tmp_path / "model.onnx.data").stat().st_size == spans[-1][0] + spans[-1][1]


def test_widen_graph_makes_every_kind_of_bfloat16_float32():
    """What the module's docstring lists, each in a graph made by hand (a tiny export holds no Constant node, no
    value_info and no weight without an offset, so the export tests do not reach them): an external weight pointed at
    its new place (an absent offset read as 0), inline weights of raw bytes and of onnx's int32 bit patterns, a
    Constant node's value, a cast's and a generator's target type, a value's type; a replacement of another size is
    not taken, a cast to another type is left."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from export.widened import widen_graph

    bf16 = TensorProto.BFLOAT16
    external = helper.make_tensor("external", bf16, [4], vals=b"\0" * 8, raw=True)
    external.ClearField("raw_data")
    external.data_location = TensorProto.EXTERNAL
    external.external_data.add(key="location", value="model.onnx.data")
    external.external_data.add(key="length", value="8")
    bits = helper.make_tensor("bits", bf16, [2], [1.5, -2.0])  # onnx's int32 field of bit patterns
    raw = numpy_helper.from_array(np.array([0x3F80, 0xC040], np.uint16), "raw")  # 1.0, -3.0 as raw bytes
    raw.data_type = bf16
    table = helper.make_tensor("table", bf16, [3], [0.5, 0.25, 0.125])
    constant = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("value", bf16, [1], [0.75]))
    nodes = [
        constant,
        helper.make_node("EyeLike", ["bits"], ["eye"], dtype=bf16),
        helper.make_node("Cast", ["eye"], ["to_bf16"], to=bf16),
        helper.make_node("Cast", ["eye"], ["to_int"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", bf16, [2])],
        [helper.make_tensor_value_info("to_bf16", bf16, [2, 2])],
        [external, bits, raw, table],
        value_info=[helper.make_tensor_value_info("eye", bf16, [2, 2])],
    )
    replaced = {"bits": np.array([7.0, 8.0], np.float32), "table": np.array([9.0, 9.0], np.float32)}
    widen_graph(graph, {("model.onnx.data", 0): (64, 16)}, replaced)

    tensors = {t.name: t for t in graph.initializer}
    assert tensors["external"].data_type == TensorProto.FLOAT
    assert {e.key: e.value for e in tensors["external"].external_data} == {
        "location": "model.onnx.data",
        "offset": "64",
        "length": "16",
    }
    np.testing.assert_array_equal(numpy_helper.to_array(tensors["bits"]), [7.0, 8.0])  # replaced: the same size
    np.testing.assert_array_equal(numpy_helper.to_array(tensors["raw"]), [1.0, -3.0])
    np.testing.assert_array_equal(numpy_helper.to_array(tensors["table"]), [0.5, 0.25, 0.125])  # 2 values for 3
    assert all(t.data_type == TensorProto.FLOAT for t in graph.initializer)
    value = graph.node[0].attribute[0].t
    assert value.data_type == TensorProto.FLOAT and numpy_helper.to_array(value).tolist() == [0.75]
    assert [attribute.i for node in graph.node[1:] for attribute in node.attribute] == [
        TensorProto.FLOAT,
        TensorProto.FLOAT,
        TensorProto.INT64,
    ]
    types = [v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)]
    assert types == [TensorProto.FLOAT] * 3


def test_the_widened_weights_file_aligns_each_tensor_and_writes_a_shared_one_once(tmp_path):
    """Tensors whose widened sizes are not multiples of 64 bytes (a tiny export's all are): each starts on a 64-byte
    boundary; two names at one offset (tied weights) are one tensor, written once; a float32 tensor is copied as it
    is, or replaced by values of its size."""
    import numpy as np
    from onnx import TensorProto

    from export.widened import Span, write_widened_data

    source, into = tmp_path / "export", tmp_path / "copy"
    source.mkdir()
    into.mkdir()
    bf16 = np.array([0x3F80, 0xC040, 0x4000], np.uint16).tobytes()  # 1.0, -3.0, 2.0
    single = np.array([0.5, 4.0], np.float32).tobytes()
    (source / "w.data").write_bytes(bf16 + b"\0" * 10 + single + single)
    spans = sorted(
        [
            Span("w.data", 0, 6, TensorProto.BFLOAT16, "embed"),
            Span("w.data", 0, 6, TensorProto.BFLOAT16, "lm_head"),  # tied to embed
            Span("w.data", 16, 8, TensorProto.FLOAT, "norm"),
            Span("w.data", 24, 8, TensorProto.FLOAT, "table"),
        ]
    )
    moved = write_widened_data(source, into, spans, {"table": np.array([7.0, 8.0], np.float32)})
    assert moved == {("w.data", 0): (0, 12), ("w.data", 16): (64, 8), ("w.data", 24): (128, 8)}
    data = (into / "w.data").read_bytes()
    assert len(data) == 136
    np.testing.assert_array_equal(np.frombuffer(data[:12], np.float32), [1.0, -3.0, 2.0])
    assert data[12:64] == b"\0" * 52 and data[72:128] == b"\0" * 56
    np.testing.assert_array_equal(np.frombuffer(data[64:72], np.float32), [0.5, 4.0])
    np.testing.assert_array_equal(np.frombuffer(data[128:], np.float32), [7.0, 8.0])
