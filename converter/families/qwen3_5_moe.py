"""Qwen3.5-MoE and Qwen3.6-MoE (``model_type: qwen3_5_moe_text`` / ``qwen3_5_moe``), as transformers'
``Qwen3_5MoeForCausalLM`` and ``Qwen3_5MoeForConditionalGeneration`` (models/qwen3_5_moe) write them.

The decoder of ``qwen3_5`` (hybrid Gated DeltaNet and gated full attention, zero-centred norms, partial interleaved
multimodal RoPE; see that module) with a sparse MLP in every layer: top-k routing always renormalised
(``norm_topk_prob`` is not a setting of these classes: True), routed experts plus a shared expert behind a sigmoid
gate. The config has no ``decoder_sparse_step``, ``mlp_only_layers`` or dense ``intermediate_size`` that the
reference reads (a Hub config may list ``mlp_only_layers``; the classes ignore it), so neither does the translation.

Experts come per expert (``mlp.experts.{e}.gate_proj.weight``: the Hub checkpoints, which transformers fuses on
load by its ``qwen2_moe`` conversion) or fused 3-D (``save_original_format=False``); see ``common.ROUTED_EXPERTS``.
Layouts, drops (vision tower ``model.visual.*``, MTP head ``mtp.*``), parity references
(``Qwen3_5MoeForCausalLM``; ``Qwen3_5MoeForConditionalGeneration`` on text) and the way back (the causal-LM layout,
experts per expert as on the Hub) are those of ``qwen3_5``.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    EMBEDDINGS_AND_HEAD,
    GATED_DELTANET,
    HYBRID_LAYER_TYPES,
    LAYER_NORMS,
    QK_NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERT,
    VISION_AND_MTP_PREFIXES,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    hybrid_fields,
    layered_reference_by_model_type,
    mrope_parameters,
    reference_by_model_type,
    router_loss_fields,
)
from .qwen3_5 import REFERENCE_MROPE_SECTION


def every_layer_sparse(hf: PreTrainedConfig) -> dict[str, Any]:
    return {
        "num_experts": hf.num_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
        **router_loss_fields(hf),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # no layer is dense; the Thinker's field is set to the expert width rather than left at a default
        "intermediate_size": hf.moe_intermediate_size,
    }


QWEN3_5_MOE = hf_family(
    ("qwen3_5_moe_text", "qwen3_5_moe"),
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3.5 / Qwen3.6 MoE (hybrid Gated DeltaNet, shared expert; causal-LM or vision-language layout)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, GATED_DELTANET)
    + (ROUTER, SHARED_EXPERT, ROUTED_EXPERTS),
    lambda hf: (
        hybrid_fields(hf) | every_layer_sparse(hf) | {"rope_parameters": mrope_parameters(hf, REFERENCE_MROPE_SECTION)}
    ),
    name="qwen3_5_moe",
    layer_types=HYBRID_LAYER_TYPES,
    partial_rotary=True,
    layouts=({}, VISION_LANGUAGE_LAYOUT),
    dropped_prefixes=VISION_AND_MTP_PREFIXES,
    reference=reference_by_model_type({"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}),
    layered_reference=layered_reference_by_model_type({"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}),
    layer_count_keys=("num_hidden_layers", "mtp_num_hidden_layers"),
)
