"""Parity of every source family against its own transformers class, on awkward tiny configs.

Each test builds the family's reference model with random weights, saves it the way users find it, converts it
with the production tables, and checks twice: the converter's own parity gate (``--verify``) and a direct
``assert_close`` of float32 logits on a left-padded batch (atol = rtol = 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from convert_helpers import assert_same_logits, build_reference, save_unfused_experts
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from converter.parity import check_parity
from converter.parity_report import BY_LAYER
from thinker import ThinkerConfig, ThinkerForCausalLM

# Awkward on purpose: GQA, odd vocabularies, head_dim unrelated to hidden_size where the family allows it.
SMALL = {"vocab_size": 67, "hidden_size": 32, "num_hidden_layers": 3, "max_position_embeddings": 64}


def assert_verified(result, family: str) -> None:
    assert result.family == family
    assert result.parity is not None and result.parity.passed, result.parity and result.parity.table()
    fp32 = result.parity.results[0]
    assert fp32.dtype == "float32" and fp32.max_abs_diff <= 1e-4 * max(1.0, fp32.logit_scale)
    assert (result.output / "parity.json").is_file()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen2_with_biases(save_reference, run_convert, tied):
    # special ids apart, and a dropout: no logit shows them, so the gate cannot (each read from another key passed
    # it, a mutation run)
    fields = {"bos_token_id": 3, "eos_token_id": 5, "pad_token_id": 7, "attention_dropout": 0.1}
    config = Qwen2Config(
        **SMALL, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, **fields
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert_verified(result, "qwen2")
    written = ThinkerConfig.from_pretrained(result.output)
    assert written.tie_word_embeddings is tied
    assert {key: getattr(written, key) for key in fields} == fields
    assert_same_logits(model, result.output)


ROPE_AS_THE_CLASS_RUNS_IT = {
    # Qwen3's class reads no partial_rotary_factor: under the default type it rotates the whole head
    "partial factor the class ignores": (
        Qwen3Config,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ),
    # the one type whose table reads the factor (zero frequencies past it), which the class then runs
    "proportional": (
        Qwen3Config,
        {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ),
}


@pytest.mark.parametrize("case", list(ROPE_AS_THE_CLASS_RUNS_IT))
def test_rope_as_the_class_runs_it(case, save_reference, run_convert):
    """The RoPE transformers' class computes, which is not always what its config reads: these converted to another
    model, which the gate caught without naming a key (``converter/families/common.py`` ``reference_rope``)."""
    config_class, rope = ROPE_AS_THE_CLASS_RUNS_IT[case]
    config = config_class(
        **SMALL, intermediate_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=16, **rope
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)


def test_a_top_level_original_context_wins_as_in_transformers(save_reference, run_convert):
    """Phi-3's spelling: rope_scaling beside a top-level original_max_position_embeddings, which transformers' YaRN
    prefers to the nested one as it computes (the Thinker took the nested one: another model)."""
    import json

    config = LlamaConfig(**SMALL, intermediate_size=40, num_attention_heads=2, num_key_value_heads=1)
    _, source = save_reference(config)
    written = json.loads((source / "config.json").read_text())
    written.pop("rope_parameters")
    written |= {"rope_theta": 1e4, "original_max_position_embeddings": 4}
    written["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (source / "config.json").write_text(json.dumps(written))
    model = LlamaForCausalLM.from_pretrained(source).eval()
    result = run_convert(source)
    assert result.parity.passed, result.parity.table()
    assert_same_logits(model, result.output)
    assert ThinkerConfig.from_pretrained(result.output).rope_parameters["original_max_position_embeddings"] == 4


def test_a_scaled_rope_transformers_cannot_run_is_refused_by_key(save_reference, tmp_path):
    """YaRN and a partial_rotary_factor in Qwen3's config: transformers sizes the table by the factor and rotates
    the whole head, so its forward fails (it was a traceback inside the gate)."""
    from converter.convert import convert
    from thinker_common.errors import ThinkerError

    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    config = Qwen3Config(**SMALL, intermediate_size=40, num_attention_heads=2, head_dim=16, rope_parameters=rope)
    _, source = save_reference(config)
    with pytest.raises(ThinkerError, match="partial_rotary_factor=0.5 with rope_type 'yarn'"):
        convert(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_qwen3_qk_norm_free_head_dim_and_rope_scaling(save_reference, run_convert):
    config = Qwen3Config(
        **SMALL,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,  # != 32 / 4
        attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert_verified(result, "qwen3")
    converted = ThinkerConfig.from_pretrained(result.output)
    assert converted.qk_norm and converted.head_dim == 12 and converted.rope_parameters["rope_type"] == "linear"
    assert_same_logits(model, result.output)


QWEN2_MOE = dict(
    SMALL,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


def test_qwen2_moe_shared_expert(save_reference, run_convert):
    config = Qwen2MoeConfig(
        **QWEN2_MOE,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,  # layer 1 sparse, layers 0 and 2 dense
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert_verified(result, "qwen2_moe")
    assert ThinkerConfig.from_pretrained(result.output).mlp_layer_types == ["dense", "sparse", "dense"]
    assert_same_logits(model, result.output)


QWEN3_MOE = dict(
    SMALL,
    num_hidden_layers=4,
    intermediate_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "raw-topk"])
def test_qwen3_moe_per_expert_layout(tmp_path, run_convert, norm_topk_prob):
    # decoder_sparse_step=1 with mlp_only_layers=[2]: layers 0, 1, 3 sparse, layer 2 dense.
    config = Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=norm_topk_prob, mlp_only_layers=[2])
    model = build_reference(config)
    source = save_unfused_experts(model, tmp_path / "per-expert")
    with safe_open(source / "model.safetensors", "pt") as handle:
        assert "model.layers.0.mlp.experts.4.gate_proj.weight" in handle.keys()
    result = run_convert(source)
    assert_verified(result, "qwen3_moe")
    assert ThinkerConfig.from_pretrained(result.output).mlp_layer_types == ["sparse", "sparse", "dense", "sparse"]
    assert_same_logits(model, result.output)


def test_a_moe_that_outputs_its_router_logits(save_reference, run_convert):
    """A fine-tuned checkpoint's config may ask for the router's load-balancing loss (output_router_logits): the
    gate's decode steps do not trip over it, whole-model or layer by layer (whose padded batch transformers' class
    failed on with a traceback: a review), and the Thinker adds the same loss to a labelled forward."""
    model, source = save_reference(Qwen3MoeConfig(**QWEN3_MOE, output_router_logits=True, router_aux_loss_coef=0.05))
    result = run_convert(source)
    assert_verified(result, "qwen3_moe")
    assert check_parity(source, result.output, mode=BY_LAYER).passed
    converted = ThinkerForCausalLM.from_pretrained(result.output).eval()
    assert converted.config.output_router_logits is True
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    with torch.no_grad():
        expected, actual = model(input_ids=ids, labels=ids), converted(input_ids=ids, labels=ids)
        torch.testing.assert_close(actual.aux_loss, expected.aux_loss)
        torch.testing.assert_close(actual.loss, expected.loss)
        step = converted(input_ids=ids[:, -1:], attention_mask=torch.ones(1, 7), cache=actual.cache, use_cache=True)
    assert step.aux_loss is not None  # the new token's router logits, against its own column of the mask


def test_expert_rows_torch_grouped_mm_refuses_still_verify(save_reference, run_convert, tmp_path):
    """Experts 12 wide in bfloat16 (24-byte rows): torch's CPU grouped_mm, transformers' default experts, refuses
    strides that are not a multiple of 16 bytes. The gate and the export's verify run eager experts
    (thinker_common/eager.py) and pass; they failed with a traceback."""
    from export.exporter import export_model

    model, source = save_reference(Qwen3MoeConfig(**QWEN3_MOE))
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):  # what the default implementation does
        with torch.no_grad():
            model.to(torch.bfloat16)(torch.tensor([[3, 14, 15]]))
    result = run_convert(source, dtype="bfloat16")
    assert result.parity.passed, result.parity.table()
    assert export_model(result.output, tmp_path / "onnx")["verify"]["passed"] is True


def test_a_shared_expert_zero_wide_is_dropped(save_reference, run_convert):
    """Qwen2-MoE with shared_expert_intermediate_size 0: its class writes empty projections and a gate that add
    exactly 0; the Thinker has no shared expert and converts the rest (it was refused as unmapped tensors)."""
    model, source = save_reference(Qwen2MoeConfig(**QWEN2_MOE, shared_expert_intermediate_size=0))
    result = run_convert(source)
    assert_verified(result, "qwen2_moe")
    assert ThinkerConfig.from_pretrained(result.output).shared_expert_intermediate_size == 0
    assert_same_logits(model, result.output)


def test_a_shared_expert_zero_wide_is_written_back_empty(save_reference, run_convert, tmp_path):
    """The way back writes the empty projections and the gate again (zeros: the source's gate values scaled an empty
    product), so that transformers loads the folder with nothing missing; every other tensor bit for bit. torch's
    warning about the reference's empty Linear is not shown to the user."""
    from cli_helpers import run_cli
    from safetensors.torch import load_file
    from transformers import Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**QWEN2_MOE, shared_expert_intermediate_size=0, mlp_only_layers=[0])
    model, source = save_reference(config)
    thinker = run_convert(source).output
    done = run_cli("convert", thinker, tmp_path / "back", "--to", "qwen2_moe")  # a fresh process: every warning shows
    assert done.returncode == 0, done.stderr
    assert "zero-element" not in done.stderr  # torch's warning on the reference's empty Linear is no news
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        expected = torch.zeros_like(tensor) if name.endswith("shared_expert_gate.weight") else tensor
        assert torch.equal(after[name], expected), name
    assert "model.layers.0.mlp.shared_expert_gate.weight" not in after  # a dense layer (mlp_only_layers) has none
    again, report = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(report.values()), report
    assert_same_logits(again.eval(), thinker)


