"""The way back: ``thinker-convert THINKER_FOLDER OUTPUT --to FAMILY`` writes a Thinker folder out as the family's
own Hugging Face folder through the inverted table, and source -> Thinker -> source is bit-exact.

Each round trip starts from a tiny transformers checkpoint, converts it forward (verified), writes it back through
the real command line (verified: the written folder, loaded with its own transformers class, against the Thinker),
and compares every tensor of the result with the original file: same names, dtypes and bytes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import edit_tensors, save_word_tokenizer
from click.testing import CliRunner
from convert_helpers import build_reference, save_unfused_experts
from huggingface_hub import ModelCard
from references import uomni
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from converter.back import exportable_families
from converter.cli import convert_command

SMALL = {"vocab_size": 67, "hidden_size": 32, "num_hidden_layers": 3, "max_position_embeddings": 64}


def cli(*args: str | Path):
    return CliRunner().invoke(convert_command, [str(arg) for arg in args], catch_exceptions=False)


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def assert_bit_exact(original: Path, written: Path) -> None:
    before, after = safetensors_of(original), safetensors_of(written)
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def round_trip(source: Path, family: str, tmp_path: Path, verify_back: bool = True) -> Path:
    """Forward without the parity gate (the forward tests run it), back with it unless told otherwise."""
    forward = cli(source, tmp_path / "thinker", "--no-verify")
    assert forward.exit_code == 0, forward.output
    back = cli(tmp_path / "thinker", tmp_path / "back", "--to", family, "--verify" if verify_back else "--no-verify")
    assert back.exit_code == 0, back.output
    assert f"({family})" in back.output
    assert (tmp_path / "back" / "parity.json").is_file() is verify_back
    if verify_back:
        assert json.loads((tmp_path / "back" / "parity.json").read_text())["passed"]
    else:  # the card says how to check it: the way back again, with its check (thinker verify takes sources)
        advice = f"`thinker convert thinker OUTPUT --to {family}` without --no-verify checks what it writes"
        assert advice in (tmp_path / "back" / "README.md").read_text()
    return tmp_path / "back"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_round_trip_is_bit_exact(tmp_path, tied: bool):
    config = Qwen3Config(
        **SMALL,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        attention_bias=True,
        tie_word_embeddings=tied,
    )
    build_reference(config).save_pretrained(tmp_path / "source")
    save_word_tokenizer(tmp_path / "source", SMALL["vocab_size"])
    (tmp_path / "source" / "README.md").write_text("---\nlicense: mit\n---\n# source\n")
    (tmp_path / "source" / "LICENSE").write_text("MIT License")
    # a release's sampling defaults and its list of end tokens, which transformers' generate() reads from this file
    sampling = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [5, 6]}
    (tmp_path / "source" / "generation_config.json").write_text(json.dumps(sampling))
    back = round_trip(tmp_path / "source", "qwen3", tmp_path)
    assert_bit_exact(tmp_path / "source", back)
    # the tokenizer comes back as the source's files (a way back writing none passed its check: a mutation run)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((back / name).read_text()) == json.loads((tmp_path / "source" / name).read_text()), name
    # config.json holds the source's keys, not every default its class has (id2label, return_dict ...)
    source_keys = set(json.loads((tmp_path / "source" / "config.json").read_text()))
    assert set(json.loads((back / "config.json").read_text())) <= source_keys | {"transformers_version"}
    written_sampling = json.loads((back / "generation_config.json").read_text())
    assert {key: written_sampling.get(key) for key in sampling} == sampling, written_sampling
    original, written = AutoConfig.from_pretrained(tmp_path / "source"), AutoConfig.from_pretrained(back)
    assert type(written) is Qwen3Config and written.architectures == ["Qwen3ForCausalLM"]
    for field in ("head_dim", "num_key_value_heads", "attention_bias", "tie_word_embeddings", "rope_parameters"):
        assert getattr(written, field) == getattr(original, field), field
    # the license travels both ways, in the cards and as the file
    card = ModelCard.load(back / "README.md")
    assert (
        card.data.license == "mit" and card.data.tags == ["qwen3"] and (back / "LICENSE").read_text() == "MIT License"
    )
    checked = "Checked against the Thinker it was written from, this folder loaded as transformers' `Qwen3ForCausalLM`"
    assert checked in card.text and "| float32 |" in card.text


def test_qwen3_moe_round_trip_restores_per_expert_tensors(tmp_path):
    config = Qwen3MoeConfig(
        **dict(SMALL, num_hidden_layers=4),
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden / heads, as Qwen3-30B-A3B's 128 is not 2048 / 32: a key its class does not declare
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        mlp_only_layers=[2],
    )
    source = save_unfused_experts(build_reference(config), tmp_path / "source")
    back = round_trip(source, "qwen3_moe", tmp_path)
    assert_bit_exact(source, back)
    assert "model.layers.3.mlp.experts.4.up_proj.weight" in safetensors_of(back)
    assert json.loads((back / "config.json").read_text())["head_dim"] == 16


def test_qwen2_bfloat16_round_trip_is_bit_exact(tmp_path):
    config = Qwen2Config(**SMALL, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    build_reference(config).to(torch.bfloat16).save_pretrained(tmp_path / "source")
    back = round_trip(tmp_path / "source", "qwen2", tmp_path, verify_back=False)  # bit-exactness is the point
    assert_bit_exact(tmp_path / "source", back)
    assert next(iter(safetensors_of(back).values())).dtype == torch.bfloat16


def test_way_back_refuses_a_config_its_translation_cannot_make_in_one_line(tmp_path):
    """A Qwen3-VL-MoE Thinker (full rotary, mRoPE sections [4, 2, 2]) written as Qwen3.5-MoE, whose config makes
    partial rotary: the translated config fails ThinkerConfig's own validation, which reached the user as a
    traceback (a review); it is the same one-line refusal as any other, and nothing is written."""
    from references import qwen3_vl

    source = qwen3_vl.save(tmp_path / "source", moe=True)
    assert cli(source, tmp_path / "thinker", "--no-verify").exit_code == 0

    refused = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen3_5_moe")  # an exception would propagate
    assert refused.exit_code == 1
    assert "not expressible as qwen3_5_moe: rope_parameters['mrope_section']=[4, 2, 2]" in refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "back").exists()


def test_way_back_refuses_what_the_family_cannot_express(tmp_path):
    """A μOmni Thinker has a head bias and no qk-norm: as Qwen3 it would be another model, so nothing is written."""
    source = uomni.save_checkpoint(uomni.ThinkerLM(uomni.tiny_config()), tmp_path / "uomni")
    assert cli(source, tmp_path / "thinker").exit_code == 0

    refused = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen3")
    assert refused.exit_code == 1 and "not expressible as qwen3" in refused.output
    assert "qk_norm" in refused.output and "lm_head_bias" in refused.output
    assert not (tmp_path / "back").exists()

    no_table = cli(tmp_path / "thinker", tmp_path / "back", "--to", "uomni")
    assert no_table.exit_code == 1 and "cannot be written back as uomni" in no_table.output

    unknown = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen9")
    assert unknown.exit_code == 1 and "--to 'qwen9' names no family" in unknown.output
    accepted = unknown.output.split("--to accepts ")[1].split()
    assert [name.rstrip(",") for name in accepted] == exportable_families(), unknown.output

    not_thinker = cli(source, tmp_path / "back", "--to", "qwen3")
    assert not_thinker.exit_code == 1 and "Thinker folder" in not_thinker.output

    for option, what in [("--revision", "a Hub revision"), ("--gguf-file", "a GGUF file")]:
        picked = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen2", option, "v1")
        assert picked.exit_code == 1 and f"{option} picks {what} of SOURCE; --to takes a local" in picked.output

    both = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen2", "--no-verify", "--verify-by-layer")
    assert both.exit_code == 1 and "--verify-by-layer asks for the check that --no-verify turns off" in both.output
    assert not (tmp_path / "back").exists()


def test_the_help_names_every_family_with_a_way_back():
    """``--help`` is written out (the CLI imports no converter for it); this holds it to the families' tables."""
    shown = " ".join(cli("--help").output.split())
    listed = shown.split("written out as FAMILY's own Hugging Face folder (")[1].split(")")[0]
    assert listed.split(", ") == exportable_families()


