"""The export's folder-level checks and small helpers, held directly (a mutation run found each of these changeable
without a failing test): what ``thinker generate`` stops at (export/stop_tokens.py), the structural and context
checks before an export (export/folder_check.py), ``--verify``'s reading of genai_config.json against its graph
(export/genai_config_check.py), of the shipped RoPE tables and attention windows (export/beyond_prompts.py), the
quantized size's arithmetic (export/quantized_size.py), the weights stamp's refusal (export/weights_stamp.py), and
the BOS note for onnxruntime-genai (export/leading_tokens.py)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import onnx
import pytest
import torch
from export_helpers import make_config
from onnx import TensorProto, helper

from export.beyond_prompts import attention_window_check, rope_table_check
from export.decoder_graph import rope_table_bytes, rope_tables
from export.folder_check import check_decodable
from export.genai_config import make_genai_config
from export.genai_config_check import genai_config_failures
from export.leading_tokens import prefix_note
from export.names import ROPE_SIN_TABLE, ROPE_TABLE
from export.quantize import QuantizeSpec
from export.quantized_size import projection_bytes
from export.stop_tokens import folder_stop_tokens
from export.weights_stamp import PAGE, check_weights_stamp, stamp_weights
from thinker_common.errors import ThinkerError


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


# --- export/stop_tokens.py: what `thinker generate` stops and pads at -------------------------------------------------


def test_another_exporters_folder_stops_at_its_genai_config_ids(tmp_path):
    """A folder with neither generation_config.json nor config.json: genai_config.json's eos ids (a list kept whole,
    one id made a list) and its pad id, each from its own key."""
    write_json(tmp_path / "genai_config.json", {"model": {"eos_token_id": [5, 7], "pad_token_id": 3}})
    assert folder_stop_tokens(tmp_path) == ([5, 7], 3)
    write_json(tmp_path / "genai_config.json", {"model": {"eos_token_id": 5, "pad_token_id": 3}})
    assert folder_stop_tokens(tmp_path) == ([5], 3)
    write_json(tmp_path / "genai_config.json", {"model": {"eos_token_id": 5}})
    with pytest.raises(ThinkerError) as refused:
        folder_stop_tokens(tmp_path)
    said = "no model.eos_token_id or pad_token_id; export again"
    assert str(refused.value) == f"{tmp_path / 'genai_config.json'}: {said}"


def test_the_models_own_files_come_before_genai_config(tmp_path):
    """genai_config.json's eos is the pad id where the model names none: the model's own files decide, and
    generation_config.json whole (no eos there is none, whatever config.json names)."""
    write_json(tmp_path / "genai_config.json", {"model": {"eos_token_id": 0, "pad_token_id": 0}})
    write_json(tmp_path / "config.json", {"eos_token_id": [2, 9], "pad_token_id": 4})
    assert folder_stop_tokens(tmp_path) == ([2, 9], 4)
    write_json(tmp_path / "generation_config.json", {"pad_token_id": 3})
    assert folder_stop_tokens(tmp_path) == (None, 3)


@pytest.mark.parametrize(
    ("written", "expected"),
    [({"eos_token_id": 0, "pad_token_id": 0}, ([0], 0)), ({"eos_token_id": [0, 2]}, ([0, 2], None))],
    ids=["zero", "list-with-zero"],
)
def test_token_zero_is_a_token_id(written, expected, tmp_path):
    write_json(tmp_path / "generation_config.json", written)
    assert folder_stop_tokens(tmp_path) == expected


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("eos_token_id", True, "eos_token_id=True; expected a token id or a list of them"),
        ("eos_token_id", [2, -1], "eos_token_id=[2, -1]; expected a token id or a list of them"),
        ("pad_token_id", False, "pad_token_id=False; expected a token id"),
        ("pad_token_id", -1, "pad_token_id=-1; expected a token id"),
    ],
)
def test_a_stop_token_that_is_no_id_is_refused_naming_its_file(key, value, said, tmp_path):
    """JSON's true is an int to Python: no token id, as a negative one is none."""
    path = write_json(tmp_path / "generation_config.json", {"eos_token_id": 2, "pad_token_id": 0, key: value})
    with pytest.raises(ThinkerError) as refused:
        folder_stop_tokens(tmp_path)
    assert str(refused.value) == f"{path}: {said} (whole numbers, 0 or more)"


