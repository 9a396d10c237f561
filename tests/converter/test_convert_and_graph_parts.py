"""Parts of the conversion and of the ONNX graph builder that the end-to-end tests pass through without pinning:
the weights line a conversion prints, a family's recognition and its table read backwards, the external-data file's
page-aligned offsets, and how an export reads a Thinker folder's tensors (casts, progress, counts, unused names)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from references import uomni
from safetensors.torch import save_file

from converter.convert import ConversionResult, convert, verify
from converter.ops import Split
from converter.spec import Family, rule
from export.graph_builder import WeightFile
from export.weights import ThinkerWeights
from thinker_common.errors import ThinkerError

# ---- converter/convert.py: the one line the command prints about the weights -------------------------------------


def _result(kept: dict[str, str], tensors: int) -> ConversionResult:
    return ConversionResult(Path("out"), "qwen3", "bfloat16", [], 3 * 2**19, 0.0, kept=kept, tensors=tensors)


def test_the_weights_line_counts_mebibytes_and_names_what_was_kept_wider():
    assert _result({}, 5).weights() == "1.5 MiB of bfloat16 weights"  # 1572864 bytes: 1.5 MiB, not 1.6 MB
    assert _result({"a": "float32"}, 5).weights() == (
        "1.5 MiB of bfloat16 weights (1 tensor kept in float32, as the source stores them)"
    )
    assert _result({"a": "float32", "b": "float32", "c": "float16"}, 5).weights() == (
        "1.5 MiB of bfloat16 weights (1 tensor kept in float16, 2 tensors kept in float32, as the source stores them)"
    )
    # every tensor kept: the weights are the source's dtype, the config keeps the dtype it declares
    assert _result({"a": "float32", "b": "float32"}, 2).weights() == (
        "1.5 MiB of float32 weights, as the source stores them (config.json's dtype: bfloat16, as the source's)"
    )


# ---- converter/convert.py: what the model card and the notes say about the check --------------------------------


def test_the_card_names_the_dtype_written_not_the_one_asked_for(qwen3_source, tmp_path):
    """``--dtype auto`` (the default) resolves to the source's dtype; the card says which, not "auto"."""
    result = convert(qwen3_source, tmp_path / "out", verify=False, progress=False)
    assert result.dtype == "float32"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "into a Thinker folder\n(float32): one transformers" in card
    assert "Not checked: converted with --no-verify." in card


def test_a_family_without_a_reference_is_left_unchecked_with_its_reason(tmp_path):
    """μOmni has no transformers class: unasked, the check is skipped with a note giving the reason, and the card
    says that reason (not "converted with --no-verify", which the user never passed); with --no-verify no note."""
    source = uomni.save_checkpoint(uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config())).eval(), tmp_path / "uomni")
    reason = "μOmni ThinkerLM has no transformers class; its parity is proven against the reference implementation"
    result = convert(source, tmp_path / "out", progress=False)
    assert result.parity is None
    assert [note for note in result.notes if note.startswith("verification skipped")] == [
        f"verification skipped: {reason} in tests/references/uomni.py (tests/converter/test_seed_families.py)"
    ]
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"Not checked: {reason}" in card and "converted with --no-verify" not in card
    quiet = convert(source, tmp_path / "quiet", verify=False, progress=False)
    assert not [note for note in quiet.notes if "verification skipped" in note]  # asked for no check: no note


def test_a_gguf_without_a_tokenizer_gets_no_folder_advice(qwen3_source, tmp_path):
    """A GGUF file without tokenizer metadata says why itself (gguf_reader's warning); the note for a folder without
    tokenizer files ("copy the model's tokenizer files into it") is not added to it."""
    from convert_helpers import write_gguf
    from transformers import Qwen3ForCausalLM

    gguf = write_gguf(Qwen3ForCausalLM.from_pretrained(qwen3_source), tmp_path / "tiny.gguf", "qwen3")
    result = convert(gguf, tmp_path / "out", verify=False, progress=False)
    assert not [note for note in result.notes if note.startswith("the source has no tokenizer")]
    assert not list((tmp_path / "out").glob("tokenizer*"))


