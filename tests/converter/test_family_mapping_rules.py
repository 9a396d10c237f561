"""The families' declarative rules held to the classes they describe, where the conversions in the neighbouring tests
do not reach: a config's translation compared with what transformers' own class builds from the same config (its
rotary tables, its multimodal sections), and the fields and messages a user reads in the converted ``config.json``
or in a refusal. No weights are trained or compared here; each test reads configs, or plans a checkpoint of zeros
built on the meta device, so each takes a second or two.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from convert_helpers import class_mrope_streams
from references import qwen2_5_omni, qwen3_omni
from references.hybrid import HYBRID_SIZES, LAYER_TYPES, MOE_SIZES
from safetensors.torch import save_file
from transformers import (
    Qwen2_5OmniConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from converter.engine import plan_conversion, translate_config
from converter.families.qwen2_5_omni import QWEN2_5_OMNI
from converter.families.qwen3_5 import QWEN3_5
from converter.families.qwen3_5_moe import QWEN3_5_MOE
from thinker.modeling_thinker import ThinkerRotaryEmbedding, mrope_streams
from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource


def rotary_class(model_type: str, name: str):
    return getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)


def decoder_of_zeros(folder, config, text_model_class, text_config, prefix: str, head: str | None = None):
    """``config`` saved beside a checkpoint holding only its text decoder (``text_model_class`` of ``text_config``,
    built on the meta device, every value zero, under ``prefix``) and the head ``head``: what a plan reads."""
    with torch.device("meta"):
        model = text_model_class(text_config)
    tensors = {prefix + name: torch.zeros(t.shape) for name, t in model.state_dict().items()}
    if head is not None:
        tensors[head] = torch.zeros(text_config.vocab_size, text_config.hidden_size)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


# --- multimodal RoPE: the section a class falls back to when the config names none --------------------------------


def _qwen3_5_text(config_class, **sizes):
    """A Qwen3.5 text config on the releases' full-attention head (256, rotary 0.25: 32 frequencies) naming no
    mrope_section, as older config.json files do."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    return config_class(**{**HYBRID_SIZES, **sizes, "head_dim": 256, "rope_parameters": rope})


def _qwen3_5_without_section():
    text = _qwen3_5_text(Qwen3_5TextConfig, intermediate_size=48)
    return QWEN3_5, text, text, rotary_class("qwen3_5", "Qwen3_5TextRotaryEmbedding"), True


def _qwen3_5_moe_without_section():
    text = _qwen3_5_text(Qwen3_5MoeTextConfig, **MOE_SIZES)
    return QWEN3_5_MOE, text, text, rotary_class("qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding"), True


def _qwen2_5_omni_without_section():
    text = qwen2_5_omni.TEXT_CONFIG | {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    hf = Qwen2_5OmniConfig(thinker_config=qwen2_5_omni.THINKER_CONFIG | {"text_config": text})
    text_config = hf.thinker_config.text_config
    return QWEN2_5_OMNI, hf, text_config, rotary_class("qwen2_5_omni", "Qwen2_5OmniRotaryEmbedding"), False


@pytest.mark.parametrize(
    "make",
    [_qwen3_5_without_section, _qwen3_5_moe_without_section, _qwen2_5_omni_without_section],
    ids=["qwen3_5", "qwen3_5_moe", "qwen2_5_omni"],
)
def test_without_mrope_section_the_translation_takes_the_classs_fallback(make):
    """Qwen3.5's ([11, 11, 10], interleaved) and Qwen2.5-Omni's ([16, 24, 24], contiguous) fallback sections, read
    from the classes themselves: every frequency of the translated config reads the position stream (temporal,
    height, width) the reference's rotary embedding gives it, so image and video positions rotate as the
    reference's."""
    family, hf, text, rotary_cls, interleaved = make()
    assert "mrope_section" not in text.rope_parameters
    rotary = rotary_cls(text)
    assert sum(rotary.mrope_section) == rotary.inv_freq.numel()

    ours = translate_config(family, hf.to_dict(), torch.float32).rope_parameters
    assert ours["mrope_section"] == list(rotary.mrope_section)
    assert ours["mrope_interleaved"] is interleaved
    assert torch.equal(mrope_streams(ours["mrope_section"], ours["mrope_interleaved"]), class_mrope_streams(rotary))


# --- partial rotary under a scaled RoPE ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", [QWEN3_5, QWEN3_5_MOE], ids=lambda f: f.name)
def test_a_partial_rotary_yarn_config_converts_with_the_classs_tables(family):
    """Qwen3.5's classes rotate the first ``partial_rotary_factor`` of each head under any RoPE type, a scaled one
    included (transformers' initialisers read the factor): such a config is a model to convert, not one to refuse
    as it is for the classes that rotate the whole head. The Thinker's tables are the reference's."""
    config_class, rotary_name = {
        "qwen3_5": (Qwen3_5TextConfig, "Qwen3_5TextRotaryEmbedding"),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, "Qwen3_5MoeTextRotaryEmbedding"),
    }[family.name]
    rope = dict(HYBRID_SIZES["rope_parameters"], rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    sizes = {"intermediate_size": 48} if family.name == "qwen3_5" else MOE_SIZES
    text = config_class(**{**HYBRID_SIZES, **sizes, "rope_parameters": rope})
    theirs = rotary_class(family.name, rotary_name)(text)

    config = translate_config(family, text.to_dict(), torch.float32)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.rope_parameters["rope_type"] == "yarn"
    ours = ThinkerRotaryEmbedding(config)
    assert ours.inv_freq.numel() == theirs.inv_freq.numel() == 4
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling, abs=0)


