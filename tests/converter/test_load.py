"""Load without converting: source checkpoints straight into ``ThinkerForCausalLM`` through the family tables
(``converter.load``), with the parity of each family against its reference, and nothing written to disk."""

from __future__ import annotations

import pytest
import torch
from convert_helpers import PROMPTS, build_reference, save_unfused_experts
from references import llms_from_scratch_qwen3 as scratch
from references import qwen3_omni, uomni
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from converter.errors import ThinkerError
from converter.load import config_for, load_thinker
from converter.parity import left_padded
from thinker import ThinkerForCausalLM

ATOL = 1e-5
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