def test_a_shared_expert_zero_wide_is_written_back_in_the_folders_dtype(save_reference, run_convert, tmp_path):
    """The way back of a bfloat16 Thinker derives the empty shared expert and its zero gate: they take the folder's
    dtype like every tensor beside them, not float32 (a float32 tensor in a bfloat16 folder is not the source)."""
    from click.testing import CliRunner

    from converter.cli import convert_command

    model, source = save_reference(Qwen2MoeConfig(**QWEN2_MOE, shared_expert_intermediate_size=0))
    model.to(torch.bfloat16).save_pretrained(source)
    thinker = run_convert(source, verify=False).output
    arguments = [str(thinker), str(tmp_path / "back"), "--to", "qwen2_moe", "--no-verify"]
    done = CliRunner().invoke(convert_command, arguments, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    with safe_open(tmp_path / "back" / "model.safetensors", "pt") as written:
        dtypes = {name: written.get_slice(name).get_dtype() for name in written.keys()}
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in dtypes
    assert {name: dtype for name, dtype in dtypes.items() if dtype != "BF16"} == {}


def test_a_sparse_step_of_zero_is_refused_by_key(save_reference, tmp_path):
    """decoder_sparse_step 0 divides by zero in transformers' class and the Thinker's (was a ZeroDivisionError)."""
    import json

    from converter.convert import convert
    from thinker_common.errors import ThinkerError

    _, source = save_reference(Qwen3MoeConfig(**QWEN3_MOE))
    written = json.loads((source / "config.json").read_text()) | {"decoder_sparse_step": 0}
    (source / "config.json").write_text(json.dumps(written))
    with pytest.raises(ThinkerError, match="decoder_sparse_step=0 must be a whole number above 0"):
        convert(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_qwen3_moe_fused_layout_and_sparse_step(save_reference, run_convert):
    config = Qwen3MoeConfig(**QWEN3_MOE, decoder_sparse_step=2, norm_topk_prob=False)
    # transformers 5 writes its in-memory fused experts when asked not to restore the original layout.
    model, source = save_reference(config, save_original_format=False)
    with safe_open(source / "model.safetensors", "pt") as handle:
        assert "model.layers.1.mlp.experts.gate_up_proj" in handle.keys()
    result = run_convert(source)
    assert_verified(result, "qwen3_moe")
    assert ThinkerConfig.from_pretrained(result.output).mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    assert_same_logits(model, result.output)


def test_llama_with_biases_and_llama3_rope(save_reference, run_convert):
    config = LlamaConfig(
        **SMALL,
        intermediate_size=56,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    model, source = save_reference(config)
    result = run_convert(source)
    assert_verified(result, "llama")
    assert_same_logits(model, result.output)


def test_an_attention_dropout_of_null_converts_and_loads(save_reference, run_convert):
    """Llama's and Qwen2-VL's configs allow ``"attention_dropout": null``: once the Thinker's fields were type-checked
    (``@strict``) such a source no longer converted, nor did a folder converted from it load (a review). It reads as
    0.0, as a dropout of None would not train."""
    model, source = save_reference(LlamaConfig(**SMALL, intermediate_size=56, num_attention_heads=4))
    config_file = source / "config.json"
    config_file.write_text(config_file.read_text().replace('"attention_dropout": 0.0', '"attention_dropout": null'))
    assert LlamaConfig.from_pretrained(source).attention_dropout is None
    result = run_convert(source)
    assert_verified(result, "llama")
    assert ThinkerConfig.from_pretrained(result.output).attention_dropout == 0.0
    written = result.output / "config.json"  # a folder converted before, its null kept
    written.write_text(written.read_text().replace('"attention_dropout": 0.0', '"attention_dropout": null'))
    assert '"attention_dropout": null' in written.read_text()
    assert ThinkerForCausalLM.from_pretrained(result.output).config.attention_dropout == 0.0


GPT2_SMALL = dict(
    vocab_size=71, n_embd=24, n_layer=3, n_head=3, n_positions=40, n_inner=40, bos_token_id=0, eos_token_id=0
)


def test_gpt2_primegpt_architecture(save_reference, run_convert):
    model, source = save_reference(GPT2Config(**GPT2_SMALL))
    result = run_convert(source)
    assert_verified(result, "gpt2")
    converted = ThinkerConfig.from_pretrained(result.output)
    assert (converted.norm_type, converted.position_embedding_type, converted.mlp_gated) == (
        "layernorm",
        "learned",
        False,
    )
    assert converted.tie_word_embeddings
    assert_same_logits(model, result.output)


def test_gpt2_original_layout_without_prefix_and_with_mask_buffers(tmp_path, run_convert):
    # The original `gpt2` repo: GPT2Model names (no "transformer."), plus the causal-mask buffers it saved.
    config = GPT2Config(**GPT2_SMALL)
    model = build_reference(config)
    tensors = {
        name.removeprefix("transformer."): t for name, t in model.state_dict().items() if name != "lm_head.weight"
    }
    for layer in range(config.n_layer):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(40, 40)).view(1, 1, 40, 40)
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    source = tmp_path / "gpt2-original"
    source.mkdir()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(source)
    result = run_convert(source)
    assert_verified(result, "gpt2")
    assert_same_logits(model, result.output)
