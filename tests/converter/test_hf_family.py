"""``hf_family``: a Hugging Face family from its differences, with the layouts a decoder is saved in.

The next families (Qwen3.5 / Qwen3-Next) store their text decoder either alone (``model.*``) or inside a
vision-language model (``model.language_model.*``, beside ``model.visual.*`` and a multi-token-prediction head
``mtp.*`` that do not convert). This builds such a family for Qwen3 weights, saved in both layouts, and checks that
the engine takes the layout present, drops the rest by prefix, and still refuses a tensor nobody claims.
"""

from __future__ import annotations

import pytest
import torch
from convert_helpers import assert_same_logits, build_reference
from safetensors.torch import save_file
from transformers import Qwen3Config

from converter.engine import LeftOut, left_out, plan_conversion, write_weights
from converter.families import detect_family
from converter.families.common import (
    ATTENTION,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    QK_NORMS,
    hf_family,
    layer_names,
)
from converter.model_card import left_out_section
from converter.output import write_thinker_config
from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource

EXTRA_GROUP = layer_names("self_attn.q_proj.bias")  # a group the model of this config lacks: inert

FAMILY = hf_family(
    "qwen3",
    ("Qwen3ForCausalLM", "Qwen3VLStyleForConditionalGeneration"),
    "Qwen3 weights, alone or inside a vision-language checkpoint",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, QK_NORMS, DENSE_MLP, EXTRA_GROUP),
    lambda hf: {"attention_bias": hf.attention_bias, "qk_norm": True},
    name="qwen3_layouts",
    layouts=({}, {"model.": "model.language_model."}),
    dropped_prefixes=("model.visual.", "mtp."),
)
CONFIG = Qwen3Config(
    vocab_size=67, hidden_size=32, num_hidden_layers=2, intermediate_size=40, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
)  # fmt: skip


def save(model, folder, layout: str, extra: dict[str, torch.Tensor] | None = None):
    folder.mkdir()
    state = {
        (name.replace("model.", "model.language_model.", 1) if layout == "vl" else name): tensor.contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state | (extra or {}), folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return SafetensorsSource(folder)


@pytest.mark.parametrize("layout", ["causal-lm", "vl"])
def test_each_layout_converts_exactly(layout, tmp_path):
    model = build_reference(CONFIG)
    extra = {"model.visual.patch_embed.weight": torch.ones(4, 3), "mtp.fc.weight": torch.ones(2, 2)}
    source = save(model, tmp_path / "source", layout, extra if layout == "vl" else None)
    assert FAMILY.recognises(source.config(), set(source.names()))

    plan = plan_conversion(source, source.config(), family=FAMILY)
    prefix = "model.language_model." if layout == "vl" else "model."
    assert {name for step in plan.steps for name in step.sources if name.startswith("model.")} <= {
        name for name in source.names() if name.startswith(prefix)
    }
    assert plan.dropped == (sorted(extra) if layout == "vl" else [])
    expected = [LeftOut("model.visual.", 1, mtp=False), LeftOut("mtp.", 1, mtp=True)]
    assert left_out(plan) == (expected if layout == "vl" else [])
    (tmp_path / "out").mkdir()
    write_weights(plan, source, tmp_path / "out", max_shard_size=10**9, progress=False)
    write_thinker_config(tmp_path / "out", plan.config)
    assert_same_logits(model, tmp_path / "out")


def test_the_card_says_what_was_left_out_and_how_a_tower_reaches_the_decoder():
    both = left_out_section([LeftOut("model.visual.", 12, mtp=False), LeftOut("mtp.", 1, mtp=True)])
    assert "`model.visual.*` (12 tensors), `mtp.*` (1 tensor)" in both
    assert "as `inputs_embeds`" in both and "`mtp.*` is the multi-token-prediction block" in both
    only_mtp = left_out_section([LeftOut("blk.4.", 3, mtp=True)])
    assert "`blk.4.*` is the multi-token-prediction block" in only_mtp and "inputs_embeds" not in only_mtp
    assert left_out_section([]) == ""
    assert "deepstack_visual_embeds" not in both
    deepstack = left_out_section([LeftOut("model.visual.", 12, mtp=False)], deepstack=True)
    assert "DeepStack features" in deepstack and "`visual_pos_masks=` and `deepstack_visual_embeds=`" in deepstack


def test_a_peft_adapter_folder_or_repo_is_named_as_one(tmp_path):
    """As peft's save_pretrained writes it: adapter_config.json and adapter weights, no config.json. It was told it
    had no config.json (locally), or to check the repo id (on the Hub), a QA run found."""
    from converter.convert import convert
    from converter.hub import pick_conversion_files

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8)}
    save_file(lora, tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(ThinkerError, match=r"holds a PEFT adapter \(.*adapter_config.json, no config.json\).*merge"):
        convert(tmp_path / "adapter", tmp_path / "out", verify=False, progress=False)
    assert not (tmp_path / "out").exists()
    listing = ["adapter_config.json", "adapter_model.safetensors", "README.md"]
    with pytest.raises(ThinkerError, match=r"PEFT adapter \(acme/lora@main holds adapter_config.json"):
        pick_conversion_files(listing, "acme/lora@main")


def test_a_tensor_outside_every_layout_and_prefix_is_refused(tmp_path):
    source = save(build_reference(CONFIG), tmp_path / "source", "vl", {"model.audio.proj.weight": torch.ones(2)})
    with pytest.raises(ThinkerError, match=r"no qwen3_layouts rule maps .*model\.audio\.proj\.weight"):
        plan_conversion(source, source.config(), family=FAMILY)


def test_a_peft_adapter_is_named_as_one() -> None:
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    with pytest.raises(ThinkerError, match=r"holds a PEFT adapter .*merge_and_unload\(\)"):
        detect_family({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, names)


@pytest.mark.parametrize(
    ("model_type", "architecture", "expected"),
    [
        ("qwen3_5_moe_text", "Qwen3_5ForCausalLM", "qwen3_5_moe"),  # the MoE class transformers loads, 0 keys missing
        ("qwen3_next", "Qwen3_5ForCausalLM", "qwen3_next"),  # the reference the parity check loads
        ("qwen3", "Qwen3_5ForCausalLM", "qwen3"),
    ],
)
def test_the_model_type_names_the_family_over_the_architectures(model_type, architecture, expected):
    """transformers picks its class (and the parity check its reference) by model_type; a config whose
    architectures say otherwise (a hand edit) was converted by whichever family came first in FAMILIES: a Qwen3.5-MoE
    refused for lacking dense MLP tensors, a Qwen3-Next written with Qwen3.5's table (helper-248)."""
    names = ["model.embed_tokens.weight", "model.layers.0.linear_attn.in_proj_qkv.weight", "lm_head.weight"]
    config = {"model_type": model_type, "architectures": [architecture]}
    assert detect_family(config, names).name == expected


def test_a_reference_that_lacks_weights_its_class_needs_is_refused(tmp_path):
    """transformers draws the weights a checkpoint lacks at random and loads: the parity check then compared the
    conversion with a random reference and blamed the conversion (helper-248). Refused, naming the class and the
    weights."""
    from safetensors.torch import load_file

    from converter.parity import reference_from_pretrained

    folder = tmp_path / "source"
    build_reference(CONFIG).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    dropped = "model.layers.1.mlp.down_proj.weight"
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ThinkerError, match=rf"builds Qwen3ForCausalLM from it, and the checkpoint lacks .*{dropped}"):
        reference_from_pretrained(folder, folder)