@pytest.mark.parametrize("mode", ["--verify", "--verify-by-layer"])
def test_way_back_to_a_narrower_dtype_verifies(tmp_path, mode):
    """``--to qwen3 --dtype bfloat16`` from a float32 Thinker: the check loads both at the written dtype (the Thinker
    rounded as the way back rounded it), so it passes, in float32 and bfloat16; against the float32 Thinker as it
    is, every bfloat16 rounding would count as a difference and no such way back could be written."""
    config = Qwen3Config(**SMALL, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    build_reference(config).save_pretrained(tmp_path / "source")
    assert cli(tmp_path / "source", tmp_path / "thinker", "--no-verify").exit_code == 0
    back = cli(tmp_path / "thinker", tmp_path / "back", "--to", "qwen3", "--dtype", "bfloat16", mode)
    assert back.exit_code == 0, back.output
    report = json.loads((tmp_path / "back" / "parity.json").read_text())
    assert report["passed"] and [r["dtype"] for r in report["results"]] == ["float32", "bfloat16"], report
    # the mode asked for (--verify-by-layer dropped on the way back ran whole-model: a mutation run)
    assert report["mode"] == ("layer-by-layer" if mode == "--verify-by-layer" else "whole-model")
    assert next(iter(safetensors_of(tmp_path / "back").values())).dtype == torch.bfloat16
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"  # loads as written


def test_way_back_refuses_a_tensor_the_family_has_no_place_for(qwen3_thinker, tmp_path):
    """A Thinker folder holding one tensor more than its model (an adapter left in): the way back would drop it
    silently, and its check passes (no forward reads the tensor), so it is refused by name and nothing is written."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_tensors(folder, lambda tensors: tensors.update({"model.layers.0.mlp.extra.weight": torch.ones(4, 32)}))
    refused = cli(folder, tmp_path / "back", "--to", "qwen3", "--no-verify")
    assert refused.exit_code == 1, refused.output
    expected = "holds model.layers.0.mlp.extra.weight (1 in all), which a qwen3 model has no place for"
    assert expected in " ".join(refused.output.split())
    assert not (tmp_path / "back").exists()


def test_way_back_card_names_the_output_folder(qwen3_thinker, tmp_path):
    """The card's title and its ``from_pretrained`` line name OUTPUT, the folder the user gets, not the hidden
    staging folder it was written in, which is gone after the install."""
    assert cli(qwen3_thinker, tmp_path / "my-qwen3", "--to", "qwen3", "--no-verify").exit_code == 0
    card = (tmp_path / "my-qwen3" / "README.md").read_text()
    assert "# my-qwen3" in card.splitlines()
    assert re.findall(r'from_pretrained\("([^"]*)"', card) == ["my-qwen3"], card


def test_way_back_to_an_existing_output_is_refused_before_any_work(qwen3_thinker, tmp_path, monkeypatch):
    """An earlier way back at OUTPUT without --force: refused at once with the advice to pass --force, not after
    writing and checking the whole folder, where the install found it "appeared during the run"."""
    from converter import back

    output = tmp_path / "back"
    assert cli(qwen3_thinker, output, "--to", "qwen3", "--no-verify").exit_code == 0
    before = (output / "model.safetensors").read_bytes()
    monkeypatch.setattr(back, "write_weights", lambda *args, **kwargs: pytest.fail("the way back did its work"))
    refused = cli(qwen3_thinker, output, "--to", "qwen3", "--no-verify")
    assert refused.exit_code == 1
    message = f"{output} already exists; pass --force to replace it once the new conversion is complete"
    assert message in " ".join(refused.output.split()) and "appeared during the run" not in refused.output
    assert (output / "model.safetensors").read_bytes() == before
