"""Qwen3.5 and Qwen3.5-MoE GGUF files (llama.cpp's ``qwen35`` / ``qwen35moe``), as llama.cpp's converter writes them
(``hybrid_gguf.py``: norms as ``1 + w``, ``-exp(A_log)``, the conv kernel squeezed, value heads tiled, the
multi-token-prediction head as one more block), from tiny transformers models with both layer types and two value
heads per key head (``tests/references/hybrid.py``).

Each converts through the command line with the parity gate on, against transformers' own GGUF loading of the file,
whole and layer by layer; the converted Thinker then gives the logits of the transformers model the file was written
from. A planted mistake in the converter's table fails the gate; a file missing a key, or holding a decay rate no
``A_log`` makes, fails with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import pytest
import torch
from click.testing import CliRunner
from convert_helpers import FP32_ATOL, FP32_RTOL
from hybrid_gguf import write_hybrid_gguf
from references.hybrid import left_pad, qwen3_5_config, qwen3_5_moe_config, reference, token_ids
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

import converter.families
from converter.ops import Identity
from thinker import ThinkerForCausalLM
from thinker_common.cli import main

MODELS = {
    "qwen35": (Qwen3_5ForCausalLM, qwen3_5_config),
    "qwen35moe": (Qwen3_5MoeForCausalLM, qwen3_5_moe_config),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def convert(*args: object):
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def assert_error(result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert "Traceback" not in result.output
    return lines[-1]


def source_model(architecture: str, **overrides):
    model_class, config = MODELS[architecture]
    return reference(model_class, config(**overrides))


def gguf_file(tmp_path, kind: str, **options):
    """The tiny model of ``kind`` (a key of ``MODELS``) and its GGUF file (``options`` to ``write_hybrid_gguf``)."""
    folder = tmp_path / "gguf"
    folder.mkdir(exist_ok=True)
    model = source_model(kind)
    return model, write_hybrid_gguf(model, folder / f"tiny-{kind}.gguf", **options)


@torch.no_grad()
def assert_gives_the_models_logits(model, folder, atol=FP32_ATOL, rtol=FP32_RTOL) -> None:
    """The Thinker in ``folder`` gives ``model``'s float32 logits on a left-padded batch (real positions)."""
    converted = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask = left_pad([token_ids(1, 9, seed=3)[0], token_ids(1, 5, seed=4)[0]])
    real = mask.bool()
    expected = model(input_ids=ids, attention_mask=mask).logits[real]
    torch.testing.assert_close(
        converted(input_ids=ids, attention_mask=mask).logits[real], expected, atol=atol, rtol=rtol
    )


@pytest.mark.parametrize("architecture", sorted(MODELS))
@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_hybrid_gguf_converts_to_the_model_it_was_written_from(architecture, verify, tmp_path):
    model, path = gguf_file(tmp_path, architecture, mtp_layers=1)
    output = tmp_path / "out"
    result = convert(path, output, verify)
    assert result.exit_code == 0, result.output
    assert f"(gguf-{architecture})" in result.output and "pass" in result.output, result.output
    parity = json.loads((output / "parity.json").read_text())
    assert parity["passed"] and parity["mode"] == ("layer-by-layer" if verify.endswith("layer") else "whole-model")
    assert_gives_the_models_logits(model, output)
    config = json.loads((output / "config.json").read_text())
    assert config["layer_types"] == model.config.layer_types and config["num_hidden_layers"] == 4  # MTP block dropped
    assert config["rope_parameters"]["mrope_section"] == [2, 1, 1] and config["norm_zero_centered"]
    # and said to be: llama.cpp's block past the decoder's layers, as a Hugging Face checkpoint's mtp.*
    assert "left out (" in result.output and "blk.4.* (" in result.output
    assert "`blk.4.*` is the multi-token-prediction block" in (output / "README.md").read_text()


@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_quantized_hybrid_gguf_is_verified_against_its_own_dequantized_weights(verify, tmp_path):
    """Q8_0 blocks: the gate compares against transformers' reading of the same blocks, so they agree to float32
    summation noise. (Not against the float model the file was written from: these random tiny models turn a
    relative weight error of 2e-3, about what Q8_0 costs, into logit changes of order 1.)"""
    _, path = gguf_file(tmp_path, "qwen35moe", quantization="Q8_0")
    output = tmp_path / "out"
    result = convert(path, output, verify)
    assert result.exit_code == 0, result.output
    (fp32,) = json.loads((output / "parity.json").read_text())["results"]
    assert fp32["passed"] and fp32["max_abs_diff"] <= 1e-5, fp32


