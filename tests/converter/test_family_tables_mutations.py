"""The family tables' config translations and drops held where the conversions of the neighbouring tests do not
reach (a mutation run's survivors): GPT-2 settings that tiny default configs leave at transformers' defaults, GPT-2's
refusals, the LLMs-from-scratch Qwen3's keys, Qwen4-Exp's routing switch, the rotary buffers older Llama / Qwen2
checkpoints carry. Each test reads a config, or converts a tiny checkpoint built with transformers' own classes (or
the reference implementation of ``tests/references/``), in a few seconds.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from convert_helpers import QWEN2, assert_same_logits, build_reference
from references import llms_from_scratch_qwen3 as scratch
from references.qwen4_exp import qwen4_exp_config, qwen4_exp_vl_config
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpTextConfig,
)

from converter.cli import convert_command
from converter.engine import translate_config
from converter.families.gpt2 import GPT2
from converter.families.llms_from_scratch_qwen3 import LLMS_FROM_SCRATCH_QWEN3
from converter.families.qwen2_moe import QWEN2_MOE
from converter.families.qwen4_exp import QWEN4_EXP
from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError

GPT2_SMALL = dict(vocab_size=71, n_embd=24, n_layer=2, n_head=3, n_positions=40, n_inner=40)


def cli_convert(*args):
    return CliRunner().invoke(convert_command, [str(arg) for arg in args], catch_exceptions=False)


# --- GPT-2 ---------------------------------------------------------------------------------------------------------


def test_gpt2_settings_other_than_the_defaults_reach_the_converted_config(save_reference, run_convert):
    """A GPT-2 on none of transformers' defaults: LayerNorm eps 1e-2, exact GELU (not gelu_new), its own special ids,
    an initialiser range, and an untied head. The converted config carries each (the ids and the range are not in
    the logits), and the logits are the reference's."""
    config = GPT2Config(
        **GPT2_SMALL,
        layer_norm_epsilon=1e-2,
        activation_function="gelu",
        initializer_range=0.037,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=5,
        tie_word_embeddings=False,
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert result.family == "gpt2" and result.parity.passed, result.parity.table()

    converted = ThinkerConfig.from_pretrained(result.output)
    assert converted.rms_norm_eps == 1e-2 and converted.hidden_act == "gelu"
    assert (converted.bos_token_id, converted.eos_token_id, converted.pad_token_id) == (2, 3, 5)
    assert converted.initializer_range == 0.037
    assert converted.tie_word_embeddings is False
    assert_same_logits(model, result.output)


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            {"scale_attn_by_inverse_layer_idx": True},
            "the source config sets scale_attn_by_inverse_layer_idx=True, an attention scaling Thinker lacks",
        ),
        (
            {"scale_attn_weights": False},
            "the source config sets scale_attn_weights=False, an attention scaling Thinker lacks",
        ),
        (
            {"add_cross_attention": True},
            "the source config adds cross-attention (add_cross_attention=true); Thinker is decoder-only",
        ),
    ],
    ids=["inverse-layer-scaling", "unscaled", "cross-attention"],
)
def test_gpt2_settings_thinker_lacks_are_refused_by_key(setting, message):
    """Attention scalings the Thinker does not build, and cross-attention, are refused naming the key, before any
    weight is read (with --no-verify such a checkpoint would otherwise convert to another model)."""
    with pytest.raises(ThinkerError) as refused:
        translate_config(GPT2, GPT2Config(**GPT2_SMALL, **setting).to_dict(), torch.float32)
    assert str(refused.value) == message


# --- LLMs-from-scratch Qwen3 -------------------------------------------------------------------------------------


def _scratch_config(**changes):
    config = {key: value for key, value in scratch.tiny_config().items() if key != "dtype"}
    return config | changes


def test_scratch_qwen3_config_keys_are_each_read():
    """The notebook's context_length and rope_base are the config's, not a release's; every RMSNorm has eps 1e-6;
    the head is stored (out_head), so untied; qk_norm absent means none, as in the notebook."""
    config = translate_config(
        LLMS_FROM_SCRATCH_QWEN3, _scratch_config(context_length=48, rope_base=5000.0), torch.float32
    )
    assert config.max_position_embeddings == 48
    assert config.rope_parameters["rope_theta"] == 5000.0 and config.rope_parameters["rope_type"] == "default"
    assert config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is False and config.qk_norm is True
    without = _scratch_config()
    del without["qk_norm"]
    assert translate_config(LLMS_FROM_SCRATCH_QWEN3, without, torch.float32).qk_norm is False


