"""Load without converting: source checkpoints straight into ``ThinkerForCausalLM`` through the family tables
(``converter.load``), with the parity of each family against its reference, and nothing written to disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from convert_helpers import PROMPTS, build_reference, save_unfused_experts
from references import llms_from_scratch_qwen3 as scratch
from references import qwen3_omni, uomni
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from converter.load import config_for, load_thinker
from thinker import (
    ThinkerForCausalLM,
    ThinkerForQuestionAnswering,
    ThinkerForSequenceClassification,
    ThinkerForTokenClassification,
    ThinkerModel,
)
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import left_padded

ATOL = 1e-5
REPO = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[5, 17, 3, 29, 11, 2, 40, 8, 0, 63], [7, 1, 33, 12, 96, 4, 26, 19, 44, 2]])


@torch.no_grad()
def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    return model(input_ids=ids).logits


@torch.no_grad()
def assert_same_padded_logits(reference, model) -> None:
    ids, mask, positions = left_padded(PROMPTS)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    real = mask.bool()
    torch.testing.assert_close(model(**inputs).logits[real], reference(**inputs).logits[real], atol=ATOL, rtol=ATOL)


def test_load_qwen3_omni_thinker(tmp_path):
    source = qwen3_omni.save(tmp_path / "omni")
    model = load_thinker(source)
    assert isinstance(model, ThinkerForCausalLM) and not model.training
    assert not list(tmp_path.glob("*thinker*"))  # nothing converted on disk
    expected = qwen3_omni.thinker_logits(qwen3_omni.load_reference_thinker(source), IDS)
    torch.testing.assert_close(logits(model), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("gqa", [False, True], ids=["fused-qkv", "gqa"])
def test_load_uomni(tmp_path, gqa: bool):
    reference = uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config(gqa=gqa))).eval()
    model = load_thinker(uomni.save_checkpoint(reference, tmp_path / "uomni"))
    with torch.no_grad():
        torch.testing.assert_close(logits(model), reference(IDS), atol=ATOL, rtol=0)


def test_load_llms_from_scratch_qwen3_in_another_dtype(tmp_path):
    reference = scratch.randomize_(scratch.Qwen3Model(scratch.tiny_config())).eval()
    folder = scratch.save_checkpoint(reference, tmp_path / "scratch")
    with torch.no_grad():
        torch.testing.assert_close(logits(load_thinker(folder)), reference(IDS), atol=ATOL, rtol=0)
    assert load_thinker(folder, dtype="bfloat16").dtype == torch.bfloat16


def test_load_qwen3_moe_hub_layout(tmp_path):
    config = Qwen3MoeConfig(
        vocab_size=67,
        hidden_size=32,
        num_hidden_layers=3,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        decoder_sparse_step=2,
    )
    reference = build_reference(config)
    model = load_thinker(save_unfused_experts(reference, tmp_path / "per-expert"), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"  # from_pretrained options pass through
    assert_same_padded_logits(reference, model)


def test_auto_model_builds_the_thinker_from_a_qwen3_folder(save_reference):
    """Qwen3 already speaks Thinker's tensor names: given the translated config, plain transformers loading (here
    ``AutoModelForCausalLM`` after ``import thinker``) builds the Thinker from the Qwen3 folder as it is."""
    config = Qwen3Config(
        vocab_size=67,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
    )
    reference, folder = save_reference(config)
    thinker_config = config_for(folder)
    assert thinker_config.qk_norm and thinker_config.head_dim == 12
    model = AutoModelForCausalLM.from_pretrained(folder, config=thinker_config).eval()
    assert isinstance(model, ThinkerForCausalLM)
    assert_same_padded_logits(reference, model)


def test_config_for_names_a_thinker_folders_bad_value_by_key(save_reference, run_convert, tmp_path):
    """A Thinker folder's config.json is read by key first, as ``thinker export`` reads it (a review: the Python
    API gave the type check's words, or for a size as text one naming another key)."""
    import json

    from thinker_common.errors import ThinkerError

    _, source = save_reference(Qwen3Config(vocab_size=67, hidden_size=32, num_hidden_layers=2, intermediate_size=40))
    folder = run_convert(source, verify=False).output
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    with pytest.raises(ThinkerError, match=r"config\.json: num_hidden_layers='2' must be a whole number above 0"):
        config_for(folder)


