"""Plain data the exporter, the runtime and the command line share, importable without onnx or torch (so that
``thinker export --help`` answers at once): the ONNX folder's file names and the choices of ``thinker export``."""

from __future__ import annotations

import os
from pathlib import Path

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# onnxruntime-genai's graph: the fused model.onnx rewired for right-padded batches, over the same data file
# (export/genai_graph.py); genai_config.json names it.
GENAI_MODEL_FILE = "model.genai.onnx"
# Its metadata entry saying so ("right"), which OnnxDecoder reads to refuse a left-padded batch.
PADDING_KEY = "thinker.padding"
# --inputs-embeds (export/embeds_graph.py): the decoder taking ``inputs_embeds`` (float32 [B, T, hidden]) in place of
# input_ids, and the token lookup it was cut from (input_ids -> inputs_embeds), both over model.onnx.data.
EMBEDS_MODEL_FILE = "model.embeds.onnx"
EMBED_FILE = "embed.onnx"
INPUTS_EMBEDS = "inputs_embeds"
# The scope of the decoder's token lookup (export/decoder_graph.py ``emit_embeddings``): /model/embed/<this>/.
TOKENS_SCOPE = "tokens"
# model.embeds.onnx's input for Qwen3-VL's and Qwen3-Omni's DeepStack features, [deepstack_layers, B, T, hidden]
# float32 (zeros where no visual position is), and the scope of the marks model.onnx carries where they are added,
# after each of its first deepstack_layers layers: /model/deepstack.<i>/ (an Identity onnxruntime removes).
DEEPSTACK_EMBEDS = "deepstack_embeds"
DEEPSTACK_SCOPE = "deepstack"
REPORT_FILE = "export_report.json"
# The RoPE cos table both graphs store, one row per position: an export's context where no config says it.
ROPE_TABLE = "rotary_emb.cos_cache"
ROPE_SIN_TABLE = "rotary_emb.sin_cache"
# A learned-position model's table (GPT-2 layout, ``position_embedding_type="learned"``), under its Thinker weight's
# name: one row per position, the graph's context as the RoPE table is for the others.
POSITION_TABLE = "model.embed_positions.weight"
GENAI_CONFIG_FILE = "genai_config.json"

# --graph: "plain", standard ONNX operators only; "fused", onnxruntime's contrib operators (export/fused_graph.py).
GRAPHS = {"plain": "export.decoder_graph:DecoderGraph", "fused": "export.fused_graph:FusedDecoderGraph"}


# The graph ``thinker export`` writes when ``--graph`` is not given, for every decoder: fused. It is the faster graph
# where the exports run. Under onnxruntime-genai the plain graph cannot share one KV buffer between past and present,
# so the cache grows by Concat every step, and it runs ~10 unfused small operators per layer: a decode step of 124
# against 80 ms at batch 1, 284 against 180 ms at batch 8 on SmolLM2 (README, "Where decode time goes under
# onnxruntime-genai"); under plain onnxruntime the two are at parity; for hybrid models the plain recurrence is a Scan
# over tokens, slower at prefill and decode (docs/hybrid-export.md, section 6). And it is exact wherever the plain
# graph is, so no config needs a plain default: what onnxruntime's contrib operators cannot take, the fused graph
# already builds the plain way inside itself (head_dim not a multiple of 8: the plain attention; partial or
# multimodal RoPE: rotated by position_ids before GroupQueryAttention; zero-centred norms in half
# precision and non-SwiGLU experts: the plain forms). Every family, dtype and --quantize passes its verify fused
# (tests/export/test_onnx_fused.py, test_onnx_hybrid.py, test_onnx_quantized.py). `--graph plain` stays for runtimes
# without the contrib operators.
DEFAULT_GRAPH = "fused"


# --positions: the form of the graph's position_ids input for models with multimodal RoPE (mrope_section). "multimodal",
# (3, B, T): temporal, height and width streams, as transformers' Qwen3.5 and the Hub's processors write them;
# "text", (B, T): one stream, which the graph repeats on all three (bit for bit the multimodal graph fed three equal
# rows; model.onnx takes token ids, so text positions are all it is ever fed: image prompts, whose streams differ, go
# through --inputs-embeds' model.embeds.onnx, which takes model.onnx's form). Text positions also give
# onnxruntime-genai 0.18 its (B, T) position code, whose attention mask keeps a right-padded batch's pads masked
# (export/genai_config.py). Models without multimodal RoPE take (B, T) only.
POSITIONS = ("multimodal", "text")