# --- export/leading_tokens.py -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [[1], [1, 7]])
def test_the_note_names_every_prefix_to_put_back(prefix):
    note = prefix_note(prefix)
    assert note is not None and f"transformers' tokenizer puts {prefix} in front of every prompt" in note
    assert "put it back in front of the ids it encodes" in note
    assert prefix_note([]) is None


# --- export/folder_check.py ---------------------------------------------------------------------------------------


def test_indexed_attention_layers_count_the_context():
    """Qwen3.8's indexed_attention layers are attention layers: its PyTorch Thinker decodes; linear layers alone
    are refused, naming the file, the layers and the consequence given."""
    config = make_config("qwen4_exp")
    check_decodable(config, Path("folder/config.json"), "never said")
    linear = make_config("qwen3_5", layer_types=["linear_attention"] * 4)
    with pytest.raises(ThinkerError) as refused:
        check_decodable(linear, Path("folder/config.json"), "export with --no-verify")
    said = str(refused.value)
    assert said.startswith("folder/config.json: layer_types has no full_attention layer (4 x linear_attention)")
    assert said.endswith("; export with --no-verify")


def test_the_context_check_refuses_from_one_position_short(monkeypatch):
    """--verify needs the longest prompt and its decode steps: exactly that many positions pass, one fewer is refused;
    --no-verify runs no prompt and refuses neither."""
    from export.folder_check import _check_context
    from export.verify import DECODE_STEPS
    from thinker_common.parity_inputs import PROMPT_LENGTHS

    needed = max(PROMPT_LENGTHS) + DECODE_STEPS
    path = Path("folder/config.json")
    _check_context(make_config("qwen3", max_position_embeddings=needed), path, torch.float32, verify=True)
    short = make_config("qwen3", max_position_embeddings=needed - 1)
    _check_context(short, path, torch.float32, verify=False)
    with pytest.raises(ThinkerError, match=f"max_position_embeddings={needed - 1} is fewer positions than --verify"):
        _check_context(short, path, torch.float32, verify=True)


