"""onnxruntime (CPU) against the PyTorch Thinker: prefill + 6 decode steps on a left-padded batch of two."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export.runtime import OnnxDecoder, position_ids_from_mask
from export.verify import compare_decoders
from thinker_common.parity_inputs import parity_batch

FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gpt2", "uomni"]


def load_thinker(folder, dtype=torch.float32):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_parity(family, thinker_folder, onnx_folder):
    model = load_thinker(thinker_folder(family))
    decoder = OnnxDecoder(onnx_folder(family), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)

    assert figures["positions"] == 7 + 4 + 6 * 2  # every kept prompt position, then 6 steps of 2 rows
    assert figures["max_abs_diff"] <= 1e-3, figures
    assert figures["top1_agreement"] == 1.0, figures


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt2"])
def test_float16_parity_on_cpu(family, thinker_folder, onnx_folder):
    """onnxruntime's CPU provider runs float16 graphs (casting where it lacks a half kernel); compare with PyTorch
    in float16."""
    model = load_thinker(thinker_folder(family), torch.float16)
    decoder = OnnxDecoder(onnx_folder(family, "float16"), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)

    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures
    assert figures["top1_agreement"] >= 0.9, figures  # random weights leave near-ties that half precision flips


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt2"])
def test_bfloat16_graph(family, thinker_folder, onnx_folder):
    """onnxruntime's CPU provider has no bfloat16 kernels, so the graph is checked (strict shape inference) and
    run by onnx's reference evaluator, whose prefill logits must match PyTorch in bfloat16."""
    import ml_dtypes
    from onnx.reference import ReferenceEvaluator

    path = onnx_folder(family, "bfloat16") / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    model = load_thinker(thinker_folder(family), torch.bfloat16)
    cfg = model.config
    input_ids, attention_mask = parity_batch(cfg.vocab_size)
    position_ids = position_ids_from_mask(attention_mask)
    feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    empty = np.zeros((2, cfg.num_key_value_heads, 0, cfg.head_dim), ml_dtypes.bfloat16)
    for i in range(cfg.num_hidden_layers):
        feeds[f"past_key_values.{i}.key"] = feeds[f"past_key_values.{i}.value"] = empty
    logits = ReferenceEvaluator(str(path)).run(["logits"], feeds)[0]

    with torch.no_grad():
        reference = model(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention_mask),
            position_ids=torch.from_numpy(position_ids),
        ).logits.float()
    kept = attention_mask.astype(bool)
    diff = np.abs(reference.numpy()[kept] - logits[kept]).max()
    assert diff <= 5e-2 * max(1.0, float(reference.abs().max())), diff