def test_hybrid_gguf_tokenizer_is_transformers_reading_of_the_file(tmp_path):
    _, path = gguf_file(tmp_path, "qwen35")
    output = tmp_path / "out"
    assert convert(path, output, "--no-verify").exit_code == 0
    ours = AutoTokenizer.from_pretrained(output)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "".join(ours.convert_ids_to_tokens(list(range(40, 60))))
    assert ours(text).input_ids == theirs(text).input_ids and len(ours(text).input_ids) > 1


@pytest.fixture
def norms_left_centred(monkeypatch):
    """The converter with one mistake planted: the layer norms' ``1 + w`` kept instead of undone."""
    norm = "model.layers.{layer}.input_layernorm.weight"

    def planted(family):
        if family.name != "gguf-qwen35":
            return family
        tensors = tuple(
            dataclasses.replace(entry, op=Identity()) if entry.targets == (norm,) else entry for entry in family.tensors
        )
        return dataclasses.replace(family, tensors=tensors)

    monkeypatch.setattr(converter.families, "FAMILIES", tuple(map(planted, converter.families.FAMILIES)))


@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_a_planted_mistake_fails_the_gate(verify, tmp_path, norms_left_centred):
    _, path = gguf_file(tmp_path, "qwen35")
    output = tmp_path / "out"
    result = convert(path, output, verify)
    assert result.exit_code == 1, result.output
    assert "fail" in result.output and not output.exists()


@pytest.mark.parametrize(
    "key",
    [
        "qwen35.ssm.conv_kernel",
        "qwen35.feed_forward_length",
        "qwen35.rope.dimension_sections",
        "qwen35.rope.freq_base",  # transformers' reading takes it as given (a KeyError without this check)
        "tokenizer.ggml.tokens",
    ],
)
def test_a_missing_key_is_named(key, tmp_path):
    _, path = gguf_file(tmp_path, "qwen35", metadata={key: None})
    output = tmp_path / "out"
    assert_error(convert(path, output, "--no-verify"), key)
    assert not output.exists()


def test_an_impossible_value_is_named(tmp_path):
    _, path = gguf_file(tmp_path, "qwen35", metadata={"qwen35.ssm.group_count": 0})
    assert_error(convert(path, tmp_path / "out", "--no-verify"), "'qwen35.ssm.group_count'", "corrupt")


def test_a_boolean_size_is_named(tmp_path):
    """A GGUF bool where a size belongs (Python's bool is an int: True would be read as 1)."""
    from converter.families.gguf import gguf_to_hf_config
    from thinker_common.errors import ThinkerError
    from thinker_common.gguf_reader import GGUFSource

    _, path = gguf_file(tmp_path, "qwen35")
    source = GGUFSource(path)
    try:
        metadata, names = source.config(), source.names()
    finally:
        source.close()
    with pytest.raises(ThinkerError, match="'qwen35.ssm.group_count' is True; a model needs a whole number above 0"):
        gguf_to_hf_config({**metadata, "qwen35.ssm.group_count": True}, names)


def test_rope_scaling_is_refused_by_its_key(tmp_path):
    """transformers' GGUF loading of a qwen35 file with RoPE scaling loses its multimodal sections and partial rotary:
    with no reference, the conversion is refused by key, with --no-verify too, rather than written unscaled."""
    scaling = {"qwen35.rope.scaling.type": "yarn", "qwen35.rope.scaling.factor": 4.0}
    _, path = gguf_file(tmp_path, "qwen35", metadata=scaling)
    for check in ("--verify", "--no-verify"):
        assert_error(convert(path, tmp_path / "out", check), "'qwen35.rope.scaling.type' is 'yarn'", "Hugging Face")
        assert not (tmp_path / "out").exists()
    # a factor alone is linear scaling to llama.cpp, refused as such
    (tmp_path / "factor").mkdir()
    _, path = gguf_file(tmp_path / "factor", "qwen35", metadata={"qwen35.rope.scaling.factor": 4.0})
    message = "RoPE scaling factor 4.0 with no 'rope.scaling.type', which llama.cpp reads as linear scaling"
    assert_error(convert(path, tmp_path / "out", "--no-verify"), message, "Hugging Face")
    assert not (tmp_path / "out").exists()