def test_rope_tables_that_just_fit_in_memory_pass(monkeypatch):
    """The tables' bytes against the memory available: equal passes, one byte more than available is refused."""
    import psutil

    from export.folder_check import _check_context

    config = make_config("qwen3", max_position_embeddings=4096)
    table = rope_table_bytes(config, torch.float32)
    assert table == 2 * 4096 * (12 // 2) * 4  # two tables, a row per position, half the head_dim each, float32
    memory = collections.namedtuple("memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=table, total=2 * table))
    _check_context(config, Path("folder/config.json"), torch.float32, verify=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(available=table - 1, total=2 * table))
    with pytest.raises(ThinkerError, match="a context of 4096 positions .* more than the .* of memory available"):
        _check_context(config, Path("folder/config.json"), torch.float32, verify=False)


def audio_and_talker_folder(tmp_path: Path) -> tuple[Path, Path, dict]:
    from export_helpers import save_thinker
    from safetensors.torch import load_file

    folder = save_thinker(tmp_path / "thinker", "qwen3", tokenizer=False, audio_embed_size=24, talker_head_size=40)
    (weights,) = folder.glob("*.safetensors")
    return folder, weights, load_file(weights)


def test_the_parts_the_export_leaves_out_are_checked_as_any_other(tmp_path):
    from safetensors.torch import save_file

    from export.folder_check import check_thinker_weights
    from thinker.configuration_thinker import ThinkerConfig

    folder, weights, tensors = audio_and_talker_folder(tmp_path)
    config = ThinkerConfig.from_pretrained(folder)
    assert {"model.audio_proj.weight", "talker_head.weight"} <= set(tensors)
    check_thinker_weights(folder, config)
    save_file({name: t for name, t in tensors.items() if name != "model.norm.weight"}, weights)
    with pytest.raises(ThinkerError, match="the weights do not fit config.json: the folder lacks model.norm.weight"):
        check_thinker_weights(folder, config)


def test_the_parts_the_export_leaves_out_may_be_missing(tmp_path):
    """A folder whose config.json names an audio projection and a talker head (parts the graph leaves out) without
    their tensors exports: they are neither required nor refused, where a missing part of the decoder still is."""
    from cli_helpers import thinker
    from safetensors.torch import save_file

    from export.folder_check import check_thinker_weights
    from thinker.configuration_thinker import ThinkerConfig

    folder, weights, tensors = audio_and_talker_folder(tmp_path)
    kept = {name: t for name, t in tensors.items() if not name.startswith(("model.audio_proj.", "talker_head."))}
    save_file(kept, weights)
    result = thinker("export", folder, tmp_path / "onnx", "--no-verify")
    assert result.exit_code == 0, result.output
    # present, they are held to their shapes (the export's verify loads them with transformers)
    save_file(kept | {"talker_head.weight": torch.zeros(41, tensors["talker_head.weight"].shape[1])}, weights)
    with pytest.raises(ThinkerError, match=r"give[s]? talker_head\.weight the shape \(40, 32\), but the folder holds"):
        check_thinker_weights(folder, ThinkerConfig.from_pretrained(folder))
    save_file({name: t for name, t in kept.items() if name != "model.norm.weight"}, weights)
    with pytest.raises(ThinkerError, match=r"the folder lacks model\.norm\.weight \(1 in all\)"):
        check_thinker_weights(folder, ThinkerConfig.from_pretrained(folder))


# --- export/genai_config_check.py ---------------------------------------------------------------------------------


def genai_folder(folder: Path, config, kv_layers=None, unshared=(), genai_edit=None) -> Path:
    """A folder holding genai_config.json as the export writes it for ``config``, and a model.onnx (never run: only
    read for its names) with every input and output it names, the ``%d`` ones for ``kv_layers`` (default: every
    layer), and a GroupQueryAttention per KV layer that writes its past in place, except the pasts in ``unshared``,
    which another node reads too."""
    genai = make_genai_config(config, None, share_buffer=True)
    if genai_edit:
        genai_edit(genai)
    decoder = genai["model"]["decoder"]
    layers = range(config.num_hidden_layers) if kv_layers is None else kv_layers
    values = {}
    for section in ("inputs", "outputs"):
        names = []
        for name in decoder[section].values():
            names += [name % layer for layer in layers] if "%d" in name else [name]
        values[section] = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    nodes = []
    for layer in layers:
        past = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        present = [f"present.{layer}.key", f"present.{layer}.value"]
        nodes.append(helper.make_node("GroupQueryAttention", ["q", "k", "v", *past], ["out", *present]))
    nodes += [helper.make_node("Identity", [name], [f"{name}/read"]) for name in unshared]
    graph = helper.make_graph(nodes, "names", values["inputs"], values["outputs"])
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    write_json(folder / "genai_config.json", genai)
    return folder


def test_a_sound_genai_config_has_no_failures(tmp_path):
    """As written, on a graph with every name it gives: nothing said. A hybrid's KV names exist for its attention
    layers only (a name is one of the graph's where any layer has it)."""
    assert genai_config_failures(genai_folder(tmp_path, make_config("qwen3")), make_config("qwen3"), 64) == []
    hybrid = make_config("qwen3_5")
    (tmp_path / "hybrid").mkdir()
    folder = genai_folder(tmp_path / "hybrid", hybrid, kv_layers=[1, 3])
    assert genai_config_failures(folder, hybrid, 128) == []


@pytest.mark.parametrize(
    ("key", "attribute"),
    [
        ("head_size", "head_dim"),
        ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_key_value_heads"),
        ("num_hidden_layers", "num_hidden_layers"),
    ],
)
def test_each_size_genai_allocates_by_is_the_models(key, attribute, tmp_path):
    config = make_config("qwen3")
    wrong = getattr(config, attribute) + 1
    folder = genai_folder(tmp_path, config, genai_edit=lambda genai: genai["model"]["decoder"].update({key: wrong}))
    assert genai_config_failures(folder, config, 64) == [
        f"genai_config.json: model.decoder.{key} is {wrong}, the model's {attribute} {getattr(config, attribute)}"
    ]


def test_the_context_and_the_longest_search_may_reach_the_graphs_rows(tmp_path):
    """Boundaries both: a context of exactly the table's rows, a max_length of exactly the context."""
    config = make_config("qwen3")

    def edit(genai):
        genai["model"]["context_length"], genai["search"]["max_length"] = 50, 50

    assert genai_config_failures(genai_folder(tmp_path, config, genai_edit=edit), config, 50) == []


@pytest.mark.parametrize("past", ["past_key_values.1.key", "past_key_values.2.value"])
def test_one_past_that_cannot_be_written_in_place_refuses_the_shared_buffer(past, tmp_path):
    """A key or a value, of one layer only: onnxruntime-genai would share that buffer too."""
    config = make_config("qwen3")
    folder = genai_folder(tmp_path, config, unshared=[past])
    assert genai_config_failures(folder, config, 64) == [
        f"genai_config.json: search.past_present_share_buffer is true, but model.onnx cannot write {past} in place "
        "(only GroupQueryAttention's own past can be)"
    ]


@pytest.mark.parametrize(
    ("present_key", "wrong"),
    [("present_key_names", "present.%d.value"), ("present_value_names", "present.%d.key")],
)
def test_a_present_named_for_the_other_state_is_refused(present_key, wrong, tmp_path):
    """One of the pair miswritten (both still name outputs of the graph): genai would feed a layer's values back
    as its keys, or its keys as its values."""
    config = make_config("qwen3")
    past_key = {"present_key_names": "past_key_names", "present_value_names": "past_value_names"}[present_key]
    past = {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}[past_key]

    def edit(genai):
        genai["model"]["decoder"]["outputs"][present_key] = wrong

    folder = genai_folder(tmp_path, config, genai_edit=edit)
    expected = past.replace("past_key_values.", "present.")
    assert genai_config_failures(folder, config, 64) == [
        f"genai_config.json: model.decoder.outputs.{present_key} is {wrong!r}, where the graph's present of "
        f"inputs.{past_key} {past!r} is {expected!r}"
    ]


# --- export/beyond_prompts.py -------------------------------------------------------------------------------------

PADDING = 96  # bytes before the tables in the weights file, as another initializer's would be


def rope_graph(folder: Path, config, edit_sin=None, sin_length=None) -> Path:
    """model.onnx whose two RoPE tables lie in model.onnx.data after PADDING bytes of another tensor, as the export
    writes them; ``edit_sin(table)`` changes the sin table before it is written, ``sin_length`` its recorded length."""
    cos, sin = (table.contiguous() for table in rope_tables(config, torch.float32))
    if edit_sin:
        sin = sin.clone()
        edit_sin(sin)
    blobs = [bytes(range(PADDING)), cos.numpy().tobytes(), sin.numpy().tobytes()]
    (folder / "model.onnx.data").write_bytes(b"".join(blobs))
    initializers = []
    for name, table, offset, blob in ((ROPE_TABLE, cos, PADDING, blobs[1]), (ROPE_SIN_TABLE, sin, None, blobs[2])):
        offset = PADDING + len(blobs[1]) if offset is None else offset
        length = sin_length if name == ROPE_SIN_TABLE and sin_length is not None else len(blob)
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(table.shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "model.onnx.data"), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        initializers.append(tensor)
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Identity", [ROPE_TABLE], ["out"])], "rope", [], [out], initializers)
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    return folder / "model.onnx"


def test_the_shipped_tables_are_read_at_their_offset(tmp_path):
    config = make_config("qwen3")
    assert rope_table_check(rope_graph(tmp_path, config), config, torch.float32) == ({"rows": 64, "equal": True}, None)


def test_a_sin_row_changed_is_named_by_its_first_position(tmp_path):
    """Both tables are held to the model's, the sin one too; the failure names the first row that differs."""
    config = make_config("qwen3")

    def edit(sin):
        sin[50] += 0.5
        sin[40, 0] *= 0.9

    figures, failure = rope_table_check(rope_graph(tmp_path, config, edit_sin=edit), config, torch.float32)
    assert failure == f"{ROPE_SIN_TABLE} differs from the model's rotary embedding from position 40 on"
    assert figures == {"rows": 64, f"{ROPE_SIN_TABLE} first differing position": 40, "equal": False}


def test_a_table_of_another_length_is_said_not_raised(tmp_path):
    config = make_config("qwen3")
    want = 64 * 6 * 4  # rows x (head_dim 12 / 2) x float32
    figures, failure = rope_table_check(rope_graph(tmp_path, config, sin_length=want - 4), config, torch.float32)
    assert failure == f"{ROPE_SIN_TABLE} holds {want - 4} bytes where the model's has {want}"
    assert figures["equal"] is False


@pytest.mark.parametrize("window", [-1, 8, 4096])
def test_any_attention_window_is_a_fault(window, tmp_path):
    attributes = {} if window == -1 else {"local_window_size": window}
    node = helper.make_node("GroupQueryAttention", ["q"], ["out"], name="/model/layers.0/attn/GQA", **attributes)
    graph = helper.make_graph([node], "window", [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    said = attention_window_check(tmp_path / "model.onnx")
    if window == -1:
        assert said is None
    else:
        assert said == (
            f"model.onnx: /model/layers.0/attn/GQA attends to a window of its last {window} keys, where the model "
            "attends to every key before it"
        )


def test_a_window_in_a_later_layer_alone_is_a_fault(tmp_path):
    """Every GroupQueryAttention is read, not the first alone: a window planted in the last layer only (a mutation
    run that returned after the first node passed every test, whose plants put the window in every layer)."""
    nodes = [
        helper.make_node("GroupQueryAttention", ["q"], [f"out{i}"], name=f"/model/layers.{i}/attn/GQA", **extra)
        for i, extra in enumerate([{}, {"local_window_size": -1}, {"local_window_size": 64}])
    ]
    outputs = [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None) for i in range(3)]
    onnx.save(helper.make_model(helper.make_graph(nodes, "window", [], outputs)), str(tmp_path / "model.onnx"))
    said = attention_window_check(tmp_path / "model.onnx")
    assert said is not None, "the last layer's window was not read"
    assert said.startswith("model.onnx: /model/layers.2/attn/GQA attends to a window of its last 64 keys"), said


# --- export/quantized_size.py -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "dtype", "expected"),
    [
        # 40 inputs in blocks of 16: 3 blocks, each row padded to 48 weights. int4 symmetric: 24 packed bytes and 3
        # float32 scales a row, no zero points
        (QuantizeSpec(bits=4, block_size=16), torch.float32, 5 * (24 + 3 * 4)),
        # asymmetric int4: 3 zero points of 4 bits packed in 2 bytes a row (rounded up)
        (QuantizeSpec(bits=4, block_size=16, algo="rtn-asym"), torch.float32, 5 * (24 + 3 * 4 + 2)),
        # HQQ: a zero point a block in the scales' dtype
        (QuantizeSpec(bits=4, block_size=16, algo="hqq"), torch.float16, 5 * (24 + 3 * 2 + 3 * 2)),
        # int8: a byte a weight
        (QuantizeSpec(bits=8, block_size=16), torch.float16, 5 * (48 + 3 * 2)),
    ],
    ids=["int4", "int4-asym", "hqq-float16", "int8-float16"],
)
def test_a_projections_quantized_bytes(spec, dtype, expected):
    """MatMulNBits' layout for 5 rows of 40 inputs (not a whole number of blocks)."""
    assert projection_bytes(5, 40, spec, dtype) == expected


# --- export/weights_stamp.py --------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [-1, +1], ids=["shorter", "longer"])
def test_a_weights_file_of_another_size_is_refused_by_its_size(change, tmp_path):
    """A file that grew is refused by its size too, not as one whose "size agrees"."""
    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(range(256)) * (3 * PAGE // 256))
    model = onnx.ModelProto()
    stamp_weights(model, data)
    data.write_bytes(data.read_bytes()[:change] if change < 0 else data.read_bytes() + b"\0")
    with pytest.raises(ThinkerError) as refused:
        check_weights_stamp(model, tmp_path / "model.onnx", data)
    assert str(refused.value).startswith(
        f"{data}: {3 * PAGE + change} bytes, but model.onnx was exported with a weights file of {3 * PAGE} bytes; "
        "the file is truncated or from another export"
    )