def test_scratch_qwen3_config_without_a_key_is_refused_in_one_line(tmp_path):
    reference = scratch.randomize_(scratch.Qwen3Model(scratch.tiny_config())).eval()
    source = scratch.save_checkpoint(reference, tmp_path / "scratch")
    config = json.loads((source / "config.json").read_text())
    del config["rope_base"]
    (source / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(convert_command, [str(source), str(tmp_path / "out")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    last = result.output.strip().splitlines()[-1]
    assert last == "error: LLMs-from-scratch Qwen3 config.json lacks the key 'rope_base'", last
    assert not (tmp_path / "out").exists()


# --- Qwen4-Exp -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [qwen4_exp_config, qwen4_exp_vl_config], ids=["causal-lm", "vision-language"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "raw-topk"])
def test_qwen4_exp_routing_renormalises_as_its_config_says(make, norm_topk_prob):
    """Qwen4-Exp's router reads norm_topk_prob (Qwen3.5-MoE's class always renormalises): the Thinker's switch is the
    one transformers' own router is built with, not Qwen3.5-MoE's fixed True."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter

    hf = make(norm_topk_prob=norm_topk_prob)
    expected = Qwen4ExpTextTopKRouter(hf.get_text_config(decoder=True)).norm_topk_prob
    assert expected is norm_topk_prob
    assert translate_config(QWEN4_EXP, hf.to_dict(), torch.float32).norm_topk_prob is expected


@pytest.mark.parametrize("seed", [1234, 7])
def test_qwen4_exp_way_back_writes_the_hash_seed_under_its_own_name(seed):
    """The Thinker's ``ngram_seed`` is Qwen4-Exp's ``seed``: the way back's config names it so, a seed other than
    the class's default (1234) included; under the Thinker's name the class would ignore it and draw another hash."""
    config = translate_config(QWEN4_EXP, qwen4_exp_config(seed=seed).to_dict(), torch.float32)
    assert config.ngram_seed == seed
    written = QWEN4_EXP.export_config(config)
    assert "ngram_seed" not in written
    assert written.get("seed", 1234) == seed
    assert Qwen4ExpTextConfig.from_dict(written).seed == seed


def test_qwen4_exp_hash_buffers_are_checked_in_the_vision_language_layout_too(tmp_path):
    """The hash buffers a vision-language checkpoint stores (under ``model.language_model.``) are held to the config
    as the causal-LM layout's are: one that disagrees is refused by name before anything is written (unchecked, it
    converted with --no-verify to a model whose hash is not the one transformers runs)."""
    from references.hybrid import reference
    from safetensors.torch import load_file

    reference(Qwen4ExpForConditionalGeneration, qwen4_exp_vl_config()).save_pretrained(tmp_path / "source")
    name = "model.language_model.layers.0.ple.ple_embedding.layer_multipliers"
    tensors = load_file(tmp_path / "source" / "model.safetensors")
    tensors[name].add_(2)
    save_file(tensors, tmp_path / "source" / "model.safetensors", metadata={"format": "pt"})
    result = cli_convert(tmp_path / "source", tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and not (tmp_path / "out").exists(), result.output
    assert f"tensor {name!r}" in result.output and "is not the n-gram hash the config implies" in result.output


# --- Qwen2-MoE ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_bias", [True, False], ids=["qkv-bias", "no-qkv-bias"])
def test_qwen2_moe_way_back_writes_the_bias_switch_as_qkv_bias(qkv_bias):
    """Qwen2-MoE spells the Thinker's ``attention_bias`` ``qkv_bias``: the way back's config sets that key, so a model
    without q/k/v biases is written as one (under the Thinker's name the class ignored it, defaulted to biases, and
    the way back refused the model as inexpressible)."""
    hf = Qwen2MoeConfig(**QWEN2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, qkv_bias=qkv_bias)
    config = translate_config(QWEN2_MOE, hf.to_dict(), torch.float32)
    assert config.attention_bias is qkv_bias and config.attention_output_bias is False
    written = QWEN2_MOE.export_config(config)
    assert "attention_bias" not in written
    assert Qwen2MoeConfig.from_dict(written).qkv_bias is qkv_bias


# --- rotary buffers of older Llama / Qwen2 checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config], ids=["llama", "qwen2"])
def test_saved_rotary_buffers_are_dropped(config_class, tmp_path, run_convert):
    """transformers 4.x saved each layer's ``self_attn.rotary_emb.inv_freq`` with the weights: derived from the
    config, so skipped on purpose; the checkpoint converts with the reference's logits."""
    config = config_class(**QWEN2)
    model = build_reference(config)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    for layer in range(config.num_hidden_layers):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = model.model.rotary_emb.inv_freq.clone()
    source = tmp_path / "source"
    source.mkdir()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(source)
    result = run_convert(source, verify=False)
    assert result.family == config.model_type
    assert_same_logits(model, result.output)
