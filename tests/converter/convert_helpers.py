"""Helpers for the converter tests: tiny reference checkpoints with random weights, and logit comparison.

Every checkpoint is a real transformers model of its family, built from an awkward tiny config, with every
parameter (norms and biases included) drawn from a fixed seed, and saved the way its users would find it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

import thinker  # noqa: F401  (registers the Auto classes)
from thinker import ThinkerForCausalLM
from thinker_common.parity_inputs import left_padded

transformers_logging.set_verbosity_error()
transformers_logging.disable_progress_bar()

# float32 logits of the converted model against the reference: the same operations in the same order, so only
# summation-order noise is allowed.
FP32_ATOL = 1e-5
FP32_RTOL = 1e-5
PROMPTS = [[5, 17, 3, 29, 11, 2, 40, 8], [7, 1, 33, 12], [19, 4, 26]]
# A tiny Qwen2-shaped config's sizes, shared by the tests that need a small dense source.
QWEN2 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def randomize_(model: PreTrainedModel, seed: int, std: float = 0.2) -> PreTrainedModel:
    """Every parameter from a fixed seed; norm weights around 1 so activations keep a sensible scale."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator) * std
            is_norm_weight = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            parameter.copy_(1 + noise if is_norm_weight else noise)
    return model.eval()