# --- what a converted config.json says -----------------------------------------------------------------------------


def test_the_decoders_settings_are_carried_into_the_thinker_config():
    """Settings the logits do not show, which the converted config.json still carries for whoever trains or extends
    the model (its initialiser's range, its attention dropout): the source's, not a default."""
    text = Qwen3_5TextConfig(
        **{**HYBRID_SIZES, "intermediate_size": 48, "initializer_range": 0.037, "attention_dropout": 0.125}
    )
    config = translate_config(QWEN3_5, text.to_dict(), torch.float32)
    assert (config.initializer_range, config.attention_dropout) == (0.037, 0.125)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_moe"])
def test_qwen3_5_moe_is_sparse_in_every_layer_and_its_dense_width_is_the_experts(model_type):
    """Qwen3.5-MoE has no dense layer and no dense intermediate_size: every Thinker layer is sparse, renormalising its
    top-k (the class always does), with the shared expert's width; the Thinker's intermediate_size is the expert
    width rather than a default that describes no tensor."""
    from transformers import Qwen3_5MoeConfig

    sizes = {**HYBRID_SIZES, **MOE_SIZES}
    source = Qwen3_5MoeTextConfig(**sizes) if model_type.endswith("_text") else Qwen3_5MoeConfig(text_config=sizes)
    config = translate_config(QWEN3_5_MOE, source.to_dict(), torch.float32)
    assert config.mlp_layer_types == ["sparse"] * HYBRID_SIZES["num_hidden_layers"]
    assert config.intermediate_size == config.moe_intermediate_size == MOE_SIZES["moe_intermediate_size"]
    assert config.shared_expert_intermediate_size == MOE_SIZES["shared_expert_intermediate_size"]
    assert config.norm_topk_prob is True


# --- refusals and their advice --------------------------------------------------------------------------------------


def test_qwen3_omni_without_its_untied_head_names_the_thinker_configs_tie(tmp_path):
    """Qwen3-Omni declares the head's tie on ``thinker_config`` (its text config has no such field): a full checkpoint
    with an untied head missing is refused with that key, the one a user can set, as for Qwen2.5-Omni."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    config = qwen3_omni.tiny_config()
    assert config.thinker_config.tie_word_embeddings is False
    text = config.thinker_config.text_config
    folder = decoder_of_zeros(tmp_path / "headless", config, Qwen3OmniMoeThinkerTextModel, text, "thinker.model.")
    source = SafetensorsSource(folder)
    with pytest.raises(ThinkerError) as refused:
        plan_conversion(source, source.config())
    message = str(refused.value)
    assert "untied output head (thinker_config.tie_word_embeddings=false)" in message
    assert "no thinker.lm_head.weight" in message
    assert "set thinker_config.tie_word_embeddings to true" in message


@pytest.mark.parametrize("key", ["num_hidden_layers", "mtp_num_hidden_layers"])
def test_a_qwen3_5_config_claiming_a_billion_layers_is_refused_at_once(key, tmp_path):
    """Qwen3.5's config counts the decoder's layers and its multi-token-prediction head's; either, far beyond what
    the checkpoint holds, is a config that does not describe these weights, refused before anything is built from
    it, naming the key."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config = Qwen3_5TextConfig(**HYBRID_SIZES, intermediate_size=48)
    folder = decoder_of_zeros(tmp_path / "source", config, Qwen3_5TextModel, config, "model.", "lm_head.weight")
    edited = json.loads((folder / "config.json").read_text()) | {key: 10**9}
    (folder / "config.json").write_text(json.dumps(edited))
    source = SafetensorsSource(folder)
    with pytest.raises(ThinkerError, match=rf"the source config.json says {key}=1000000000, but the checkpoint holds"):
        plan_conversion(source, source.config())


@pytest.mark.parametrize("family", [QWEN3_5, QWEN3_5_MOE], ids=lambda f: f.name)
def test_a_hybrid_decoder_with_attention_biases_keeps_them(family, tmp_path):
    """``attention_bias`` is a setting of Qwen3.5's config that its full-attention layers read (q/k/v/o biases): a
    checkpoint that has them plans every bias onto the Thinker's, none left over as an unknown tensor."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

    if family is QWEN3_5:
        config, text_model = (
            Qwen3_5TextConfig(**HYBRID_SIZES, intermediate_size=48, attention_bias=True),
            Qwen3_5TextModel,
        )
    else:
        config, text_model = Qwen3_5MoeTextConfig(**HYBRID_SIZES, **MOE_SIZES, attention_bias=True), Qwen3_5MoeTextModel
    folder = decoder_of_zeros(tmp_path / "source", config, text_model, config, "model.", "lm_head.weight")
    source = SafetensorsSource(folder)
    biases = {name for name in source.names() if name.endswith("_proj.bias")}
    assert len(biases) == 4 * LAYER_TYPES.count("full_attention")

    plan = plan_conversion(source, source.config())
    assert plan.family is family and plan.config.attention_bias is True
    assert biases <= {name for step in plan.steps for name in step.sources}