def test_a_split_gguf_says_to_merge_its_shards(tmp_path, monkeypatch):
    """llama.cpp's gguf-split writes NAME-00001-of-00003.gguf ... (``split.count`` in each): the folder, a shard and
    a Hub repo of them each say so and how to merge them, where they said to pick one file, or that a shard lacked
    tensors."""
    from converter.hub import pick_conversion_files
    from thinker_common.errors import ThinkerError

    class SplitWriter(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, split_max_tensors=20, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", SplitWriter)
    gguf_file(tmp_path, "qwen35")
    shards = sorted(path.name for path in (tmp_path / "gguf").iterdir())
    assert shards == [f"tiny-qwen35-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    # the first shard by the path the user gave, so the advice runs as printed from where they are
    merge = f"llama-gguf-split --merge {tmp_path / 'gguf' / shards[0]} merged.gguf"
    assert_error(convert(tmp_path / "gguf", tmp_path / "out", "--no-verify"), "a GGUF split into 3 files", merge)
    second = tmp_path / "gguf" / shards[1]
    assert_error(convert(second, tmp_path / "out", "--no-verify"), "shard 2 of a GGUF split into 3 files", merge)
    assert not (tmp_path / "out").exists()
    # a shard short: counted from the names, the missing one named
    (tmp_path / "gguf" / shards[0]).unlink()
    result = convert(tmp_path / "gguf", tmp_path / "out", "--no-verify")
    assert_error(result, f"a GGUF split into 3 files, 1 of them not here ({tmp_path / 'gguf' / shards[0]})", merge)
    result = convert(second, tmp_path / "out", "--no-verify")  # a shard given: the one missing named too
    assert_error(result, f"split into 3 files (split.count); {shards[0]} not beside it: fetch them, then", merge)
    # a shard renamed: llama-gguf-split finds the others by the names, so the advice is to give them back first
    renamed = shutil.copy(second, tmp_path / "whole.gguf")
    result = convert(renamed, tmp_path / "out", "--no-verify")
    assert_error(result, "shard 2 of a GGUF split into 3 files", "which this one has lost", "NAME-00001-of-00003.gguf")
    # a Hub repo's, at its top or in a quantisation's folder, or one shard named: before any download
    for listing in (shards, [*(f"Q8_0/{shard}" for shard in shards), "README.md"]):
        with pytest.raises(ThinkerError, match="holds a GGUF split into 3 files; merge the shards first"):
            pick_conversion_files(listing, "acme/tiny@main")
    with pytest.raises(ThinkerError, match=r"split into 3 files.*--merge tiny-qwen35-00001-of-00003.gguf"):
        pick_conversion_files([*shards, "mmproj-F16.gguf"], "acme/tiny@main", shards[1])


def test_a_split_gguf_names_each_shard_not_here():
    """The shards missing are counted from the names, the last of the set as the first (a download cut short loses
    the end of a set), and a long list of them is cut after three."""
    from thinker_common.gguf_split import split_gguf

    said = split_gguf(["q8/x-00001-of-00003.gguf", "q8/x-00002-of-00003.gguf"])
    assert said.startswith("a GGUF split into 3 files, 1 of them not here (q8/x-00003-of-00003.gguf); merge"), said
    said = split_gguf(["x-00002-of-00006.gguf", "mmproj-F16.gguf"])
    assert said.startswith(
        "a GGUF split into 6 files, 5 of them not here (x-00001-of-00006.gguf, x-00003-of-00006.gguf, "
        "x-00004-of-00006.gguf ...); merge"
    ), said


def test_a_decay_rate_no_a_log_makes_is_named(tmp_path):
    """``ssm_a`` holds ``-exp(A_log)``, always negative: a positive value has no ``A_log`` (its log is NaN)."""
    _, path = gguf_file(tmp_path, "qwen35")
    reader = gguf.GGUFReader(path, "r+")
    (ssm_a,) = [tensor for tensor in reader.tensors if tensor.name == "blk.0.ssm_a"]
    ssm_a.data[:] = -ssm_a.data  # positive rates
    reader.data.flush()
    del reader
    output = tmp_path / "out"
    assert_error(convert(path, output, "--no-verify"), "blk.0.ssm_a")
    assert not output.exists()


def test_qwen3_next_gguf_says_what_to_do(tmp_path):
    _, path = gguf_file(tmp_path, "qwen35", architecture="qwen3next")
    assert_error(convert(path, tmp_path / "out", "--no-verify"), "'qwen3next'", "Hugging Face checkpoint")


def test_a_section_of_no_frequencies_keeps_its_place(tmp_path):
    """llama.cpp pads the [t, h, w] mRoPE sections to four with a 0; transformers' config builder drops every 0, so
    [3, 1, 0] would lose its w. The first three are kept."""
    _, path = gguf_file(tmp_path, "qwen35", metadata={"qwen35.rope.dimension_sections": [3, 1, 0, 0]})
    output = tmp_path / "out"
    assert convert(path, output, "--no-verify").exit_code == 0
    assert json.loads((output / "config.json").read_text())["rope_parameters"]["mrope_section"] == [3, 1, 0]


def test_the_norm_epsilon_is_written_as_its_short_decimal(tmp_path):
    """GGUF stores eps as float32 (1e-6 reads back as 9.999999974752427e-07): config.json holds the decimal the
    original config held, as for the other architectures."""
    from converter.families.gguf import gguf_to_hf_config
    from thinker_common.gguf_reader import GGUFSource

    model, path = gguf_file(tmp_path, "qwen35")
    source = GGUFSource(path)
    try:
        config = gguf_to_hf_config(source.config(), source.names())
    finally:
        source.close()
    assert config["rms_norm_eps"] == model.config.rms_norm_eps == 1e-06


def test_a_file_of_the_multi_token_prediction_block_alone_is_refused(tmp_path):
    _, path = gguf_file(tmp_path, "qwen35", mtp_layers=1, metadata={"qwen35.block_count": 1})
    assert_error(convert(path, tmp_path / "out", "--no-verify"), "'qwen35.block_count' counts 1 blocks", "no decoder")


def test_one_quantisation_of_a_hub_gguf_repo(fake_hub, tmp_path):
    """A Hub GGUF repo holds one file per quantisation: ``--gguf-file`` converts (and verifies) the one named."""
    _, q8 = gguf_file(tmp_path, "qwen35", quantization="Q8_0")
    model, f32 = gguf_file(tmp_path, "qwen35moe")
    files = {"Q8/tiny-Q8_0.gguf": q8.read_bytes(), "F32/tiny-F32.gguf": f32.read_bytes()}  # a folder each
    commit = fake_hub.add_repo("acme/tiny-qwen3.5-GGUF", files)
    output = tmp_path / "out"
    result = convert("acme/tiny-qwen3.5-GGUF", output, "--gguf-file", "F32/tiny-F32.gguf")
    assert result.exit_code == 0, result.output
    assert "(gguf-qwen35moe)" in result.output
    assert_gives_the_models_logits(model, output)
    # the card names the snapshot's commit, not the folder the file sits in, and which of the files it converted
    assert f"at commit `{commit}`, the file `F32/tiny-F32.gguf`, family" in (output / "README.md").read_text()
    verified = CliRunner().invoke(
        main, ["verify", "acme/tiny-qwen3.5-GGUF", str(output), "--gguf-file", "F32/tiny-F32.gguf"]
    )
    assert verified.exit_code == 0 and "parity holds" in verified.output, verified.output


def test_thinker_from_pretrained_takes_gguf_file(tmp_path):
    """``ThinkerForCausalLM.from_pretrained(folder, gguf_file=NAME)``, as transformers' own models take it: the named
    file of a folder holding several is converted on load."""
    import converter.load  # noqa: F401  (registers the converter with ThinkerForCausalLM.from_pretrained)

    model, path = gguf_file(tmp_path, "qwen35")
    write_hybrid_gguf(source_model("qwen35moe"), path.parent / "other.gguf")
    loaded = ThinkerForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = token_ids(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=FP32_ATOL, rtol=FP32_RTOL)


def test_a_bfloat16_gguf_converts_to_bfloat16_exactly(tmp_path):
    """A BF16 file (llama.cpp's unquantised release; its norms and decay rates stay float32) converts to bfloat16,
    the norms' ``1 + w`` undone in float32 before the cast, as transformers' loading does: both dtypes agree with
    transformers' model of the file to the last bit."""
    _, path = gguf_file(tmp_path, "qwen35", quantization="BF16")
    output = tmp_path / "out"
    result = convert(path, output)
    assert result.exit_code == 0, result.output
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"
    rows = json.loads((output / "parity.json").read_text())["results"]
    assert [row["dtype"] for row in rows] == ["float32", "bfloat16"] and all(row["max_abs_diff"] == 0 for row in rows)


@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_a_file_of_bfloat16_vectors_is_its_own_reference_both_ways(verify, tmp_path, monkeypatch):
    """Every tensor bfloat16, the decay rates (ssm_a) too, converted to float32: transformers' loading keeps such a
    tensor in bfloat16 and takes A_log = log(-a) there, rounded, and the check by layer must read it so; it read
    the values in float32 and refused an exact conversion, 0.067 against a tolerance of 8.2e-4 (a review)."""
    import hybrid_gguf

    def all_bfloat16(writer, name, tensor, quantization=None):
        kind = gguf.GGMLQuantizationType.BF16
        writer.add_tensor(name, gguf.quants.quantize(tensor.float().numpy(), kind), raw_dtype=kind)

    monkeypatch.setattr(hybrid_gguf, "add_gguf_tensor", all_bfloat16)
    _, path = gguf_file(tmp_path, "qwen35")
    result = convert(path, tmp_path / "out", "--dtype", "float32", verify)
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "out" / "parity.json").read_text())["results"]
    assert row["max_abs_diff"] == 0, row