def test_verify_refuses_a_config_whose_dtype_the_weights_are_not_stored_in(qwen3_source, qwen3_thinker, tmp_path):
    """``from_pretrained(dtype="auto")`` loads a folder in the dtype config.json names, which the parity check,
    loading each dtype explicitly, never reads: a float32 folder declaring float16 is refused, before any check."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float32"
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float16"}, indent=2))
    with pytest.raises(ThinkerError) as refused:
        verify(qwen3_source, folder)
    assert str(refused.value) == (
        f"{folder / 'config.json'}: dtype 'float16', but the folder's weights are stored in float32, which "
        "from_pretrained(dtype='auto') would not load them as; set dtype to 'float32' (or convert the source again)"
    )
    assert not (folder / "parity.json").exists()


def test_verify_never_writes_its_report_over_a_link_even_a_dangling_one(qwen3_source, qwen3_thinker, tmp_path):
    link = tmp_path / "report.json"
    link.symlink_to(tmp_path / "elsewhere.json")  # leads nowhere yet: exists() is False, the path is still taken
    with pytest.raises(ThinkerError) as refused:
        verify(qwen3_source, qwen3_thinker, report_path=link)
    assert str(refused.value) == f"--report {link}: exists, and a report is never written over; name a new file"
    assert link.is_symlink() and not (tmp_path / "elsewhere.json").exists()


# ---- converter/spec.py: a family's recognition and its table read backwards ---------------------------------------


def _family(**fields) -> Family:
    table = (
        rule("transformer.wqkv.weight", ("q.weight", "k.weight"), Split(dim=0, parts=2)),
        rule("transformer.w.weight", "w.weight"),
        rule("transformer.w_alt.weight", "w.weight"),  # an alternative layout of the same target, tried second
    )
    return Family("toy", "a toy family", ("toy",), lambda config: {}, table, **fields)


def test_a_family_is_recognised_by_model_type_architecture_or_keys_and_any_hint():
    family = _family(architectures=("ToyForCausalLM",), tensor_hints=("a.weight", "b.weight"))
    assert family.recognises({"model_type": "toy"}, {"b.weight"})  # one hint of two is enough
    assert family.recognises({"model_type": "other", "architectures": ["ToyForCausalLM"]}, {"a.weight"})
    assert not family.recognises({"model_type": "toy"}, {"c.weight"})
    keyed = _family(config_keys=("n_embd", "n_layer"))
    assert keyed.recognises({"n_embd": 8, "n_layer": 2}, set())  # a training script's config: no model_type
    # a config that names another model_type is that model's, whatever keys it shares
    assert not keyed.recognises({"model_type": "gpt2", "n_embd": 8, "n_layer": 2}, set())


def test_the_head_is_looked_up_in_the_layout_present():
    family = _family(head="lm_head.weight", other_heads=("output.weight",))
    assert family.head_in({"output.weight", "x"}) == "output.weight"
    assert family.head_in({"lm_head.weight", "output.weight"}) == "lm_head.weight"
    assert family.head_in({"x"}) == "lm_head.weight"  # none present: the family's own name, for the messages


def test_the_table_read_backwards_undoes_each_operation_in_the_same_order():
    back = _family().inverted_tensors()
    assert [(entry.sources, entry.targets) for entry in back] == [
        (("q.weight", "k.weight"), ("transformer.wqkv.weight",)),
        (("w.weight",), ("transformer.w.weight",)),  # the first layout stays the one written back
        (("w.weight",), ("transformer.w_alt.weight",)),
    ]
    q, k = torch.ones(2, 3), torch.zeros(2, 3)
    (fused,) = back[0].op([q, k], None)
    assert torch.equal(fused, torch.cat([q, k]))


# ---- export/graph_builder.py: WeightFile's external data --------------------------------------------------------


def test_each_weight_starts_on_a_4096_byte_page_and_bytes_written_counts_no_padding(tmp_path):
    """onnxruntime memory-maps the weights only from page-aligned offsets: 4096 bytes, the page size, not whatever
    ALIGNMENT says; ``bytes_written`` (GraphFiles.data_bytes, the quantized verify plan's size) is the tensors'
    bytes, as exporter.py's rewritten graphs count them (the sum of lengths), never the padding between them."""
    data = WeightFile(tmp_path / "model.onnx.data")
    tensors = {
        "a": torch.arange(3, dtype=torch.float32),
        "b": torch.arange(5, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
    }
    protos = [data.add(name, tensor) for name, tensor in tensors.items()]
    data.close()
    infos = [{entry.key: entry.value for entry in proto.external_data} for proto in protos]
    assert [int(info["offset"]) for info in infos] == [0, 4096, 8192]
    assert [int(info["length"]) for info in infos] == [12, 10, 3]
    assert all(info["location"] == "model.onnx.data" for info in infos)
    assert data.bytes_written == 12 + 10 + 3 and data.count == 3
    raw = (tmp_path / "model.onnx.data").read_bytes()
    assert len(raw) == 8192 + 3
    assert raw[4096:4106] == tensors["b"].view(torch.uint8).numpy().tobytes()  # bfloat16 written as is


# ---- export/weights.py: ThinkerWeights ----------------------------------------------------------------------------


def _weights_folder(tmp_path):
    """A folder of four tensors: a float32 embedding, an int64 buffer, a float16 norm and a talker head (a part the
    graph leaves out, ``not_exported``)."""
    folder = tmp_path / "thinker"
    folder.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "model.positions": torch.arange(5, dtype=torch.int64) * 1_000_003,
            "model.norm.weight": torch.ones(3, dtype=torch.float16),
            "talker_head.weight": torch.ones(2, 3),
        },
        folder / "model.safetensors",
    )
    return folder


