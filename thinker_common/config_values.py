"""Config values no model can work with, refused by key before anything is built from them.

transformers' config classes accept a negative ``max_position_embeddings``, a NaN ``rms_norm_eps`` or a negative
``rope_theta`` without a word, and the converter and the exporter would then write a model that cannot run (or, for
a context of 10^12 positions, ask for terabytes of RoPE table). ``check_model_config`` is the one list of these
rules, applied to the Thinker config by the converter (after translating the source's) and by the exporter (on the
Thinker folder it reads), so that the message names the key and the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ThinkerError

# The longest context of any released model is 10,485,760 positions (Llama 4 Scout); Qwen's longest is ~1M. A value
# beyond 2^24 is a typo or a sentinel, and the exported RoPE tables alone would take hundreds of GiB.
MAX_POSITIONS = 2**24

# Sizes that must be whole positive numbers (None: the field is optional and derived when absent).
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "decoder_sparse_step",  # every step-th layer sparse: 0 divides by zero in transformers' class and the Thinker's
)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def dtype_problem(config: Mapping[str, Any], within: str = "") -> str | None:
    """A ``dtype`` (or the older ``torch_dtype``) of ``config`` or of a config nested in it (``text_config``,
    ``thinker_config`` ...: every key ending in ``_config``) that names no torch dtype, described with its key:
    transformers' configs look the name up on torch and said only "module 'torch' has no attribute 'float8'" (a QA
    run). None where each is absent, a torch.dtype or a name torch has."""
    import torch

    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is None or isinstance(value, torch.dtype):
            continue
        if not (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
            return f"{within}{key}={value!r} is not a dtype torch has (such as float32, bfloat16 or float16)"
    for key, nested in config.items():
        if isinstance(key, str) and key.endswith("_config") and isinstance(nested, Mapping):
            if problem := dtype_problem(nested, f"{within}{key}."):
                return problem
    return None


def config_problem(config: Mapping[str, Any]) -> str | None:
    """The first value of ``config`` (a Thinker config as a dict) that no model can work with, described with its
    key and what it must be; None when every value is usable."""
    if problem := dtype_problem(config):
        return problem
    for key in POSITIVE_SIZES:
        value = config.get(key)
        if value is not None and not (_whole(value) and value > 0):
            return f"{key}={value!r} must be a whole number above 0"
    # the embedding's padding row (torch's Embedding takes -vocab_size to vocab_size - 1): past it, building the
    # model failed inside torch with "Padding_idx must be within num_embeddings" (found by a QA run)
    pad, vocab = config.get("pad_token_id"), config.get("vocab_size")
    if pad is not None and not (_whole(pad) and (vocab is None or -vocab <= pad < vocab)):
        return f"pad_token_id={pad!r} must be a token id of the vocabulary (a whole number below vocab_size={vocab})"
    positions = config.get("max_position_embeddings")
    if _whole(positions) and positions > MAX_POSITIONS:
        return (
            f"max_position_embeddings={positions} is beyond any model's context (the longest released has "
            f"10,485,760 positions; at most {MAX_POSITIONS:,} are accepted)"
        )
    eps = config.get("rms_norm_eps")
    if eps is not None and not (_real(eps) and math.isfinite(eps) and 0 < eps < 1):
        return f"rms_norm_eps={eps!r} must be a small positive number such as 1e-06"
    activation = config.get("hidden_act")
    if activation is not None:
        from transformers.activations import ACT2FN

        if activation not in ACT2FN:
            return f"hidden_act={activation!r} is not an activation transformers knows; known: {', '.join(ACT2FN)}"
        learned = [name for name, _ in ACT2FN[activation].named_parameters()]
        if learned:  # PReLU's slope, xIELU's alphas: tensors of their own in each MLP, which the Thinker's has not
            return f"hidden_act={activation!r} learns parameters ({', '.join(learned)}), which no Thinker MLP holds"
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = rope.get("rope_type", "default")
        known = ["default", *ROPE_INIT_FUNCTIONS]
        if rope_type not in known:
            return (
                f"rope_parameters.rope_type={rope_type!r} is not a RoPE type transformers knows; "
                f"known: {', '.join(known)}"
            )
        theta = rope.get("rope_theta")
        if theta is not None and not (_real(theta) and math.isfinite(theta) and theta > 0):
            return f"rope_parameters.rope_theta={theta!r} must be a positive number such as 10000.0"
        # the scaling types divide positions or frequencies by it: 0 gives inf and NaN, which the parity check
        # would otherwise blame on the weights
        factor = rope.get("factor")
        scaled = rope_type != "default" and factor is not None
        if scaled and not (_real(factor) and math.isfinite(factor) and factor > 0):
            return f"rope_parameters.factor={factor!r} must be a positive number (the context's scaling, such as 4.0)"
    return None


def check_model_config(config: Mapping[str, Any], where: str) -> None:
    """``ThinkerError`` naming ``where`` (the file the values come from) and the key, when ``config_problem``."""
    problem = config_problem(config)
    if problem is not None:
        raise ThinkerError(f"{where}: {problem}; correct the value")