@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_a_block_type_transformers_does_not_read_has_no_reference_either_way(verify, tmp_path):
    """Q5_0, which transformers' GGUF loading of Qwen3.5 does not read: there is no reference, whichever way the
    check runs (by layer it read the blocks with gguf's own functions and passed, a review)."""
    _, path = gguf_file(tmp_path, "qwen35", quantization="Q5_0")
    assert_error(convert(path, tmp_path / "out", verify), "the reference model does not load with transformers")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("verify", ["--verify", "--verify-by-layer"])
def test_a_quantized_hybrid_gguf_converts_to_bfloat16_exactly(verify, tmp_path):
    """Q8_0 blocks to bfloat16: the converter dequantizes in float32 and rounds once, as llama.cpp dequantizes and
    as transformers' float32 loading cast to bfloat16 holds. transformers' bfloat16 loading rounds each block's
    scale first (its dequantization runs in the dtype), which made the whole-model reference another model and
    failed this conversion (from a QA run; by layer it passed); its reference now dequantizes in float32 and casts
    once, so both checks agree with the conversion to the last bit."""
    _, path = gguf_file(tmp_path, "qwen35", quantization="Q8_0")
    output = tmp_path / "out"
    result = convert(path, output, "--dtype", "bfloat16", verify)
    assert result.exit_code == 0, result.output
    rows = json.loads((output / "parity.json").read_text())["results"]
    assert [row["dtype"] for row in rows] == ["float32", "bfloat16"] and all(row["max_abs_diff"] == 0 for row in rows)