class _Bar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, count: int) -> None:
        self.n += count


def test_thinker_weights_cast_floats_only_and_count_each_tensor_once(tmp_path):
    bar = _Bar()
    weights = ThinkerWeights(_weights_folder(tmp_path), torch.bfloat16, True, ("talker_head.",), progress=bar)
    # the stored bytes of what the graph reads (the bar's total), the talker head left out: 48 + 40 + 6
    assert weights.exported_bytes() == 94
    positions = weights.get("model.positions")
    assert positions.dtype == torch.int64 and positions[1].item() == 1_000_003  # an integer tensor is never cast
    assert weights.get("model.norm.weight").dtype == torch.bfloat16
    head = weights.get("lm_head.weight")  # tied: the embedding matrix, read a second time
    assert head.dtype == torch.bfloat16 and head.shape == (4, 3)
    weights.get("model.embed_tokens.weight")
    assert bar.n == 94  # each tensor's bytes once, however often the graph reads it: the bar ends full, not past it
    assert weights.parameters_read() == 12 + 5 + 3  # the talker head, never read, is no parameter of the graph
    assert weights.unused() == []  # left out on purpose: not "a tensor the graph does not use"
    weights.close()


def test_an_untied_folder_names_its_unread_head_and_a_missing_one(tmp_path):
    folder = _weights_folder(tmp_path)
    weights = ThinkerWeights(folder, torch.float32, False)
    assert "lm_head.weight" not in weights
    with pytest.raises(ThinkerError, match=r"tensor 'lm_head.weight' is missing, but config.json asks for it"):
        weights.get("lm_head.weight")
    weights.get("model.embed_tokens.weight")
    assert weights.unused() == ["model.norm.weight", "model.positions", "talker_head.weight"]
    weights.close()
    tied_and_saved = tmp_path / "tied"
    tied_and_saved.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.zeros(4, 3), "lm_head.weight": torch.ones(4, 3)},
        tied_and_saved / "model.safetensors",
    )
    weights = ThinkerWeights(tied_and_saved, torch.float32, True)
    assert torch.equal(weights.get("lm_head.weight"), torch.ones(4, 3))  # the head saved is the one read
    weights.close()
    weights = ThinkerWeights(tied_and_saved, torch.float32, False)
    weights.get("model.embed_tokens.weight")
    assert weights.unused() == ["lm_head.weight"]  # untied, a head never read is named
    weights.close()
