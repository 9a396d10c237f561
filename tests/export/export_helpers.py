"""Tiny Thinker configs, one per source family the exporter must cover, and a word-level tokenizer for them."""

from __future__ import annotations

import errno
import io
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import torch
from seeded_weights import randomize_parameters

# Three layers so that MoE configs mix sparse and dense layers; every size tiny, so that a test takes a second.
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    # Qwen2: q/k/v bias (no o_proj bias), GQA 4:2
    "qwen2": dict(num_key_value_heads=2, attention_bias=True, attention_output_bias=False),
    # Qwen3: qk-norm, GQA, head_dim 12 != hidden_size / heads (8)
    "qwen3": dict(num_key_value_heads=2, head_dim=12, qk_norm=True),
    # Qwen3-MoE: layers 0 and 2 sparse (layer 1 in mlp_only_layers), top-2 of 4, renormalised
    "qwen3_moe": dict(
        num_key_value_heads=2,
        head_dim=12,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # Qwen2-MoE: a shared expert behind its sigmoid gate, every second layer sparse, top-2 not renormalised
    "qwen2_moe": dict(
        num_key_value_heads=2,
        attention_bias=True,
        attention_output_bias=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
    ),
    # μOmni ThinkerLM: MHA, SwiGLU, a head with bias
    "uomni": dict(lm_head_bias=True),
    # GPT-2 (PrimeGPT): learned positions, LayerNorm, plain gelu_new MLP, biases everywhere, tied head, MHA
    "gpt2": dict(
        position_embedding_type="learned",
        norm_type="layernorm",
        mlp_gated=False,
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}

# The hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), their real shapes scaled down and awkward on purpose, as in
# tests/test_modeling_hybrid.py: a linear-attention layer first, two value heads per key head, key and value head
# sizes that differ (12 != 8), partial rotary 0.25 (8 of 32 channels; Qwen3.5 interleaved mRoPE [2, 1, 1] over its 4
# frequencies), the attention output gate, qk-norm and every RMSNorm zero-centred, an untied head.
HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    qk_norm=True,
    attention_output_gate=True,
    norm_zero_centered=True,
    max_position_embeddings=128,
)
MROPE = {
    "rope_type": "default",
    "rope_theta": 1e4,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
HYBRID_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    norm_topk_prob=True,
)
FAMILIES.update(
    {
        # Qwen3.5 (dense): interleaved multimodal RoPE, (3, B, T) positions
        "qwen3_5": dict(HYBRID, rope_parameters=MROPE),
        # Qwen3.5-MoE: every layer sparse, top-2 of 4 renormalised, a shared expert behind its sigmoid gate
        "qwen3_5_moe": dict(HYBRID, **HYBRID_MOE, rope_parameters=MROPE),
        # Qwen3-Next: plain partial RoPE ((B, T) positions), layer 2 dense among sparse layers
        "qwen3_next": dict(
            HYBRID,
            **HYBRID_MOE,
            intermediate_size=40,
            mlp_only_layers=[2],
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        ),
    }
)
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Qwen3.8 (qwen4_exp), as tests/references/qwen4_exp.py shapes it: Qwen3.5-MoE's layers around two indexed-attention
# layers, three hyper-connection streams, PLE on the first and last layer (the first a sequence's first linear
# layer, the last read by the head), a single index head (relu zeroes its score of a block often: exact ties, which
# the checks break toward the earlier blocks, as ONNX's TopK does) with a budget of 8 slots in blocks of 4 that prunes
# from 12 visible tokens on, an index head wider (12) than the 8 rotary channels.
FAMILIES["qwen4_exp"] = dict(
    HYBRID,
    **HYBRID_MOE,
    num_hidden_layers=5,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "linear_attention"],
    rope_parameters=MROPE,
    hc_count=3,
    hc_lowrank=8,
    ple_layer_ids=[1, 5],
    ple_embed_dim=16,
    ple_conv_kernel_size=3,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=100,
    make_ngram_vocab_size_divisible_by=16,
    indexer_n_heads=1,
    indexer_head_dim=12,
    indexer_budget=8,
    indexer_compress_ratio=4,
)