# --logits: what the graph's logits output holds. "all", (B, T, V): every new position, as transformers' forward gives
# them (scoring a text, perplexity). "last", (B, 1, V): each row's last kept new position, the only one generation
# samples from; the head then multiplies one position rather than T, which is most of what a prefill spends beyond the
# layers (the head is a fifth of SmolLM2's weights). onnxruntime-genai (0.12.2 and later) takes a static 1 there as
# logits it need not slice; OnnxDecoder and ``thinker generate`` take either, and the export's checks read every
# position of a "last" graph from its copy with the selection left out (export/runtime.py ``all_positions_model``).
LOGITS = ("all", "last")
DEFAULT_LOGITS = "all"
# Where a "last" graph selects the position: lm_head/<this>/, a GatherND over the final hidden states.
LAST_POSITION_SCOPE = "last_position"

# --quantize and its options (export/quantize.py).
BITS = {"int4": 4, "int8": 8}
# --quantize-head: the head's precision; "mixed" (int4 graphs' default) keeps the first --head-int8-rows vocabulary
# rows at int8 and the rest at int4 (export/quantize.py, ``SplitProjection``).
HEAD_PRECISIONS = (*BITS, "mixed")
DEFAULT_HEAD_INT8_ROWS = 8192
# --embedding: a tied embedding under --quantize, gathered from the quantized head's own tensors (stored once), or
# the float table beside the quantized head (its bytes more in the files; the builder's int8 layout, whose
# fidelity on SmolLM2 it gives to the last digit: README, "int8 against the builder's int8").
EMBEDDINGS = ("quantized", "float")
ALGORITHMS = ("rtn", "rtn-asym", "hqq")
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 1, 4)
# --accuracy-level's default per --dtype. float32 graphs are for the CPU: 4 (int8 activations, MLAS's fastest kernels,
# the builder's CPU default). Half graphs are for CUDA, whose MatMulNBits and QMoE never read the attribute: on an H100
# they computed the float-activation function (tests/export/test_onnx_gpu.py, bench/results/gpu-tests-h100.xml), so
# level 4 there would only have the CPU's verify and accuracy guard judge an int8 rounding the deployed graph never
# does (on a small random MoE it alone moved the CPU's int4 logits by 0.74 at a scale of 2.6).
DEFAULT_ACCURACY_LEVEL = {"float32": 4, "float16": 0, "bfloat16": 0}
# --accuracy-guard (export/accuracy_guard.py): the least teacher-forced top-1 agreement of an accuracy-level-4 graph
# with the same weights at level 1, below which layers fall back to level 1.
DEFAULT_MIN_AGREEMENT = 0.9


# RoPE scalings that stretch the context a model was trained on (its ``original_max_position_embeddings``, or
# max_position_embeddings where that is unset) by their ``factor``: transformers runs such a model past
# max_position_embeddings (Qwen's YaRN setting keeps that at the trained 32768 and reaches factor 4 x 32768), so an
# export's RoPE tables and context cover the stretched length, as vLLM's max model length does.
CONTEXT_STRETCHING_ROPE_TYPES = ("yarn", "llama3")


def export_files(folder: Path) -> list[str]:
    """The files only ``thinker export`` writes that ``folder`` holds: an export's folder also holds a Thinker
    config.json, so one that lost its model.onnx is told apart from a Thinker folder by these."""
    names = (MODEL_FILE, DATA_FILE, GENAI_MODEL_FILE, EMBEDS_MODEL_FILE, GENAI_CONFIG_FILE)
    return [name for name in names if os.path.lexists(folder / name)]


def export_context(max_position_embeddings: int, rope_parameters: dict | None) -> tuple[int, str]:
    """The positions an export covers (its RoPE tables' rows), and what says so, for messages."""
    rope = rope_parameters if isinstance(rope_parameters, dict) else {}
    factor, trained = rope.get("factor"), rope.get("original_max_position_embeddings") or max_position_embeddings
    if rope.get("rope_type") in CONTEXT_STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and factor > 1:
        stretched = int(factor * trained)
        if stretched > max_position_embeddings:
            return stretched, f"{rope['rope_type']}'s factor {factor:g} x {trained} trained positions"
    return max_position_embeddings, "max_position_embeddings"


# model.onnx's metadata keys for the size and a sampled fingerprint of the weights file it was exported with
# (export/weights_stamp.py), which export/runtime.py checks: a graph beside another export's weights is refused.
WEIGHTS_SIZE_KEY = "thinker.weights_bytes"
WEIGHTS_FINGERPRINT_KEY = "thinker.weights_fingerprint"

# model.onnx's metadata key for the graph's float type ("float32", "float16", "bfloat16").
DTYPE_KEY = "thinker.dtype"

# model.onnx's metadata key for a random id of the export, which the graphs cut from it carry too
# (export/genai_graph.py, export/embeds_graph.py): OnnxDecoder refuses an embed.onnx beside a model.embeds.onnx of
# another export.
EXPORT_ID_KEY = "thinker.export_id"
