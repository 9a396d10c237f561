"""Qwen3.8 (``qwen4_exp``) through the converter: the tiny reference of ``tests/references/qwen4_exp.py`` saved by
transformers' own classes in the causal-LM and the vision-language layouts (its n-gram tables in two pieces each,
its hash buffers beside them, plus the ``mtp.*`` tensors a Hub checkpoint carries), converted by the command line
with the parity gate on, and held to its reference class: logits, greedy tokens, a left-padded batch; the way back
bit-exact; the gate failing on the n-gram pieces joined out of order and on hash buffers the config does not imply;
parity layer by layer; the ONNX export refusing what it does not build, by name.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from references.hybrid import left_pad, reference, token_ids
from references.qwen4_exp import LAYER_TYPES, VOCAB, qwen4_exp_config, qwen4_exp_vl_config
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

from converter import engine
from converter.cli import convert_command, verify_command
from converter.families import qwen4_exp as qwen4_exp_family
from converter.ops import JoinParts
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker_common.cli import main

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in float32
GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding"
CASES = {"causal-lm": Qwen4ExpForCausalLM, "vision-language": Qwen4ExpForConditionalGeneration}


def cli(command, *args):
    return CliRunner().invoke(command, [str(arg) for arg in args], catch_exceptions=False)


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return {name: t for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}


def rewrite(folder: Path, edit) -> None:
    """``edit(tensors)`` applied to the folder's one safetensors file."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """Each layout's reference, saved as its users find it, and converted with --verify; once per module."""
    done = {}

    def get(layout: str):
        if layout not in done:
            root = tmp_path_factory.mktemp(layout)
            config = qwen4_exp_config() if layout == "causal-lm" else qwen4_exp_vl_config()
            model = reference(CASES[layout], config)
            model.save_pretrained(root / "source")
            if layout == "vision-language":
                rewrite(root / "source", lambda t: t.update({"mtp.fc.weight": torch.ones(32, 64)}))
            result = cli(convert_command, root / "source", root / "thinker", "--verify")
            assert result.exit_code == 0, result.output
            done[layout] = (model, root / "source", root / "thinker", result.output)
        return done[layout]

    return get


def test_verify_reads_the_tables_joined_from_pieces_bit_for_bit(conversions, tmp_path):
    """``thinker verify``'s exact check over the n-gram tables the conversion joins from pieces, one piece at a time:
    a sound folder passes; a value changed in a later piece is named by its row of the joined table."""
    _, source, thinker, _ = conversions("causal-lm")
    result = cli(verify_command, source, thinker, "--report", str(tmp_path / "sound.json"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "sound.json").read_text())["weights"].startswith("every tensor bit for bit")
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in thinker.iterdir():
        (edited / path.name).write_bytes(path.read_bytes())
    table = next(name for name in load_file(thinker / "model.safetensors") if "ngram_embedding" in name)
    rows = load_file(thinker / "model.safetensors")[table].shape[0]
    rewrite(edited, lambda tensors: tensors[table][rows - 1].mul_(1.001))
    result = cli(verify_command, source, edited, "--report", str(tmp_path / "edited.json"))
    assert result.exit_code == 1 and f"tensor {table!r} is not what converting" in result.output, result.output
    assert f"(row {rows - 1} of" in result.output, result.output


@pytest.mark.parametrize("layout", list(CASES))
def test_converts_with_the_parity_gate(conversions, layout):
    model, source, thinker, output = conversions(layout)
    prefix = "model.language_model." if layout == "vision-language" else "model."
    stored = safetensors_of(source)
    assert {f"{prefix}layers.0.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in (0, 1)} <= set(stored)
    assert f"{prefix}layers.0.ple.ple_embedding.layer_multipliers" in stored  # dropped: derived from the config

    assert "(qwen4_exp)" in output and "the n-gram tables of 2 layers" in output
    parity = json.loads((thinker / "parity.json").read_text())
    fp32 = parity["results"][0]
    assert parity["passed"] and parity["reference"] == type(model).__name__
    assert fp32["max_abs_diff"] <= 1e-4 and fp32["greedy_identical"] == fp32["greedy_prompts"] == 4
    assert {stage["name"] for stage in fp32["unreached"]} >= {"layer 0: every n-gram row", "layer 4: every n-gram row"}

    config = ThinkerConfig.from_pretrained(thinker)
    assert config.layer_types == LAYER_TYPES and config.hc_count == 3 and config.ple_layer_ids == [1, 5]
    assert (config.indexer_budget, config.indexer_compress_ratio, config.split_ngram_parts) == (8, 4, 2)
    assert config.norm_topk_prob and config.output_gate_type == "silu" and config.ngram_seed == 1234
    card = (thinker / "README.md").read_text()
    assert "ONNX_FOLDER` writes it as an ONNX decoder for onnxruntime" in card
    assert "onnxruntime-genai has no model type for the state of its hyper-connections" in card
    names = set(safetensors_of(thinker))
    assert TABLE + ".weight" in names and not any("shard_" in n or "multipliers" in n for n in names)
    assert not any(n.startswith(("mtp.", "model.visual.", "model.language_model.")) for n in names)


@torch.no_grad()
@pytest.mark.parametrize("layout", list(CASES))
def test_logits_greedy_tokens_and_left_padding(conversions, layout):
    theirs, _, folder, _ = conversions(layout)
    ours = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = [token_ids(batch=1, length=n, seed=n, high=VOCAB)[0] for n in (44, 30)]  # past the indexer's budget
    ids, mask = left_pad(rows)
    real = mask.bool()
    assert_close(ours(ids, attention_mask=mask).logits[real], theirs(ids, attention_mask=mask).logits[real], **TOL)
    prompt = rows[1][None]
    assert torch.equal(ours.generate(prompt, **GREEDY), theirs.generate(prompt, **GREEDY))


def test_way_back_is_bit_exact(conversions, tmp_path):
    """``--to qwen4_exp``: the causal-LM layout, the n-gram tables cut back into their pieces, every tensor of the
    source bit for bit, the hash buffers (which the Thinker does not store) written again from the config, so that
    transformers loads the folder with nothing missing."""
    model, source, thinker, _ = conversions("causal-lm")
    back = cli(convert_command, thinker, tmp_path / "back", "--to", "qwen4_exp", "--verify")
    assert back.exit_code == 0, back.output
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == "qwen4_exp_text" and written["architectures"] == ["Qwen4ExpForCausalLM"]
    assert written["indexer_kv_heads"] == 1 and written["seed"] == 1234
    before, after = safetensors_of(source), safetensors_of(tmp_path / "back")
    assert sorted(after) == sorted(before)
    assert any(name.endswith("layer_multipliers") for name in after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    same_kernels = dict(attn_implementation="eager", experts_implementation="eager")  # as references.hybrid builds it
    again, report = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True, **same_kernels)
    assert not any(report.values()), report  # nothing missing, unexpected or mismatched
    again.eval()
    ids = token_ids(batch=2, length=30, seed=4, high=VOCAB)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_way_back_gate_fails_on_hash_buffers_derived_wrong(conversions, tmp_path, monkeypatch):
    """A planted bug in the way back's derived hash buffers (another seed's multipliers): transformers runs the
    written ones, so the gate fails and nothing is written."""
    _, _, thinker, _ = conversions("causal-lm")
    derived = qwen4_exp_family.ngram_hash_buffers
    monkeypatch.setattr(
        qwen4_exp_family,
        "ngram_hash_buffers",
        lambda config, index: derived(replace(config, ngram_seed=config.ngram_seed + 1), index),
    )
    back = cli(convert_command, thinker, tmp_path / "back", "--to", "qwen4_exp", "--verify")
    assert back.exit_code == 1 and "does not match the Thinker folder" in back.output, back.output
    assert not (tmp_path / "back").exists()


@pytest.fixture
def source_copy(conversions, tmp_path):
    _, source, _, _ = conversions("causal-lm")
    copy = tmp_path / "source"
    copy.mkdir()
    for path in source.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def test_gate_fails_on_table_pieces_joined_out_of_order(source_copy, tmp_path, monkeypatch):
    """A planted converter bug: the pieces of each n-gram table written last first. The direct comparison of every
    n-gram row names the table (a prompt hashes to a few of its rows: at full size the logits alone could agree)."""
    in_order = engine.piece_by_piece
    monkeypatch.setattr(
        engine, "piece_by_piece", lambda step, *args: in_order(replace(step, sources=step.sources[::-1]), *args)
    )
    result = cli(convert_command, source_copy, tmp_path / "out", "--verify")
    assert result.exit_code != 0 and not (tmp_path / "out").exists()
    assert "FAIL at layer 0: every n-gram row, layer 4: every n-gram row" in result.output, result.output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tables_pieces_are_written_in_place_never_joined_in_memory(source_copy, tmp_path, monkeypatch, dtype):
    """At full size a table is tens of GB in hundreds of pieces: each piece goes to its place in the output (copied
    by the kernel in the source's dtype, else cast alone), so the joined table is never in memory. The join runs on
    meta tensors only (the plan's shapes); run on real ones, it fails here."""
    planned = JoinParts.__call__

    def meta_only(self, tensors, config):
        assert all(tensor.is_meta for tensor in tensors), "a table joined in memory"
        return planned(self, tensors, config)

    monkeypatch.setattr(JoinParts, "__call__", meta_only)
    result = cli(convert_command, source_copy, tmp_path / "out", "--dtype", dtype, "--no-verify")
    assert result.exit_code == 0, result.output
    pieces = load_file(source_copy / "model.safetensors")
    joined = torch.cat([pieces[f"{TABLE}.shard_{i}.weight"] for i in (0, 1)]).to(getattr(torch, dtype))
    assert torch.equal(safetensors_of(tmp_path / "out")[TABLE + ".weight"], joined)


def test_a_nan_in_a_table_piece_cast_alone_is_named(source_copy, tmp_path):
    """A piece not copied as bytes (another dtype than the output's) is read, checked and cast alone: a NaN in it is
    refused naming the piece, as a NaN in a piece copied by the kernel is (a mutation run)."""
    rewrite(source_copy, lambda t: t[f"{TABLE}.shard_1.weight"].view(-1)[5:6].fill_(float("nan")))
    result = cli(convert_command, source_copy, tmp_path / "out", "--dtype", "bfloat16", "--no-verify")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert f"{TABLE}.shard_1.weight" in result.output and "NaN" in result.output, result.output


def test_hash_buffers_the_config_does_not_imply_are_refused_by_name(source_copy, tmp_path):
    """transformers runs the hash buffers a checkpoint stores; the Thinker derives them. A checkpoint whose buffers
    disagree with its config would be another model: refused before anything is written, naming the tensor."""
    rewrite(source_copy, lambda t: t["model.layers.0.ple.ple_embedding.layer_multipliers"].add_(2))
    result = cli(convert_command, source_copy, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert "tensor 'model.layers.0.ple.ple_embedding.layer_multipliers'" in result.output, result.output
    assert "is not the n-gram hash the config implies" in result.output


def test_a_hash_buffer_stored_as_floats_is_judged_by_its_values(source_copy, tmp_path):
    """transformers loads a float hash buffer into its int64 one: table sizes saved as float32 (small integers,
    exact) are the same model and convert, with parity; multipliers saved as float32 (past 2^24, rounded) are
    another, refused by name (the dtype was refused, with a message calling equal values different: a mutation
    run)."""
    sizes, multipliers = (
        f"model.layers.0.ple.ple_embedding.{name}" for name in ("ngram_heads_vocab_sizes", "layer_multipliers")
    )

    def as_float(name):
        def edit(tensors):
            tensors[name] = tensors[name].float()

        return edit

    rewrite(source_copy, as_float(sizes))
    converted = cli(convert_command, source_copy, tmp_path / "out", "--verify")
    assert converted.exit_code == 0, converted.output
    rewrite(source_copy, as_float(multipliers))
    refused = cli(convert_command, source_copy, tmp_path / "refused", "--no-verify")
    assert refused.exit_code == 1 and f"tensor {multipliers!r} (float32" in refused.output, refused.output


def test_a_vocabulary_resized_after_the_hash_converts_once_the_config_says_so(tmp_path):
    """transformers' resize_token_embeddings keeps the hash drawn for the old vocabulary: such a checkpoint is refused
    by name until its config.json names that vocabulary (ngram_hash_vocab_size), then converts with parity, and the
    Thinker keeps that hash through its own resizes (the field is in its config); the way back writes the folder
    the source was, the field and the stored hash included (it refused such a Thinker as inexpressible)."""
    model = reference(Qwen4ExpForCausalLM, qwen4_exp_config())
    model.resize_token_embeddings(VOCAB + 32)
    model.save_pretrained(tmp_path / "resized")
    refused = cli(convert_command, tmp_path / "resized", tmp_path / "out", "--verify")
    assert refused.exit_code == 1 and '"ngram_hash_vocab_size": the size before' in refused.output, refused.output

    config_path = tmp_path / "resized" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"ngram_hash_vocab_size": VOCAB}))
    converted = cli(convert_command, tmp_path / "resized", tmp_path / "out", "--verify")
    assert converted.exit_code == 0, converted.output
    assert ThinkerConfig.from_pretrained(tmp_path / "out").ngram_hash_vocab_size == VOCAB

    back = cli(convert_command, tmp_path / "out", tmp_path / "back", "--to", "qwen4_exp", "--verify")
    assert back.exit_code == 0, back.output
    assert json.loads((tmp_path / "back" / "config.json").read_text())["ngram_hash_vocab_size"] == VOCAB
    before, after = safetensors_of(tmp_path / "resized"), safetensors_of(tmp_path / "back")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


