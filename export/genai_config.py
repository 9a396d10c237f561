"""``genai_config.json``: what onnxruntime-genai needs to run the exported decoder, and nothing to edit by hand.

onnxruntime-genai picks its model class from ``model.type``; "qwen2", "qwen3" and "llama" all select its generic
decoder-only model, which reads the IO names from the ``inputs``/``outputs`` sections below, so our contract
names are declared there rather than assumed.

``past_present_share_buffer``: the plain graph grows the KV cache by concatenation (past and present are distinct
buffers), so it is false there. The fused graph's GroupQueryAttention also takes one buffer of the whole context
bound as both past and present, writing each step's keys and values in place (its cache slots follow the
attention mask, so left padding keeps working); onnxruntime-genai then skips the per-step copy of the cache, which
is most of what batch decoding spends beyond the weights. The graph's IO contract is unchanged: a caller that
concatenates (OnnxDecoder) feeds a past of P slots and gets P + T back, as before.
"""

from __future__ import annotations

from thinker.configuration_thinker import ThinkerConfig

from .names import MODEL_FILE


def genai_model_type(config: ThinkerConfig) -> str:
    # Only the decoder-only family matters to the runtime; the name follows the nearest Qwen release.
    return "qwen3" if config.qk_norm else "qwen2"


def special_token_ids(config: ThinkerConfig, generation_config: dict | None) -> tuple[int, list[int], int]:
    """bos, eos (a list: chat models end turns with more than one) and pad ids, generation_config.json first."""
    generation_config = generation_config or {}

    def pick(key: str):
        value = generation_config.get(key)
        return value if value is not None else getattr(config, key, None)

    eos = pick("eos_token_id")
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    bos = pick("bos_token_id")
    pad = pick("pad_token_id")
    # onnxruntime-genai wants integers; a model without these ids has nothing to stop on or pad with.
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    if bos is None:
        bos = eos_ids[0] if eos_ids else 0
    # No eos at all: -1 matches no token, so generation runs to max_length.
    return int(bos), [int(i) for i in eos_ids] or [-1], int(pad)


def make_genai_config(
    config: ThinkerConfig, generation_config: dict | None, threads: int | None = None, share_buffer: bool = False
) -> dict:
    """``share_buffer``: the graph updates one KV buffer in place when bound as past and present (fused graphs)."""
    bos, eos, pad = special_token_ids(config, generation_config)
    layers = config.num_hidden_layers
    return {
        "model": {
            "type": genai_model_type(config),
            "bos_token_id": bos,
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": pad,
            "context_length": config.max_position_embeddings,
            "vocab_size": config.vocab_size,
            "decoder": {
                "filename": MODEL_FILE,
                "head_size": config.head_dim,
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "num_hidden_layers": layers,
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    # Without this key onnxruntime-genai runs the session on one thread. 0 is onnxruntime's own
                    # default, one thread per physical core of the machine that runs the model (not the one
                    # that exported it); --threads writes a fixed count instead.
                    "intra_op_num_threads": threads or 0,
                    "provider_options": [],
                },
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            # Greedy by default: the exported model reproduces the PyTorch one token for token.
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "diversity_penalty": 0.0,
            "no_repeat_ngram_size": 0,
            "min_length": 0,
            "max_length": config.max_position_embeddings,
            "early_stopping": True,
            "past_present_share_buffer": share_buffer,
        },
    }