def test_load_runs_the_converter_checks(tmp_path):
    """The same completeness checks as a conversion: a tensor no rule maps is an error that names it."""
    reference = uomni.ThinkerLM(uomni.tiny_config())
    folder = uomni.save_checkpoint(reference, tmp_path / "uomni")
    state = torch.load(folder / uomni.WEIGHTS_NAME, weights_only=True)
    state["blocks.0.attn.extra.weight"] = torch.zeros(2)
    torch.save(state, folder / uomni.WEIGHTS_NAME)
    with pytest.raises(ThinkerError, match=r"blocks\.0\.attn\.extra\.weight"):
        load_thinker(folder)


def test_load_a_thinker_folder_as_it_is(tmp_path):
    reference = uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config())).eval()
    model = load_thinker(uomni.save_checkpoint(reference, tmp_path / "uomni"))
    model.save_pretrained(tmp_path / "thinker")
    again = load_thinker(tmp_path / "thinker")
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)
    saved = load_file(tmp_path / "thinker" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in saved and "lm_head.bias" in saved


def test_thinker_from_pretrained_converts_a_foreign_folder_on_load(tmp_path):
    """``ThinkerForCausalLM.from_pretrained(<Qwen3-MoE folder, per-expert tensors>)`` goes through the family tables
    (transformers alone would drop q_norm/k_norm and the per-expert tensors with a warning)."""
    config = Qwen3MoeConfig(
        vocab_size=101, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mlp_only_layers=[0], norm_topk_prob=True,
    )  # fmt: skip
    reference = build_reference(config, seed=3).eval()
    folder = save_unfused_experts(reference, tmp_path / "qwen3_moe")
    reference.config.save_pretrained(folder)
    model = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.qk_norm and model.config.mlp_layer_types == ["dense", "sparse"]
    torch.testing.assert_close(logits(model), logits(reference), atol=ATOL, rtol=ATOL)
    # A Thinker folder still takes transformers' own path, unchanged.
    model.save_pretrained(tmp_path / "native")
    again = ThinkerForCausalLM.from_pretrained(tmp_path / "native")
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)