def build_reference(config: PreTrainedConfig, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return randomize_(AutoModelForCausalLM.from_config(config), seed)


def save_unfused_experts(model: PreTrainedModel, folder: Path) -> Path:
    """The per-expert layout of Hub MoE checkpoints (``mlp.experts.{e}.gate_proj.weight`` ...), written by hand from
    the fused 3-D tensors transformers 5 holds in memory."""
    folder.mkdir(parents=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                tensors[f"{prefix}{expert}.gate_proj.weight"] = gate.clone()
                tensors[f"{prefix}{expert}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert, down in enumerate(tensor):
                tensors[f"{prefix}{expert}.down_proj.weight"] = down.clone()
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = tensor.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return folder


@torch.no_grad()
def assert_same_logits(reference: PreTrainedModel, converted_folder: Path, atol=FP32_ATOL, rtol=FP32_RTOL) -> None:
    """The converted folder, loaded as Thinker, gives the reference's logits on a left-padded batch (real tokens)."""
    converted = ThinkerForCausalLM.from_pretrained(converted_folder, dtype=torch.float32).eval()
    reference = reference.float().eval()
    ids, mask, positions = left_padded(PROMPTS)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    real = mask.bool()
    expected = reference(**inputs).logits[real]
    torch.testing.assert_close(converted(**inputs).logits[real], expected, atol=atol, rtol=rtol)


def class_mrope_streams(rotary: torch.nn.Module) -> torch.Tensor:
    """Which position stream (0 temporal, 1 height, 2 width) each RoPE frequency reads in one of transformers'
    multimodal rotary embeddings (``Qwen2VLRotaryEmbedding``, ``Qwen3VLTextRotaryEmbedding`` ...): its own
    ``recomposition_frequencies`` run on frequencies holding their stream's number. Comparable with
    ``thinker.modeling_thinker.mrope_streams``."""
    pairs = rotary.inv_freq.numel()
    streams = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 1, pairs).clone()
    return rotary.recomposition_frequencies(streams)[0, 0, :pairs].long()


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    architecture: str,
    metadata: dict[str, object] | None = None,
    quantization: str | None = None,
) -> Path:
    """The model as llama.cpp's converter would write it, in float32: llama.cpp names, its metadata keys, for the
    llama architecture the interleaved-RoPE row order of q/k, and for the MoE ones each layer's experts stacked
    (``ffn_{gate,up,down}_exps``) and Qwen2-MoE's shared-expert gate as a vector. A stand-in for real GGUF files.
    ``metadata`` replaces (or adds) keys, each written with the GGUF type of its Python value (to break a file);
    a value None leaves the key out. ``quantization`` (a ``GGMLQuantizationType`` name such as ``"Q8_0"``) stores
    every matrix and expert stack whose rows fit its blocks in that type, as llama.cpp's quantized files do."""
    import gguf

    from converter.families.gguf import ROPE_PERMUTED_ARCHITECTURES, ROPE_PERMUTED_TENSORS, tensor_names
    from converter.ops import permute_llama_rope
    from converter.spec import LAYER_INDEX

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    to_gguf = {}
    for gguf_template, hf_template in tensor_names(architecture).items():  # the architecture's own names
        for layer in range(config.num_hidden_layers):
            to_gguf[hf_template.replace(LAYER_INDEX, str(layer))] = (
                gguf_template.replace(LAYER_INDEX, str(layer)),
                gguf_template,
            )
    writer = gguf.GGUFWriter(path, arch=architecture)

    def add(name: str, tensor: torch.Tensor) -> None:
        add_gguf_tensor(writer, name, tensor, quantization)

    prefix = architecture
    values: dict[str, object] = {
        f"{prefix}.block_count": config.num_hidden_layers,
        f"{prefix}.context_length": config.max_position_embeddings,
        f"{prefix}.embedding_length": config.hidden_size,
        f"{prefix}.feed_forward_length": config.intermediate_size,
        f"{prefix}.attention.head_count": config.num_attention_heads,
        f"{prefix}.attention.head_count_kv": config.num_key_value_heads,
        f"{prefix}.attention.key_length": head_dim,
        f"{prefix}.attention.value_length": head_dim,
        f"{prefix}.rope.dimension_count": head_dim,
        f"{prefix}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{prefix}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{prefix}.vocab_size": config.vocab_size,
    }
    if getattr(config, "num_experts", None):
        values |= {
            f"{prefix}.expert_count": config.num_experts,
            f"{prefix}.expert_used_count": config.num_experts_per_tok,
            f"{prefix}.expert_feed_forward_length": config.moe_intermediate_size,
        }
        if getattr(config, "shared_expert_intermediate_size", None):
            values[f"{prefix}.expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    add_gguf_metadata(writer, {**values, **(metadata or {})})
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, _, leaf = name.rpartition(".")
        if stem.endswith("mlp.experts"):  # transformers 5's fused (E, 2·I, C) and (E, C, I): llama.cpp's three stacks
            block = f"blk.{name.split('.')[2]}"
            parts = tensor.chunk(2, dim=1) if leaf == "gate_up_proj" else (tensor,)
            stacks = ("ffn_gate_exps", "ffn_up_exps") if leaf == "gate_up_proj" else ("ffn_down_exps",)
            for stack, part in zip(stacks, parts, strict=True):
                add(f"{block}.{stack}.weight", part)
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):
            tensor = tensor.reshape(-1)  # llama.cpp's {n_embd}
        gguf_name, template = to_gguf.get(name, (name, name))
        if name == "model.embed_tokens.weight":
            gguf_name = template = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = template = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = template = "output.weight"
        if architecture in ROPE_PERMUTED_ARCHITECTURES and template in ROPE_PERMUTED_TENSORS:
            tensor = permute_llama_rope(tensor, getattr(config, ROPE_PERMUTED_TENSORS[template]))
        add(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_gguf_metadata(writer, values: dict[str, object]) -> None:
    """Each key with the GGUF type of its Python value (str, float32, a list as an array, else uint32); a value None
    leaves the key out."""
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)


def add_gguf_tensor(writer, name: str, tensor: torch.Tensor, quantization: str | None = None) -> None:
    """The tensor in float32, or in ``quantization``'s blocks (a ``GGMLQuantizationType`` name such as ``"Q8_0"``)
    where its rows fit them, as llama.cpp's quantized files store matrices and expert stacks."""
    import gguf
    import numpy as np

    array = np.ascontiguousarray(tensor.float().numpy())
    kind = None if quantization is None else gguf.GGMLQuantizationType[quantization]
    block = None if kind is None else gguf.GGML_QUANT_SIZES[kind][0]
    if block is not None and array.ndim >= 2 and array.shape[-1] % block == 0:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, array)
