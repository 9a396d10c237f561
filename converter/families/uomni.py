"""μOmni's ThinkerLM (``omni/thinker.py`` of the μOmni repository, github.com/prskid1000/micro-Omni, a tiny
Qwen3-style omni model trained from scratch): ``tok_emb`` / ``blocks.N`` / ``norm`` / ``head``, saved as a plain
state dict.

The checkpoint is a folder with ``config.json`` holding the keys of μOmni's ``configs/thinker_tiny.json``
(``vocab_size, n_layers, d_model, n_heads, d_ff, dropout, rope_theta, ctx_len, use_swiglu, use_gqa, use_moe``;
``kv_groups`` when GQA is on, else ``n_heads // 2`` as μOmni defaults) and the weights as a ``*.pt`` / ``*.pth``
``torch.save(state_dict)``. It has no ``model_type``: it is recognised by those config keys and its tensor names.

Per block: ``norm1`` / ``norm2`` RMSNorms with a ``scale`` (eps 1e-6), attention with a fused ``attn.qkv``
(standard) or separate ``attn.q`` / ``attn.k`` / ``attn.v`` (GQA), no biases, output ``attn.o``, and a SwiGLU
``mlp.{gate,up,down}_proj``. The head is a plain ``nn.Linear`` and so has a bias. RoPE rotates interleaved pairs
(0, 1), (2, 3) ... of each head; Thinker rotates halves (j, j + head_dim/2), so the q and k rows are reordered
within each head (evens, then odds), which leaves every attention score unchanged.

Refused rather than guessed: ``use_swiglu: false`` and ``use_moe: true`` (μOmni's design notes describe neither the
GELU MLP nor the MoE routing weights of ThinkerLM precisely enough to convert them exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinker_common.errors import ThinkerError

from ..ops import Chain, Each, Identity, InterleavedToHalfRope, Split
from ..spec import Family, renames, rule
from .common import THINKER_LAYER

RMS_NORM_EPS = 1e-6  # μOmni's RMSNorm default; the config file does not carry it
Q_ROPE = InterleavedToHalfRope("num_attention_heads")
K_ROPE = InterleavedToHalfRope("num_key_value_heads")


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    if not source.get("use_swiglu", True):
        raise ThinkerError("μOmni config has use_swiglu=false; only the SwiGLU ThinkerLM converts")
    if source.get("use_moe", False):
        raise ThinkerError("μOmni config has use_moe=true; the MoE ThinkerLM does not convert (routing unspecified)")
    try:
        heads = source["n_heads"]
        kv_heads = (source.get("kv_groups") or max(1, heads // 2)) if source.get("use_gqa", False) else heads
        return {
            "vocab_size": source["vocab_size"],
            "hidden_size": source["d_model"],
            "intermediate_size": source["d_ff"],
            "num_hidden_layers": source["n_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": source.get("ctx_len", 512),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(source.get("rope_theta", 10000.0))},
            "rms_norm_eps": RMS_NORM_EPS,
            "lm_head_bias": True,
            "tie_word_embeddings": False,
        }
    except KeyError as err:
        raise ThinkerError(f"μOmni config.json lacks the key {err.args[0]!r}") from None


BLOCK = "blocks.{layer}."  # a ThinkerLM block's tensors
QKV_TARGETS = tuple(THINKER_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")

UOMNI = Family(
    name="uomni",
    description="μOmni ThinkerLM (tok_emb / blocks.N / head; fused or split qkv; interleaved RoPE)",
    model_types=(),
    config_keys=("d_model", "n_layers", "n_heads", "d_ff"),
    layer_count_keys=("n_layers",),
    tensor_hints=("tok_emb.weight",),
    translate_config=translate_config,
    tensors=(
        *renames(
            {
                "tok_emb.weight": "model.embed_tokens.weight",
                "norm.scale": "model.norm.weight",
                "head.weight": "lm_head.weight",
                "head.bias": "lm_head.bias",
                BLOCK + "norm1.scale": THINKER_LAYER + "input_layernorm.weight",
                BLOCK + "norm2.scale": THINKER_LAYER + "post_attention_layernorm.weight",
                BLOCK + "attn.o.weight": THINKER_LAYER + "self_attn.o_proj.weight",
                BLOCK + "mlp.gate_proj.weight": THINKER_LAYER + "mlp.gate_proj.weight",
                BLOCK + "mlp.up_proj.weight": THINKER_LAYER + "mlp.up_proj.weight",
                BLOCK + "mlp.down_proj.weight": THINKER_LAYER + "mlp.down_proj.weight",
            }
        ),
        # Two layouts of the same three targets; the engine uses the one whose tensors the checkpoint holds.
        rule(BLOCK + "attn.qkv.weight", QKV_TARGETS, Chain(Split(dim=0, parts=3), Each(Q_ROPE, K_ROPE, Identity()))),
        rule(
            (BLOCK + "attn.q.weight", BLOCK + "attn.k.weight", BLOCK + "attn.v.weight"),
            QKV_TARGETS,
            Each(Q_ROPE, K_ROPE, Identity()),
        ),
    ),
    head="head.weight",
    no_reference="μOmni ThinkerLM has no transformers class; its parity is proven against the reference "
    "implementation in tests/references/uomni.py (tests/converter/test_seed_families.py)",
)
