"""Qwen3.5 / Qwen3.5-MoE checkpoints written as llama.cpp's ``convert_hf_to_gguf.py`` writes them (architectures
``qwen35`` and ``qwen35moe``): a stand-in for the GGUF files on the Hub, built from a transformers model.

Written here on purpose without the converter's tables: llama.cpp's names are spelled out below, and its value
transforms are applied forwards (norms as ``1 + w``, ``A_log`` as ``-exp(A_log)``, the conv kernel squeezed, value
heads tiled), so a conversion that undoes them wrongly does not round-trip. The converter's own parity gate checks
the same files against transformers' GGUF loading, which undoes them by its own code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from convert_helpers import add_gguf_metadata, add_gguf_tensor
from transformers import PreTrainedModel

# Hugging Face name within a layer -> llama.cpp's (gguf-py's tensor table for qwen35 / qwen35moe).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Stored as 1 + w (every RMSNorm of the model but the linear attention's gated one).
CENTRED = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm")


def tiled(tensor: torch.Tensor, key_heads: int, value_heads: int, per_head: int, dim: int = 0, skip: int = 0):
    """transformers' grouped value heads (v0k0 v1k0 v0k1 v1k1) in llama.cpp's tiled order (v0k0 v0k1 v1k0 v1k1)."""
    per_key = value_heads // key_heads
    order = torch.arange(value_heads * per_head).reshape(key_heads, per_key, per_head).transpose(0, 1).reshape(-1)
    head, values = tensor.split([skip, tensor.shape[dim] - skip], dim=dim)
    return torch.cat([head, values.index_select(dim, order)], dim=dim)


def llama_cpp_tensors(model: PreTrainedModel, mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """The model's tensors under llama.cpp's names and in its layout; ``mtp_layers`` extra blocks of noise after
    the last layer stand for the multi-token-prediction head llama.cpp writes there."""
    config = model.config
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    value_dim, query_key = config.linear_value_head_dim, 2 * config.linear_key_head_dim * config.linear_num_key_heads
    out = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if any(part in name for part in CENTRED):
            tensor = tensor + 1
        if name.endswith("A_log"):
            tensor = -torch.exp(tensor)
        if name.endswith("conv1d.weight"):
            tensor = tensor.squeeze(1)
        if name.endswith(("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
            tensor = tiled(tensor, key_heads, value_heads, 1)
        elif name.endswith("in_proj_z.weight"):
            tensor = tiled(tensor, key_heads, value_heads, value_dim)
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            tensor = tiled(tensor, key_heads, value_heads, value_dim, skip=query_key)
        elif name.endswith("out_proj.weight") and "linear_attn" in name:
            tensor = tiled(tensor, key_heads, value_heads, value_dim, dim=1)
        if name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = tensor
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # llama.cpp's three stacks
            if rest.endswith("gate_up_proj"):
                gate, up = tensor.chunk(2, dim=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = tensor
            continue
        out[f"blk.{layer}.{LAYER_NAMES[rest]}"] = tensor
    generator = torch.Generator().manual_seed(7)
    for extra in range(config.num_hidden_layers, config.num_hidden_layers + mtp_layers):
        for leaf, shape in (("nextn.eh_proj.weight", (config.hidden_size, 2 * config.hidden_size)),
                            ("attn_norm.weight", (config.hidden_size,))):  # fmt: skip
            out[f"blk.{extra}.{leaf}"] = torch.randn(shape, generator=generator)
    return out


def stand_in_vocabulary(size: int) -> dict[str, object]:
    """A byte-level BPE vocabulary of ``size`` tokens as llama.cpp's keys hold one: characters of GPT-2's byte
    alphabet, then pairs and triples of them as a real-sized vocabulary needs, the last token the merge of the first
    two; Qwen3.5's pre-tokenizer and an end-of-text id."""
    from itertools import chain, islice, product

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(bytes_to_unicode().values())[33:]
    words = chain(alphabet, ("".join(pair) for pair in product(alphabet, repeat=2)),
                  ("".join(triple) for triple in product(alphabet, repeat=3)))  # fmt: skip
    merged = alphabet[0] + alphabet[1]
    tokens = list(islice((word for word in words if word != merged), size - 1))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": [*tokens, merged],
        "tokenizer.ggml.merges": [f"{alphabet[0]} {alphabet[1]}"],
        "tokenizer.ggml.eos_token_id": size - 2,
    }


def write_hybrid_gguf(
    model: PreTrainedModel,
    path: Path,
    metadata: dict[str, object] | None = None,
    quantization: str | None = None,
    mtp_layers: int = 0,
    drop: tuple[str, ...] = (),
    architecture: str | None = None,
) -> Path:
    """``model`` (a ``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM``) as a ``qwen35`` / ``qwen35moe`` GGUF file with
    llama.cpp's metadata keys and a stand-in vocabulary. ``metadata`` replaces or adds keys (a value None removes
    one); ``quantization`` (``"Q8_0"``) stores each matrix whose rows fit its blocks in that type; ``drop`` leaves
    tensors out and ``architecture`` names another one (to break a file)."""
    import gguf

    config = model.config
    moe = bool(getattr(config, "num_experts", None))
    architecture = architecture or ("qwen35moe" if moe else "qwen35")
    rope = config.rope_parameters
    rotary = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    # GGUF records the layer types as an interval: full attention in every interval-th layer.
    interval = config.layer_types.index("full_attention") + 1
    periodic = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(config.layer_types))
    ]
    assert config.layer_types == periodic, f"llama.cpp cannot write layer types {config.layer_types}"
    values: dict[str, object] = {
        f"{architecture}.block_count": config.num_hidden_layers + mtp_layers,
        f"{architecture}.context_length": config.max_position_embeddings,
        f"{architecture}.embedding_length": config.hidden_size,
        f"{architecture}.attention.head_count": config.num_attention_heads,
        f"{architecture}.attention.head_count_kv": config.num_key_value_heads,
        f"{architecture}.attention.key_length": config.head_dim,
        f"{architecture}.attention.value_length": config.head_dim,
        f"{architecture}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{architecture}.rope.freq_base": float(rope["rope_theta"]),
        f"{architecture}.rope.dimension_count": rotary,
        f"{architecture}.rope.dimension_sections": [*rope["mrope_section"], 0][:4],
        f"{architecture}.full_attention_interval": interval,
        f"{architecture}.ssm.conv_kernel": config.linear_conv_kernel_dim,
        f"{architecture}.ssm.state_size": config.linear_key_head_dim,
        f"{architecture}.ssm.group_count": config.linear_num_key_heads,
        f"{architecture}.ssm.time_step_rank": config.linear_num_value_heads,
        f"{architecture}.ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
        **stand_in_vocabulary(config.vocab_size),
    }
    if mtp_layers:
        values[f"{architecture}.nextn_predict_layers"] = mtp_layers
    if moe:
        values |= {
            f"{architecture}.expert_count": config.num_experts,
            f"{architecture}.expert_used_count": config.num_experts_per_tok,
            f"{architecture}.expert_feed_forward_length": config.moe_intermediate_size,
            f"{architecture}.expert_shared_feed_forward_length": config.shared_expert_intermediate_size,
        }
    else:
        values[f"{architecture}.feed_forward_length"] = config.intermediate_size
    writer = gguf.GGUFWriter(path, arch=architecture)
    add_gguf_metadata(writer, {**values, **(metadata or {})})
    for name, tensor in llama_cpp_tensors(model, mtp_layers).items():
        if name not in drop:
            add_gguf_tensor(writer, name, tensor, quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