WORDS = "the a cat dog sat on mat and ran to house big small red blue one two three is was it".split()


def make_config(family: str, **overrides):
    from thinker import ThinkerConfig

    return ThinkerConfig(**{**COMMON, **FAMILIES[family], **overrides})


def save_thinker(folder: Path, family: str, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A Thinker folder with random weights (and a tokenizer), as thinker-convert would leave it."""
    from thinker import ThinkerForCausalLM

    model = randomize_parameters(ThinkerForCausalLM(make_config(family, **overrides)), seed).eval()
    spread_decay_rates(model, seed)
    model.save_pretrained(folder)
    if tokenizer:
        make_tokenizer().save_pretrained(folder)
    return Path(folder)


def spread_decay_rates(model, seed: int = 0) -> None:
    """Gated DeltaNet decay rates from slow (the state carries over a whole prompt) to fast, and dt_bias of both
    signs, as in tests/export/test_linear_attention_graph.py: randomize_parameters' A_log ~ 1 decays every head
    within a few tokens, where a wrong decay or a state not carried would hide."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("linear_attn"):
                heads = module.A_log.shape[0]
                module.A_log.copy_(torch.linspace(-4.0, 1.0, heads)[torch.randperm(heads, generator=generator)])
                module.dt_bias.copy_(torch.randn(heads, generator=generator))


def make_tokenizer():
    """A whitespace word-level tokenizer with one word per id of the tiny vocabulary (so that any generated id
    decodes to text): pad 0, bos 1, eos 2, unk 3, then WORDS, then w<id> fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", *WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), COMMON["vocab_size"])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]"
    )


GENAI_SCRIPT = Path(__file__).with_name("genai_greedy.py")


def assert_genai_equals_onnxruntime(genai_python: Path, folders: list[Path]) -> None:
    """onnxruntime-genai's greedy tokens (its own environment) equal OnnxDecoder's on each folder's graph."""
    import json
    import subprocess

    import numpy as np

    from export.runtime import OnnxDecoder

    prompt, new_tokens = [5, 9, 17, 33, 4, 21], 10
    cases = [{"folder": str(f), "prompt": prompt, "max_new_tokens": new_tokens} for f in folders]
    done = subprocess.run(
        [str(genai_python), str(GENAI_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for folder, sequence in zip(folders, json.loads(done.stdout), strict=True):
        decoder = OnnxDecoder(folder, provider="cpu")
        expected = decoder.generate(np.array([prompt]), max_new_tokens=new_tokens, eos_token_id=2, pad_token_id=0)
        assert sequence == expected[0].tolist(), folder


def component_session(b, weights, name: str, inputs: list, outputs: list, folder: Path, threads: int | None = None):
    """An onnxruntime CPU session of a graph that holds one emitter alone (``b``, its builder, streaming to
    ``weights``), saved as ``folder/NAME.onnx`` and checked first."""
    import onnxruntime as ort

    from export.decoder_graph import make_model

    weights.close()
    path = folder / f"{name}.onnx"
    onnx.save(make_model(b.make_graph(name, inputs, outputs), {}), str(path))
    onnx.checker.check_model(str(path), full_check=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def graph_nodes(model_path: Path) -> Iterator[onnx.NodeProto]:
    """Every node of an exported graph, those inside If / Loop / Scan bodies included."""
    from export.graph_walk import all_nodes

    yield from all_nodes(onnx.load(str(model_path), load_external_data=False).graph)


def record_parity(record_property, figures: dict) -> None:
    """A parity check's figures into the JUnit XML (pytest's ``record_property``), so that a GPU session's
    gpu-tests XML records them beside the verdict (bench/gpu_kit.py run tests)."""
    for key in ("max_abs_diff", "logit_scale", "top1_agreement"):
        if key in figures:
            record_property(key, round(float(figures[key]), 6))


def window_of(keys: int):
    """A plant for an export's graph: every GroupQueryAttention attends to its last ``keys`` keys only (the
    ``local_window_size`` no Thinker has)."""

    def plant(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                node.attribute.append(onnx.helper.make_attribute("local_window_size", keys))

    return plant


@contextmanager
def router_weights_edited(edit: Callable[[int, torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """A plant for an export: each MoE layer's router weight (experts, hidden) written as ``edit(layer, weight)``
    returns it (None: as it is), in both graphs, which read it through ``DecoderGraph.weight``."""
    from export.decoder_graph import DecoderGraph

    weight = DecoderGraph.weight

    def edited(self, name: str, transpose: bool = False) -> str:
        found = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.weight", name)
        tensor = edit(int(found.group(1)), self.weights.get(name).clone()) if found else None
        if tensor is None:
            return weight(self, name, transpose)
        return self.b.weight(name, tensor.transpose(-1, -2) if transpose else tensor)

    DecoderGraph.weight = edited
    try:
        yield
    finally:
        DecoderGraph.weight = weight


def reversed_router(layer: int):
    """A plant: MoE layer ``layer``'s router with its experts' rows in reverse order, so that every token is routed
    to other experts."""
    return router_weights_edited(lambda index, weight: weight.flip(0) if index == layer else None)


def export_planted(folder: Path, output: Path, monkeypatch, plant: Callable | None = None, **options) -> Path:
    """``model.onnx`` of ``folder`` exported to ``output`` without its check, with ``plant(monkeypatch)`` (a bug planted
    in the exporter) applied for the export only; ``options``: ``export_model``'s."""
    from export.exporter import export_model
    from export.names import MODEL_FILE

    with monkeypatch.context() as patched:
        if plant:
            plant(patched)
        export_model(folder, output, verify=False, progress=False, **options)
    return output / MODEL_FILE


def scale_graph_weight(path: Path, weight: str, factor: float) -> None:
    """``path``'s graph with its initializer ``weight`` scaled by ``factor`` (in the weight's dtype) wherever its
    nodes read it: a planted bug, the weights file untouched."""
    from onnx import helper, numpy_helper

    graph = onnx.load(path, load_external_data=False)
    stored = next(tensor for tensor in graph.graph.initializer if tensor.name == weight)
    scale = np.array(factor, helper.tensor_dtype_to_np_dtype(stored.data_type))
    graph.graph.initializer.append(numpy_helper.from_array(scale, f"{weight}/planted"))
    for node in graph.graph.node:
        node.input[:] = [f"{weight}/scaled" if name == weight else name for name in node.input]
    graph.graph.node.insert(0, helper.make_node("Mul", [weight, f"{weight}/planted"], [f"{weight}/scaled"]))
    onnx.save_model(graph, path)


def save_bos_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (what onnxruntime-genai's tokenizer reads; it refuses a word-level one) that puts
    its BOS, ``<s>`` = 1, in front of every text, as Llama's and a BOS-adding GGUF's do: transformers 5 writes the
    BOS into tokenizer.json's post-processor. Trained on a fixed text, so the same every run; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=alphabet)
    backend.train_from_iterator(["The capital of France is Paris. " * 20, "hello world " * 10], trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def qa_build(root: Path, name: str, seed: int = 0) -> Path:
    """The QA run's hybrid build ``name`` (tests/references/hybrid.py HALF_QA_BUILDS: transformers' own class, of
    other widths than the tests' own) with ``seed``'s weights, converted to a Thinker folder under ``root``."""
    from references import hybrid

    from converter.convert import convert

    model_class, config = hybrid.HALF_QA_BUILDS[name]
    source = root / f"{name}-{seed}-source"
    hybrid.reference(model_class, config(), seed=seed).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    return convert(source, root / f"{name}-{seed}", verify=False, progress=False).output


class FullDiskFile(io.FileIO):
    """A real file on a disk with room for 256 bytes (a .npy header) and no more: a ``write`` past them raises
    ENOSPC, as a full disk's does. numpy's tofile, and np.save on a real file, write its data to the descriptor, past
    ``write``, where a full disk's error came without its errno (helper-242's run on a full tmpfs)."""

    ROOM = 256

    def write(self, data) -> int:
        if self.tell() + memoryview(data).nbytes > self.ROOM:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)