@pytest.mark.parametrize("output_gate_type", ["sigmoid", None], ids=["sigmoid", "unset"])
def test_the_gated_norms_activation_is_output_gate_type_else_hidden_act(output_gate_type):
    """The Gated DeltaNet's gated norm runs ``output_gate_type``, and ``hidden_act`` only where that is unset: read
    here from transformers' own layer. A config naming sigmoid beside hidden_act silu translates to sigmoid."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedDeltaNet

    hf = qwen4_exp_config(output_gate_type=output_gate_type, hidden_act="silu")
    expected = Qwen4ExpTextGatedDeltaNet(hf, LAYER_TYPES.index("linear_attention")).norm.activation
    assert expected == (output_gate_type or "silu")
    config = engine.translate_config(qwen4_exp_family.QWEN4_EXP, hf.to_dict(), torch.float32)
    assert config.output_gate_type == expected


@pytest.mark.parametrize("by_layer", [False, True], ids=["whole", "by-layer"])
def test_gate_fails_on_an_indexer_that_chooses_other_blocks(conversions, tmp_path, by_layer):
    """The parity prompts are shorter than the indexer's budget, so it keeps every token of theirs whatever its
    weights: its own probe (its budget plus eight blocks of random tokens) sees its query and key rows exchanged (a
    split of index_qk_proj read the wrong way round)."""
    _, source, thinker, _ = conversions("causal-lm")
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in thinker.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    indexer = "model.layers.3.self_attn.indexer."

    def exchange(tensors):  # one index head: the query's rows, then the key's, as many
        tensors[indexer + "index_qk_proj.weight"] = tensors[indexer + "index_qk_proj.weight"].roll(12, dims=0)

    rewrite(broken, exchange)
    result = cli(verify_command, source, broken, *(["--verify-by-layer"] if by_layer else []))
    assert result.exit_code != 0 and "FAIL at layer 3: the indexer's choice" in result.output, result.output


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        # one piece of another width: refused from the headers, naming the pieces
        (
            lambda t: t.update({f"{TABLE}.shard_1.weight": t[f"{TABLE}.shard_1.weight"][:, :-1].contiguous()}),
            "pieces of one tensor must match but along dimension 0",
        ),
        # a piece more than split_ngram_parts says
        (
            lambda t: t.update({f"{TABLE}.shard_2.weight": t[f"{TABLE}.shard_1.weight"].clone()}),
            "split_ngram_parts",
        ),
    ],
    ids=["piece-width", "extra-piece"],
)
def test_table_pieces_that_do_not_fit_are_named(source_copy, tmp_path, edit, named):
    rewrite(source_copy, edit)
    result = cli(convert_command, source_copy, tmp_path / "out")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert named in line and "shard_" in line, line


def test_way_back_refuses_a_model_of_another_family_in_one_line(qwen3_thinker, tmp_path):
    result = CliRunner().invoke(convert_command, [str(qwen3_thinker), str(tmp_path / "back"), "--to", "qwen4_exp"])
    assert result.exit_code == 1 and not (tmp_path / "back").exists() and result.exception.__class__ is SystemExit
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "not expressible as qwen4_exp: Qwen4-Exp requires hc_count > 1, got 1" in line, result.output
    assert "validator" not in line  # transformers' wrapping of its validator's words is left out


def test_verify_by_layer(conversions):
    _, source, thinker, _ = conversions("vision-language")
    result = cli(verify_command, source, thinker, "--verify-by-layer")
    assert result.exit_code == 0, result.output
    assert "parity (layer-by-layer)" in result.output and "the n-gram tables of 2 layers" in result.output


@pytest.mark.parametrize("given", ["thinker", "source"])
def test_onnx_export_of_a_folder_and_of_a_source(conversions, tmp_path, given):
    """`thinker export` takes a Qwen3.8 Thinker folder, or its source (converted on the way), and its --verify passes,
    the prompts on which the indexers choose included: with the reference's single index head, blocks tied at zero
    are common, and the check holds the graph to the Thinker with ties to the earlier blocks (README, "ONNX export",
    on Qwen3.8); tests/export/test_onnx_qwen4_exp.py has the rest."""
    _, source, thinker, _ = conversions("causal-lm")
    folder = thinker if given == "thinker" else source
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "onnx")])
    assert result.exit_code == 0, result.output
    verify = json.loads((tmp_path / "onnx" / "export_report.json").read_text())["verify"]
    assert verify["passed"] and verify["indexer_prompts"]["max_abs_diff"] <= verify["indexer_prompts"]["tolerance"]
    assert not (tmp_path / "onnx" / "genai_config.json").exists()
    card = (tmp_path / "onnx" / "README.md").read_text()  # the source by name, not the folder converted on the way
    assert (f"The decoder of `{source}`, converted" in card) == (given == "source"), card