def test_without_transformers_gguf_loading_of_qwen35_says_so(tmp_path, monkeypatch):
    """transformers before 5.24 cannot load these files, so there is no reference: one line says what to install."""
    import transformers.integrations.gguf

    monkeypatch.setattr(transformers.integrations.gguf, "GGUF_CONFIG_ARCHS", {})
    _, path = gguf_file(tmp_path, "qwen35")
    assert_error(convert(path, tmp_path / "out", "--no-verify"), "transformers 5.24 or later")


def test_export_converts_the_named_gguf_on_the_way(tmp_path):
    """``thinker export FOLDER OUT --gguf-file NAME``: the named file of several is converted (its parity gate on),
    then exported and verified against the converted Thinker."""
    _, path = gguf_file(tmp_path, "qwen35")
    write_hybrid_gguf(source_model("qwen35moe"), path.parent / "other.gguf")
    output = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(path.parent), str(output), "--gguf-file", path.name])
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())
    assert report["converted"] and report["verify"]["passed"], report
    assert json.loads((output / "config.json").read_text())["linear_num_value_heads"] == 4
    missing = CliRunner().invoke(main, ["export", str(path.parent), str(tmp_path / "x"), "--gguf-file", "q.gguf"])
    assert_error(missing, "no GGUF file 'q.gguf'", "other.gguf")


def test_a_nan_through_a_computing_operation_is_named(tmp_path):
    """The zero-centred norms go through an operation that computes (weight - 1), whose output no scan of the source
    bytes has checked: a NaN there is refused by the output check, naming the GGUF tensor (a mutation run)."""
    model = source_model("qwen35")
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    path = write_hybrid_gguf(model, tmp_path / "nan.gguf")
    assert_error(convert(path, tmp_path / "out", "--no-verify"), "output_norm.weight", "NaN")
    assert not (tmp_path / "out").exists()