def test_the_decoder_and_the_heads_on_a_foreign_folder(tmp_path):
    """``ThinkerModel.from_pretrained(<Qwen3-MoE folder>)`` converts on load as ``ThinkerForCausalLM`` does (its
    hidden states those of transformers' Qwen3MoeModel; transformers alone would build a model without q/k norms or
    experts, at random, with a warning); a task head, which no foreign checkpoint holds, is refused by name."""
    config = Qwen3MoeConfig(
        vocab_size=101, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    reference = build_reference(config, seed=3).eval()
    folder = save_unfused_experts(reference, tmp_path / "qwen3_moe")
    decoder = ThinkerModel.from_pretrained(folder, dtype=torch.float32)
    assert type(decoder) is ThinkerModel and decoder.config.qk_norm
    with torch.no_grad():
        hidden = decoder(input_ids=IDS).last_hidden_state
        torch.testing.assert_close(hidden, reference.model(input_ids=IDS).last_hidden_state, atol=ATOL, rtol=ATOL)
    decoder, info = ThinkerModel.from_pretrained(folder, output_loading_info=True)
    assert type(decoder) is ThinkerModel and not info["missing_keys"], info
    for head in (ThinkerForSequenceClassification, ThinkerForTokenClassification, ThinkerForQuestionAnswering):
        with pytest.raises(ValueError, match=f"loads Thinker checkpoints only .* then {head.__name__}.from_pretrained"):
            head.from_pretrained(folder)


def test_from_pretrained_on_a_foreign_folder_takes_transformers_loading_arguments(tmp_path):
    """As for transformers' own classes: ``torch_dtype`` (the former name of ``dtype``) is honoured, and
    ``output_loading_info=True`` returns the model, in eval mode, with what transformers found."""
    config = Qwen3MoeConfig(
        vocab_size=101, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    folder = save_unfused_experts(build_reference(config, seed=3), tmp_path / "qwen3_moe")
    assert ThinkerForCausalLM.from_pretrained(folder, torch_dtype=torch.float16).dtype == torch.float16
    model, info = ThinkerForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not model.training and not info["missing_keys"] and not info["unexpected_keys"], info


GATED = "acme/gated-qwen3"


def test_from_pretrained_passes_every_hub_argument_to_the_hub(fake_hub, save_reference, tmp_path):
    """A gated Hub repo of another family, its checkpoint in a subfolder of a tagged revision: ``from_pretrained``
    converts it on load, and ``token``, ``cache_dir``, ``revision``, ``subfolder``, ``force_download`` and
    ``local_files_only`` all reach the (fake, local) Hub as they would in transformers."""
    config = Qwen3Config(
        vocab_size=101, hidden_size=32, num_hidden_layers=2, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    reference, folder = save_reference(config, name="repo/weights")
    fake_hub.add_repo(GATED, folder.parent, revision="v1", gated=True)
    cache = tmp_path / "my-cache"
    hub = {"revision": "v1", "subfolder": "weights", "cache_dir": cache}

    with pytest.raises(OSError, match="gated"):  # no token: the Hub refuses, as it does for transformers' own classes
        ThinkerForCausalLM.from_pretrained(GATED, **hub)
    model = ThinkerForCausalLM.from_pretrained(GATED, token=fake_hub.TOKEN, dtype=torch.float32, **hub)
    assert_same_padded_logits(reference, model)
    weights = [r for r in fake_hub.file_requests("GET") if r.path.endswith("weights/model.safetensors")]
    assert len(weights) == 1 and weights[0].authorization == f"Bearer {fake_hub.TOKEN}"
    assert (cache / "models--acme--gated-qwen3").is_dir() and not fake_hub.cache.exists()  # cache_dir, not the default

    ThinkerForCausalLM.from_pretrained(GATED, token=fake_hub.TOKEN, force_download=True, **hub)
    assert len([r for r in fake_hub.file_requests("GET") if r.path.endswith("weights/model.safetensors")]) == 2

    asked = len(fake_hub.requests)
    again = ThinkerForCausalLM.from_pretrained(GATED, local_files_only=True, dtype=torch.float32, **hub)
    assert len(fake_hub.requests) == asked  # the cache alone answered
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)


def test_config_for_reads_the_revision_asked(fake_hub, save_reference):
    """``config_for`` pairs with ``from_pretrained(config=...)``: the config of another revision than the weights'
    would build another model around them."""
    for name, layers, revision in (("one", 1, "main"), ("two", 2, "v2")):
        config = Qwen3Config(
            vocab_size=101, hidden_size=32, num_hidden_layers=layers, intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
        )  # fmt: skip
        fake_hub.add_repo("acme/q3", save_reference(config, name=name)[1], revision=revision)
    assert config_for("acme/q3").num_hidden_layers == 1
    assert config_for("acme/q3", revision="v2").num_hidden_layers == 2


def test_a_foreign_checkpoint_needs_the_converter_registered(save_reference, tmp_path):
    """``import thinker`` alone does not import the converter; a foreign checkpoint is then refused with an error
    saying what to import, rather than loaded with random weights."""
    _, folder = save_reference(Qwen3Config(vocab_size=67, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
    code = (
        "from thinker import ThinkerForCausalLM\n"
        f"try:\n    ThinkerForCausalLM.from_pretrained({str(folder)!r})\n"
        "except ValueError as err:\n    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "import converter.load" in done.stdout and str(folder) in done.stdout
