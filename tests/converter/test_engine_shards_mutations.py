"""Mutation-run survivors of converter/engine.py and converter/shards.py (QA helper-254): each test pins one
behaviour no other test held, on a plan or a tiny checkpoint, in a second or two."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from convert_helpers import QWEN2, build_reference, save_unfused_experts
from safetensors.torch import load_file, save_file
from transformers import Qwen2MoeConfig, Qwen3Config

from converter.engine import plan_conversion
from converter.families.qwen3 import QWEN3
from converter.ops import Each, Identity
from converter.shards import ShardLayout, ShardWriter
from converter.spec import rule
from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource


def test_a_rule_for_a_group_the_model_has_only_in_part_is_named_as_a_table_error(tmp_path):
    """A rule producing a weight the model has together with a bias it does not (attention_bias=false): the table and
    the config translation disagree, said as such, not as a tensor the checkpoint lacks."""
    build_reference(Qwen3Config(**QWEN2, head_dim=12)).save_pretrained(tmp_path)
    source = SafetensorsSource(tmp_path)
    q = "model.layers.{layer}.self_attn.q_proj."
    joint = rule((q + "weight", q + "bias"), (q + "weight", q + "bias"), Each(Identity(), Identity()))
    family = replace(QWEN3, tensors=tuple(r for r in QWEN3.tensors if q + "weight" not in r.targets) + (joint,))
    with pytest.raises(ThinkerError, match="which the Thinker model of this config does not have"):
        plan_conversion(source, source.config(), family=family)


def test_shared_expert_weights_a_zero_width_config_would_drop_are_refused(tmp_path):
    """Qwen2-MoE's class saves a shared expert 0 wide as empty projections, which the Thinker drops. A config saying
    0 beside a checkpoint whose shared expert has real width (an edited or mismatched config.json) must not drop
    those weights unsaid: the converted model would lack a part of every MoE layer."""
    config = Qwen2MoeConfig(
        **QWEN2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8
    )
    build_reference(config).save_pretrained(tmp_path)
    edited = json.loads((tmp_path / "config.json").read_text()) | {"shared_expert_intermediate_size": 0}
    (tmp_path / "config.json").write_text(json.dumps(edited))
    source = SafetensorsSource(tmp_path)
    width = r"shared_expert_intermediate_size 0, but the checkpoint's shared expert has width: .*_proj\.weight is \("
    with pytest.raises(ThinkerError, match=width):
        plan_conversion(source, source.config())


def test_a_stacked_rule_missing_one_of_its_sources_is_named(tmp_path):
    """A rule reads several tensors (every expert's down_proj stacked into one): a checkpoint lacking one of them is
    incomplete, refused naming it, not planned as if the rest were enough."""
    config = Qwen2MoeConfig(
        **QWEN2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8
    )
    folder = save_unfused_experts(build_reference(config), tmp_path / "source")
    missing = "model.layers.1.mlp.experts.1.down_proj.weight"
    tensors = load_file(folder / "model.safetensors")
    del tensors[missing]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = SafetensorsSource(folder)
    with pytest.raises(ThinkerError, match=r"lacks tensors.*experts\.1\.down_proj\.weight \(1 in all\)"):
        plan_conversion(source, source.config())


def test_the_writer_refuses_what_does_not_fit_its_slot_a_second_write_and_an_unwritten_tensor(tmp_path):
    """The writer's own guards, behind the plan's: a tensor of another shape (same bytes) or dtype, a tensor written
    twice, and a close with a tensor never written are errors, never a file holding the wrong bytes."""
    layout = ShardLayout([("a", (2, 3), torch.float32), ("b", (4,), torch.float32)], 10**9)
    with ShardWriter(tmp_path, layout) as writer:
        for wrong in (torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.int32)):
            with pytest.raises(RuntimeError, match="does not fit its planned slot"):
                writer.write("a", wrong)
        assert writer.write("a", torch.ones(2, 3)) == 24
        with pytest.raises(RuntimeError, match="written twice"):
            writer.write("a", torch.ones(2, 3))
        with pytest.raises(RuntimeError, match="never written"):
            writer.close()


def test_a_byte_copy_of_another_length_than_its_slot_is_refused(tmp_path):
    source = tmp_path / "bytes"
    source.write_bytes(bytes(range(32)))
    layout = ShardLayout([("a", (4,), torch.float32)], 10**9)
    (tmp_path / "out").mkdir()
    with ShardWriter(tmp_path / "out", layout) as writer, source.open("rb") as handle:
        with pytest.raises(RuntimeError, match="bytes for its planned slot"):
            writer.copy_range("a", handle.fileno(), 0, 20)
        assert writer.copy_range("a", handle.fileno(), 4, 16) == 16
        assert writer.close() == ["model.safetensors"]
    assert load_file(tmp_path / "out" / "model.safetensors")["a"].view(torch.uint8).tolist() == list(range(4, 20))


def test_a_parameter_no_rule_produces_is_refused_even_when_its_source_is_dropped(tmp_path):
    """A table that lacks the final norm's rule, its source tensor dropped on purpose: every source tensor is then
    accounted for, yet the converted folder would miss model.norm.weight (and transformers would fill it in at
    load time). Refused naming it."""
    build_reference(Qwen3Config(**QWEN2, head_dim=12)).save_pretrained(tmp_path)
    source = SafetensorsSource(tmp_path)
    norm = "model.norm.weight"
    family = replace(
        QWEN3, tensors=tuple(r for r in QWEN3.tensors if r.targets != (norm,)), dropped=(*QWEN3.dropped, norm)
    )
    with pytest.raises(ThinkerError, match=r"no qwen3 rule produces the Thinker parameters model\.norm\.weight"):
        plan_conversion(source, source.config(), family=family)


def test_a_tensor_stored_transposed_is_refused_though_its_size_fits(tmp_path):
    """A (48, 32) down_proj where the config makes it (32, 48): the same number of values in another shape is another
    model, refused naming the tensor, not written under the planned shape."""
    build_reference(Qwen3Config(**QWEN2, head_dim=12)).save_pretrained(tmp_path)
    down = "model.layers.1.mlp.down_proj.weight"
    tensors = load_file(tmp_path / "model.safetensors")
    tensors[down] = tensors[down].t().contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    source = SafetensorsSource(tmp_path)
    with pytest.raises(
        ThinkerError, match=r"disagree with the config: .*down_proj\.weight: \(48, 32\), expected \(32, 48\)"
    ):
        plan_conversion(source, source.config())


def test_a_parameter_two_rules_produce_is_refused_before_anything_is_written(tmp_path):
    """q_proj and k_proj produced by their own rules and again by a joint one: the table is wrong, said at planning
    (else the second write of each fails half-way through the conversion)."""
    build_reference(Qwen3Config(**QWEN2, head_dim=12)).save_pretrained(tmp_path)
    source = SafetensorsSource(tmp_path)
    q, k = (f"model.layers.{{layer}}.self_attn.{name}_proj.weight" for name in "qk")
    family = replace(QWEN3, tensors=(*QWEN3.tensors, rule((q, k), (q, k), Each(Identity(), Identity()))))
    with pytest.raises(ThinkerError, match=r"produces .*self_attn\.k_proj\.weight \(4 in all\) more than once"):
        plan_conversion(source, source.config(), family=family)
