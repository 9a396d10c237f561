"""Runs an exported decoder with onnxruntime: ``prefill``, ``decode_one_token`` and greedy ``generate``.

On CUDA the KV cache never leaves the device: each step binds the previous step's ``present.*`` OrtValues as the
next ``past_key_values.*`` inputs through IO binding, and only the logits come back to the host. On CPU the
cache is a dict of numpy arrays fed back the same way, and the fused graph's KV is one buffer per layer that
GroupQueryAttention writes in place: onnxruntime's kernel takes a past and a present bound to the same memory as
its shared-buffer mode (the mode onnxruntime-genai runs), where it writes the new tokens' keys and values after
the cached ones instead of copying the whole cache into a new present every step. The buffer holds more slots
than the mask has columns (``generate`` sizes it for the whole continuation; otherwise it doubles when full); the
slots past the mask's length are unused. On CUDA the same holds for float16 and float32 caches (a buffer that must
grow goes through the host, where bfloat16 has no array type: a bfloat16 cache keeps the copying form); an H200
measured 1.1-1.4x more tokens/s than the copying form on Qwen3-0.6B (docs/gpu-session.md).

The cache is whatever ``past_key_values.*`` inputs the graph declares, discovered by name: ``.key`` / ``.value``
(full attention: an empty past has a zero-length sequence axis) and, in hybrid models, ``.conv_state`` /
``.recurrent_state`` (linear attention: zeros of the declared static shape and dtype start a sequence), and in
Qwen3.8 ``.ngram_context`` / ``.ple_conv_state`` (zeros start) and ``.index_keys`` / ``.index_positions`` (empty, as
KV). Models
whose ``position_ids`` input is (3, B, T) (multimodal RoPE) get text positions repeated on the three
streams, as transformers' text models do inside; ``forward`` also takes (3, B, T) positions as they are (an image
prompt's, from the reference processor's ``get_rope_index``). Opened on ``model.embeds.onnx`` (``--inputs-embeds``),
it takes a prompt's ``inputs_embeds`` (the towers' embeddings among ``embed``'s token rows), and for Qwen3-VL and
Qwen3-Omni their DeepStack features, and looks token ids up through ``embed.onnx`` beside it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto
from onnxruntime.capi.onnxruntime_pybind11_state import (
    EPFail,
    InvalidArgument,
    RuntimeException,
)
from onnxruntime.capi.onnxruntime_pybind11_state import Fail as OrtFail
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedByOrt

from thinker_common.errors import ThinkerError
from thinker_common.source_files import ONNX_FILES, regular_file

from .graph_walk import all_nodes, rotates
from .names import (
    DEEPSTACK_EMBEDS,
    DTYPE_KEY,
    EMBED_FILE,
    EMBEDS_MODEL_FILE,
    EXPORT_ID_KEY,
    GENAI_MODEL_FILE,
    INPUTS_EMBEDS,
    LAST_POSITION_SCOPE,
    MODEL_FILE,
    PADDING_KEY,
)
from .onnx_folder import check_external_data, folder_context, table_rows
from .providers import CUDA, cuda_absence, cuda_usable, execution_providers, load_session, session_options
from .stop_tokens import model_stop_tokens

# onnxruntime's type strings for the cache dtypes, to the onnx element type (bfloat16 has no numpy dtype).
_FLOAT_TYPES = {"tensor(float)": (1, np.float32), "tensor(float16)": (10, np.float16), "tensor(bfloat16)": (16, None)}
# The KV types a CUDA buffer can share (grow through the host, as a numpy array): a bfloat16 cache keeps the copying
# form (``OnnxDecoder._kv_to_share``, ``generation_graph``).
CUDA_SHARED_KV_TYPES = frozenset(onnx_type for onnx_type, dtype in _FLOAT_TYPES.values() if dtype is not None)
# Qwen3.8's n-gram contexts and index positions are token ids and positions.
_ORT_TYPES = {**_FLOAT_TYPES, "tensor(int64)": (7, np.int64)}
# The kinds of carried state, in the order of a layer's inputs: KV grows along its sequence axis; the
# linear-attention states keep their shape. Qwen3.8 adds (export/qwen4_exp_graph.py) a PLE layer's n-gram context and
# conv window, which keep their shape, and an indexed layer's raw index keys and positions, which grow as KV does.
STATE_KINDS = (
    "key", "value", "conv_state", "recurrent_state", "ngram_context", "ple_conv_state", "index_keys", "index_positions"
)  # fmt: skip
KV_KINDS = ("key", "value")
# The kinds whose second axis (past the batch) is the past's length: zero-length in an empty cache.
GROWING_KINDS = (*KV_KINDS, "index_keys", "index_positions")


def generation_graph(folder: Path, provider: str, share_kv: bool | None = None) -> Path:
    """The graph to run for prompts without padding (``thinker generate``'s one prompt, a batch of equal rows): on
    CUDA (``provider`` "cuda", or "auto" where CUDA runs) the export's ``model.genai.onnx`` where it wrote one and
    its KV is one buffer written in place (``share_kv`` not False, a float16 or float32 cache), else ``model.onnx``.
    That graph is the fused one without the padding bias (export/genai_graph.py), which takes GroupQueryAttention
    off its fastest CUDA path (an H200's profile: 2.1-2.4 against 0.75 ms a step at batch 8), and gives rows without
    pads the same logits at each row's last position, the only one it puts through the head (``--verify`` checks it
    against PyTorch). Its KV must be the shared buffer: in the copying form (a past one slot longer every step) an
    H100 decoded 8.4 tokens/s over ``model.genai.onnx`` against 123 over ``model.onnx``
    (bench/results/gpu-h100-session5.json and gpu-h100.json, "copying KV"), as if GroupQueryAttention's bias-free
    path planned its kernel anew for each cache length, as its prompt run does per capacity (docs/gpu-session.md).
    On the CPU, under this runtime, the genai graph prefills 1.20x faster (the head on one position) but decodes
    at 0.990x (0.979-1.004) of ``model.onnx`` (SmolLM2, bench/bench_graph_ab.py,
    ``graph_ab_smollm2-ort-genai-graph-*.json``): past about 128 new tokens that loses more than the prefill gains,
    so the graph that takes left and right padding, and scores every position, stays."""
    genai_graph = folder / GENAI_MODEL_FILE
    on_cuda = provider == "cuda" or (provider == "auto" and cuda_usable())
    if not on_cuda or share_kv is False or not genai_graph.is_file():
        return folder / MODEL_FILE
    return genai_graph if cuda_shares_kv(genai_graph) else folder / MODEL_FILE


def cuda_shares_kv(path: Path) -> bool:
    """Whether ``OnnxDecoder`` on CUDA keeps the graph's KV as one buffer per layer (``share_kv`` None): every
    key and value cache of a type in ``CUDA_SHARED_KV_TYPES`` (the graph's structure read, not its weights)."""
    inputs = onnx.load(path, load_external_data=False).graph.input
    caches = [i for i in inputs if i.name.startswith("past_key_values.") and i.name.rsplit(".", 1)[1] in KV_KINDS]
    return all(i.type.tensor_type.elem_type in CUDA_SHARED_KV_TYPES for i in caches)


@dataclass
class DecoderState:
    """What one step hands to the next: the mask over every cached slot, each row's next position, the cache.
    A shared KV buffer (``OnnxDecoder.shared_kv``) may hold more slots than the mask has columns: those past the
    mask's length are unused."""

    attention_mask: np.ndarray  # (B, S) int64
    next_position: np.ndarray  # (B,) int64, or (3, B): one per multimodal stream (``next_positions``)
    cache: dict[str, object] = field(default_factory=dict)  # past_key_values.* name -> np.ndarray or OrtValue
    # the slots the cache holds, which the mask must cover; None (a state built by hand): a KV cache's own length,
    # or the mask's where every KV is a shared buffer
    cached: int | None = None


class OnnxDecoder:
    """An onnxruntime session over ``model.onnx`` that follows the Thinker IO contract.

    ``provider``: "auto" (CUDA when a CUDA session really runs, else CPU), "cuda" or "cpu".
    ``threads``: intra-op threads for CPU work, default all physical cores.
    ``all_positions``: logits for every position even from a graph exported with ``--logits last`` (which gives
    each row's last kept position only): the session then runs that graph with the selection left out
    (``all_positions_model``), as the export's own checks do to score a text.
    ``path`` may also name an export's ``model.genai.onnx`` (export/genai_graph.py): it takes no position_ids where
    its attention rotates by slot, and right-padded (or unpadded) batches only, which ``prefill`` checks.
    ``share_kv``: GroupQueryAttention's KV in one buffer per layer written in place (the module docstring). None:
    wherever it applies (on CUDA, float16 and float32 caches); True: the same, and a bfloat16 cache on CUDA is an
    error rather than the copying form; False: the copying form everywhere, the reference the tests hold the
    shared one to.
    ``probes``: intermediate values of the graph (name -> ONNX element type) returned beside the logits, in
    ``probed`` after each forward; the session runs the same nodes with those as outputs too (a check's window into
    the graph: export/routing.py).
    """

    def __init__(
        self,
        path: str | Path,
        provider: str = "auto",
        threads: int | None = None,
        all_positions: bool = False,
        share_kv: bool | None = None,
        probes: dict[str, int] | None = None,
    ) -> None:
        path = Path(path)
        # a folder named like the model (a copy gone wrong) is said to be one, not searched for a model.onnx inside
        self.model_path = path / MODEL_FILE if path.is_dir() and path.suffix != ".onnx" else path
        if self.model_path.is_dir():
            raise ThinkerError(f"{self.model_path}: a folder where the ONNX model file should be; export it again")
        if not os.path.lexists(self.model_path):
            raise ThinkerError(f"{self.model_path}: no such ONNX model; export one with `thinker export`")
        regular_file(self.model_path, ONNX_FILES)  # a broken link, a pipe or a device: said, not called missing
        if provider not in ("auto", "cuda", "cpu"):
            raise ThinkerError(f"provider={provider!r}; expected auto, cuda or cpu")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ThinkerError(f"threads={threads!r}; expected a whole number of threads, 1 or more (None: every core)")
        if provider == "cuda" and not cuda_usable():
            raise ThinkerError(f"provider='cuda': CUDA asked for where none is ({cuda_absence()}); use provider='cpu'")
        model = check_external_data(self.model_path)
        graph = model.graph
        # --logits last: the logits output's position axis is a static 1 (each row's last kept position)
        logits = next((o for o in graph.output if o.name == "logits"), None)
        if logits is None:
            raise ThinkerError(f"{self.model_path}: no logits output; export the model with `thinker export`")
        self.last_logits_only = [d.dim_value for d in logits.type.tensor_type.shape.dim][1:2] == [1]
        vocab = [d.dim_value for d in logits.type.tensor_type.shape.dim][2:3]
        self.vocab_size = vocab[0] if vocab and vocab[0] > 0 else None  # ids at or past it would fail in Gather
        self.context_length = folder_context(self.model_path.parent)[0]  # the position table's rows, where known
        # onnxruntime's GroupQueryAttention (the fused graph) takes several new tokens after a non-empty cache at
        # batch 1 only; ``forward`` refuses the other case by name rather than with the kernel's error.
        self.chunks_need_batch_1 = any(node.op_type == "GroupQueryAttention" for node in graph.node)
        self.rotates_by_slot = any(node.op_type == "GroupQueryAttention" and rotates(node) for node in graph.node)
        # onnxruntime's MRotaryEmbedding takes at most its table's rows of new tokens in one run, whatever their
        # positions (an image's stay low); GroupQueryAttention rotating by slot reads a row per slot of the mask. Both
        # refused by name (``refuse_slots_past_table``), where the plain graph, which reads a row per position, runs.
        self.steps_within_table = any(node.op_type == "MRotaryEmbedding" for node in graph.node)
        self.rope_rows = table_rows(graph)[0]  # what those kernels read; the context may be set shorter
        use_cuda = provider == "cuda" or (provider == "auto" and cuda_usable())
        providers = execution_providers(use_cuda)
        options, source = session_options(threads), str(self.model_path)
        variant = None  # the shipped graph's nodes with other outputs, loaded from bytes
        if all_positions and self.last_logits_only:
            variant, self.last_logits_only = all_positions_model(model), False
        # intermediate values returned beside the logits after each forward, in ``probed`` (a check's window into
        # the graph: export/routing.py reads what a half-precision MoE graph routes by so)
        self.probe_names = sorted(probes or {})
        self.probed: dict[str, np.ndarray] = {}
        self._probe_outputs = [probe_output(name, probes[name]) for name in self.probe_names]
        if self.probe_names:
            variant = variant or onnx.ModelProto.FromString(model.SerializeToString())
            for name, output in zip(self.probe_names, self._probe_outputs, strict=True):
                source = name.removesuffix(FLOAT32_VIEW)  # a view's tensor, or the probe's own
                if output != source:
                    variant.graph.node.append(onnx.helper.make_node("Cast", [source], [output], to=TensorProto.FLOAT))
                kind = probes[name] if output == source else TensorProto.FLOAT
                variant.graph.output.append(onnx.helper.make_tensor_value_info(output, kind, None))
        if variant is not None:
            source = variant.SerializeToString()
            # the weights file is found beside the model's path, which a model passed as bytes does not have
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(self.model_path.parent)
            )
        self.session = load_session(self.model_path, source, options, providers)
        self.device = "cuda" if CUDA in self.session.get_providers() else "cpu"
        if provider == "cuda" and self.device != "cuda":
            raise ThinkerError("onnxruntime could not start its CUDA execution provider here; use --provider cpu")

        inputs = {i.name: i for i in self.session.get_inputs()}
        takes_tokens = "input_ids" in inputs or INPUTS_EMBEDS in inputs
        if not takes_tokens or not any(n.startswith("past_key_values.") for n in inputs):
            raise ThinkerError(f"{self.model_path}: not a decoder with a KV cache (no past_key_values.* inputs)")
        # model.embeds.onnx (--inputs-embeds) takes embeddings; token ids go through embed.onnx beside it first
        self.takes_embeds = INPUTS_EMBEDS in inputs
        self.embed_session = None
        # Qwen3-VL / Qwen3-Omni: the layers whose hidden states take the vision tower's DeepStack features
        self.deepstack_layers = inputs[DEEPSTACK_EMBEDS].shape[0] if DEEPSTACK_EMBEDS in inputs else 0
        if self.takes_embeds:
            self.hidden_size = inputs[INPUTS_EMBEDS].shape[-1]
            embed_path = self.model_path.with_name(EMBED_FILE)
            if not embed_path.is_file():
                raise ThinkerError(
                    f"{self.model_path.parent}: {EMBED_FILE} missing beside {self.model_path.name}, which takes "
                    f"{INPUTS_EMBEDS}: it embeds the prompt's text tokens and every decode step's; copy the whole "
                    "folder, or export it again with --inputs-embeds"
                )
            check_external_data(embed_path)
            self.embed_session = load_session(embed_path, str(embed_path), session_options(threads), providers)
            ids = [s.get_modelmeta().custom_metadata_map.get(EXPORT_ID_KEY) for s in (self.session, self.embed_session)]
            if ids[0] != ids[1]:
                raise ThinkerError(
                    f"{embed_path}: from another export than {self.model_path.name} beside it (its lookup may read "
                    "other offsets of the weights file); copy the whole folder of one export"
                )
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")), key=self._state_order)
        self.present_names = [n.replace("past_key_values.", "present.", 1) for n in self.past_names]
        # name -> (shape with the batch axis left out, onnx element type, numpy dtype or None for bfloat16)
        self.state_specs = {name: self._state_spec(inputs[name]) for name in self.past_names}
        self.position_rank = len(inputs["position_ids"].shape) if "position_ids" in inputs else 2
        self.takes_positions = "position_ids" in inputs  # onnxruntime-genai's graph may rotate by slot instead
        metadata = self.session.get_modelmeta().custom_metadata_map
        # the graph's float type (float32 before the stamp was written): a half graph casts its float32 inputs,
        # so a larger value than its dtype holds would reach it as inf (``checked_floats``)
        self.dtype = metadata.get(DTYPE_KEY, "float32")
        # the least float32 a float16 cast turns to inf (65504 is float16's largest; up to 65520 rounds down to it)
        self.input_overflow = 65520.0 if self.dtype == "float16" else np.inf
        self.right_padding_only = metadata.get(PADDING_KEY) == "right"  # model.genai.onnx (export/genai_graph.py)
        # Qwen3.8's PLE states carry each row's last slots on (the n-gram context's ids, the dilated conv's taps):
        # pads after a row's tokens would be carried as its last tokens
        self.left_padding_only = any(name.endswith(LAST_SLOT_STATES) for name in inputs)
        # linear-attention layers take no pad between a row's tokens (``refuse_pads_between_tokens``)
        self.pads_outside_tokens = any(name.endswith(".conv_state") for name in inputs)
        self.output_names = ["logits", *self.present_names]
        self.shared_kv = self._kv_to_share(graph, share_kv)

    def _kv_to_share(self, graph: onnx.GraphProto, share_kv: bool | None) -> frozenset[str]:
        """The KV each GroupQueryAttention reads as its past and writes as its present, which one buffer serves
        (the module docstring), unless ``share_kv`` is False; on CUDA a float16 or float32 cache only."""
        if share_kv is False:
            return frozenset()
        names = shared_kv_names(graph)
        if self.device == "cuda" and any(self.state_specs[name][1] not in CUDA_SHARED_KV_TYPES for name in names):
            # a buffer that must grow goes through the host, where bfloat16 has no array type
            if share_kv is None:
                return frozenset()
            raise ThinkerError(
                f"{self.model_path}: share_kv=True on CUDA takes a float16 or float32 cache, not bfloat16"
            )
        return names

    def _state_order(self, name: str) -> tuple[int, int]:
        parts = name.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in STATE_KINDS:
            raise ThinkerError(
                f"{self.model_path}: input {name!r} is no state this runtime knows: expected "
                f"past_key_values.<layer>.{{{','.join(STATE_KINDS)}}}"
            )
        return int(parts[1]), STATE_KINDS.index(parts[2])

    def _state_spec(self, value) -> tuple[list[int], int, type | None]:
        kind = value.name.rsplit(".", 1)[1]
        shape = list(value.shape[1:])
        if kind in GROWING_KINDS:
            shape[1] = 0  # past_seq = 0: an empty cache
        if not all(isinstance(dim, int) for dim in shape):
            raise ThinkerError(
                f"{self.model_path}: input {value.name} has shape {value.shape}; every axis but the batch (and a "
                "growing cache's sequence) must be fixed. Export the model again"
            )
        if value.type not in _ORT_TYPES:
            raise ThinkerError(f"{self.model_path}: input {value.name} is {value.type}; expected a float type or int64")
        return (shape, *_ORT_TYPES[value.type])

    # --- the cache ------------------------------------------------------------------------------------------------
    def empty_cache(self, batch: int, slots: int = 0) -> dict[str, object]:
        """A sequence's start: KV with a zero-length sequence axis (past_seq = 0), linear-attention states as zeros
        of their declared shape and dtype. On CUDA every state is allocated on the device. ``slots``: room for that
        many tokens in a shared KV buffer (``shared_kv``; zeros, unused until written), so that it need not grow."""
        cache = {}
        for name, (shape, onnx_type, numpy_type) in self.state_specs.items():
            shape = [batch, *shape]
            if name in self.shared_kv:
                shape[2] = slots
            if self.device == "cuda":
                cache[name] = _device_zeros(shape, onnx_type)
            elif numpy_type is None:
                raise ThinkerError("this model keeps its cache in bfloat16, which onnxruntime runs on CUDA only")
            else:
                cache[name] = np.zeros(shape, numpy_type)
        return cache

    # --- one forward ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: np.ndarray | None,
        position_ids: np.ndarray,
        state: DecoderState,
        inputs_embeds: np.ndarray | None = None,
        deepstack_embeds: np.ndarray | None = None,
    ) -> np.ndarray:
        """Runs the graph on new tokens; ``state.cache`` becomes the presents. Returns logits (B, T, V) float32.
        ``position_ids`` (B, T), or (3, B, T) for a model with multimodal RoPE; a batch of 1 there stands for every
        row (B > 1), as in transformers. ``inputs_embeds`` (B, T, hidden), in place of ``input_ids``: the new
        positions' embeddings, for a graph exported with ``--inputs-embeds`` (``model.embeds.onnx``).
        ``deepstack_embeds`` (layers, B, T, hidden): a Qwen3-VL or Qwen3-Omni graph's DeepStack features (zeros
        when not given: ``deepstack_features`` builds them from transformers' form)."""
        self._check_state(state)
        tokens = self._token_feed(input_ids, inputs_embeds)
        batch, steps = tokens.shape[:2]
        what = described(input_ids, inputs_embeds)
        state.attention_mask = zeros_and_ones(state.attention_mask, "attention_mask", "1 keeps a slot, 0 masks a pad")
        self._check_mask(state.attention_mask, batch, steps, what)
        if self.pads_outside_tokens or self.rotates_by_slot:
            refuse_pads_between_tokens(state.attention_mask[:, -steps:], linear_attention=self.pads_outside_tokens)
        if self.chunks_need_batch_1 and batch > 1 and steps > 1 and state.attention_mask.shape[1] > steps:
            raise ThinkerError(
                f"{self.model_path}: {steps} new tokens after a non-empty cache at batch {batch}: this graph's "
                "GroupQueryAttention (--graph fused) takes several tokens after a cache at batch 1 only; feed the "
                "rows one at a time, the tokens one at a time, or export with --graph plain"
            )
        self.refuse_slots_past_table(state.attention_mask.shape[1], steps, not state.attention_mask[:, -steps:].all())
        feeds = {
            INPUTS_EMBEDS if self.takes_embeds else "input_ids": tokens,
            "attention_mask": np.ascontiguousarray(state.attention_mask, dtype=np.int64),
        }
        if self.deepstack_layers:
            shape = (self.deepstack_layers, batch, steps, self.hidden_size)
            if deepstack_embeds is None:
                deepstack_embeds = np.zeros(shape, np.float32)
            else:
                deepstack_embeds = self.checked_floats(deepstack_embeds, "deepstack_embeds")
                if deepstack_embeds.shape != shape:
                    raise ThinkerError(f"deepstack_embeds of shape {deepstack_embeds.shape}; expected {shape}")
            feeds[DEEPSTACK_EMBEDS] = deepstack_embeds
        elif deepstack_embeds is not None:
            raise ThinkerError(f"{self.model_path}: takes no DeepStack features (a model without them)")
        if self.takes_positions:
            positions = for_every_row(self.graph_positions(position_ids), batch)
            self._check_positions(positions, batch, steps, np.shape(position_ids), what)
            feeds["position_ids"] = np.ascontiguousarray(positions, dtype=np.int64)
        cached = self._slots_cached(state)
        if cached is not None and state.attention_mask.shape[1] != cached + steps:
            raise ThinkerError(
                f"attention_mask covers {state.attention_mask.shape[1]} slots, but the cache holds {cached} and "
                f"{steps} new token(s) follow: it must cover {cached + steps} (a step's mask is the last one "
                "with a column per new token appended)"
            )
        if self.device == "cuda" or self.shared_kv:
            logits = self._forward_bound(feeds, state)
        else:
            outputs = self.session.run(self.output_names + self._probe_outputs, {**feeds, **state.cache})
            presents, probed = outputs[1 : len(self.output_names)], outputs[len(self.output_names) :]
            state.cache = dict(zip(self.past_names, presents, strict=True))
            self.probed = dict(zip(self.probe_names, probed, strict=True))
            logits = outputs[0]
        state.cached = state.attention_mask.shape[1]
        return logits

    # What the graph would otherwise fail on deep inside onnxruntime (a Gather out of range, a broadcast of
    # mismatched shapes), or worse, compute without a word (a negative id reads the table's last row, a float mask
    # of 0.5 casts to 0): refused here by name.
    def _checked_ids(self, input_ids) -> np.ndarray:
        try:
            ids = as_numpy(input_ids)
        except (TypeError, ValueError):  # a list of rows of unequal length, say
            raise ThinkerError(
                "input_ids: not a (batch, seq) array of token ids; pad rows of unequal length on the left and mark "
                "the pads with attention_mask"
            ) from None
        if ids.ndim != 2 or 0 in ids.shape:
            raise ThinkerError(f"input_ids of shape {ids.shape}; expected (batch, seq) with at least one token a row")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ThinkerError(f"input_ids of dtype {ids.dtype}; token ids are integers")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            raise ThinkerError(f"token id {bad} is outside this model's vocabulary [0, {self.vocab_size})")
        return ids

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """(B, T, hidden) float32: the embeddings ``model.embeds.onnx`` takes for these token ids, looked up by
        ``embed.onnx`` (the rows ``model.onnx`` would look up itself). A prompt with tower embeddings is these with the
        towers' outputs written into its placeholder slots."""
        if self.embed_session is None:
            raise ThinkerError(
                f"{self.model_path}: takes input_ids; embed() is for a graph exported with --inputs-embeds "
                f"({EMBEDS_MODEL_FILE})"
            )
        ids = np.ascontiguousarray(self._checked_ids(input_ids), dtype=np.int64)
        return self.embed_session.run([INPUTS_EMBEDS], {"input_ids": ids})[0]

    def _token_feed(self, input_ids, inputs_embeds) -> np.ndarray:
        """What the graph takes for the new positions: token ids, or their embeddings."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ThinkerError("pass either input_ids or inputs_embeds, not both (nor neither)")
        if inputs_embeds is None:
            if self.takes_embeds:
                return self.embed(input_ids)
            return np.ascontiguousarray(self._checked_ids(input_ids), dtype=np.int64)
        return self._checked_embeds(inputs_embeds)

    def _checked_embeds(self, inputs_embeds) -> np.ndarray:
        """``inputs_embeds`` as the graph takes them, float32 (B, T, hidden); a torch tensor (a tower's output, in
        any float dtype, bfloat16 too, which numpy lacks) is taken as float32."""
        if not self.takes_embeds:
            raise ThinkerError(
                f"{self.model_path}: takes token ids; for inputs_embeds export with --inputs-embeds and open "
                f"{EMBEDS_MODEL_FILE}"
            )
        embeds = self.checked_floats(inputs_embeds, "inputs_embeds")
        if embeds.ndim != 3 or 0 in embeds.shape[:2] or embeds.shape[2] != self.hidden_size:
            raise ThinkerError(
                f"inputs_embeds of shape {embeds.shape}; expected (batch, seq, {self.hidden_size}) with at least one "
                "position a row"
            )
        return embeds

    def checked_floats(self, value, name: str) -> np.ndarray:
        """``value`` (numpy, a list, or a torch tensor of any float dtype: a tower's output) as the contiguous
        float32 the graph takes, refused by ``name`` where it is not floats, or holds a value that is not finite in
        float32 or beyond the graph's own dtype (a float16 graph casts its float32 inputs: a value from 65520 on
        becomes inf there, and inf times attention's zero weight is NaN, so even one in a masked pad turns its row's
        logits to NaN)."""
        try:
            array = as_numpy(value)
        except (TypeError, ValueError) as err:  # ragged lists, objects numpy cannot make an array of
            raise ThinkerError(f"{name}: not an array of floats ({err})") from None
        if array.dtype.kind == "V" and "float" in array.dtype.name:  # ml_dtypes' bfloat16 (JAX's, onnxruntime's)
            array = array.astype(np.float32)
        if not np.issubdtype(array.dtype, np.floating):
            raise ThinkerError(f"{name} of dtype {array.dtype}; expected floats")
        with np.errstate(over="ignore", invalid="ignore"):  # float64 past float32's range: inf, refused below
            floats = np.ascontiguousarray(array, dtype=np.float32)
            bad = np.argwhere(~(np.abs(floats) < self.input_overflow))  # NaN and inf fail the comparison too
        if bad.size:
            where = tuple(int(i) for i in bad[0])
            given = array[where]
            if not np.isfinite(given):
                raise ThinkerError(f"{name} hold inf or NaN (at {where})")
            beyond = "float32's range" if np.isinf(floats[where]) else f"the {self.dtype} graph's range (largest 65504)"
            raise ThinkerError(f"{name} hold {given} at {where}, beyond {beyond}")
        return floats

    def deepstack_features(
        self, visual_pos_masks, deepstack_visual_embeds, shape: tuple[int, int]
    ) -> np.ndarray | None:
        """The (layers, B, T, hidden) ``deepstack_embeds`` the graph takes, from transformers' form: the i-th
        (visual positions, hidden) features at the positions ``visual_pos_masks`` (B, T) marks, zeros elsewhere (and
        for layers past the list). None where neither is given."""
        if visual_pos_masks is None and deepstack_visual_embeds is None:
            return None
        if visual_pos_masks is None or deepstack_visual_embeds is None:
            raise ThinkerError("visual_pos_masks and deepstack_visual_embeds go together: pass both or neither")
        if not self.deepstack_layers:
            raise ThinkerError(
                f"{self.model_path}: takes no DeepStack features (a model without them, or not model.embeds.onnx)"
            )
        mask = zeros_and_ones(visual_pos_masks, "visual_pos_masks", "1 marks a visual position").astype(bool)
        if mask.shape != tuple(shape):
            raise ThinkerError(f"visual_pos_masks of shape {mask.shape}; expected (batch, seq) = {tuple(shape)}")
        if isinstance(deepstack_visual_embeds, (str, bytes)) or not hasattr(deepstack_visual_embeds, "__len__"):
            raise ThinkerError(
                f"deepstack_visual_embeds of type {type(deepstack_visual_embeds).__name__}; expected a list of "
                "(visual positions, hidden) features, one per DeepStack layer, as transformers' vision tower returns "
                "(or those stacked, (layers, visual positions, hidden))"
            )
        if len(deepstack_visual_embeds) > self.deepstack_layers:
            raise ThinkerError(
                f"{len(deepstack_visual_embeds)} deepstack_visual_embeds for a graph that adds them after its first "
                f"{self.deepstack_layers} layer(s)"
            )
        dense = np.zeros((self.deepstack_layers, *shape, self.hidden_size), np.float32)
        for index, features in enumerate(deepstack_visual_embeds):
            features = self.checked_floats(features, f"deepstack_visual_embeds[{index}]")
            if features.shape != (int(mask.sum()), self.hidden_size):
                raise ThinkerError(
                    f"deepstack_visual_embeds[{index}] of shape {features.shape}; expected ({int(mask.sum())}, "
                    f"{self.hidden_size}): a row for each of visual_pos_masks' positions"
                )
            dense[index][mask] = features
        return dense

    def _check_state(self, state) -> None:
        """Refuses a ``state`` that this decoder's ``prefill`` did not start (another model's, or none)."""
        if not isinstance(state, DecoderState):
            raise ThinkerError(f"state={state!r}; expected the DecoderState this decoder's prefill returned")
        missing = [name for name in self.past_names if name not in state.cache]
        if missing or len(state.cache) != len(self.past_names):
            held = f"lacks {missing[0]}" if missing else f"holds {len(state.cache)} states, not {len(self.past_names)}"
            raise ThinkerError(
                f"state: its cache {held}: a state from another model's decoder; start one with this decoder's prefill"
            )

    def _slots_cached(self, state: DecoderState) -> int | None:
        """The slots ``state``'s cache holds: as the decoder recorded them, else (a state built by hand) the sequence
        axis of a KV cache that is not a shared buffer (which holds unused slots past the mask's length); None where
        neither says (no KV but shared buffers, or none at all)."""
        if state.cached is not None:
            return state.cached
        for name in self.past_names:
            if name.rsplit(".", 1)[-1] in KV_KINDS and name not in self.shared_kv:
                value = state.cache[name]
                shape = value.shape() if isinstance(value, ort.OrtValue) else np.shape(value)
                return int(shape[2]) if len(shape) == 4 else None  # (batch, kv heads, slots, head dim)
        return None

    def _check_mask(self, mask: np.ndarray, batch: int, steps: int, what: str) -> None:
        if mask.ndim != 2 or mask.shape[0] != batch or mask.shape[1] < steps:
            raise ThinkerError(f"attention_mask of shape {mask.shape} for {what}; expected (batch, past + seq)")

    def _checked_prompt(self, input_ids, attention_mask, inputs_embeds=None) -> tuple:
        """A prompt's ids and embeddings (one of them None) as the graph takes them, and its mask, as given (a decode
        step's mask is the prompt's with a column of ones appended)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ThinkerError("pass either input_ids or inputs_embeds, not both (nor neither)")
        if inputs_embeds is not None:
            inputs_embeds = self._checked_embeds(inputs_embeds)  # once: a tower's CUDA tensor copied to the host once
            shape = inputs_embeds.shape[:2]
        else:
            input_ids = self._checked_ids(input_ids)
            shape = input_ids.shape
        if attention_mask is None:
            attention_mask = np.ones(shape, np.int64)
        mask = zeros_and_ones(attention_mask, "attention_mask", "1 keeps a token, 0 masks a pad")
        if mask.shape != shape:
            raise ThinkerError(
                f"attention_mask of shape {mask.shape} for {described(input_ids, inputs_embeds)}; a prompt's mask "
                "has one column per position"
            )
        empty = np.flatnonzero(~mask.any(axis=1))
        if empty.size:
            raise ThinkerError(f"row {int(empty[0])} of attention_mask keeps no token; every row needs one at least")
        return (None if input_ids is None else input_ids.astype(np.int64)), inputs_embeds, mask.astype(np.int64)

    def _check_positions(
        self, positions: np.ndarray, batch: int, steps: int, given: tuple[int, ...], what: str
    ) -> None:
        """``positions`` in the graph's form, from the caller's of shape ``given`` (the one an error quotes), for
        the new positions' ``what`` (their ids or embeddings, quoted)."""
        if positions.shape[-2:] != (batch, steps):
            raise ThinkerError(
                f"position_ids of shape {tuple(given)} for {what}; expected "
                f"({batch}, {steps}) or, with multimodal RoPE, (3, {batch}, {steps})"
            )
        # the graph reads RoPE from a table of positions 0 .. context - 1, where PyTorch computes any angle: a
        # fraction would be truncated and a negative position (cumsum - 1 on a pad, without masked_fill) would read
        # the table's end, or stop the fused graph's kernels
        if not np.issubdtype(positions.dtype, np.number) or np.issubdtype(positions.dtype, np.complexfloating):
            raise ThinkerError(f"position_ids of dtype {positions.dtype}; positions are whole numbers")
        # whole numbers held as floats are taken: Qwen3-Omni's get_rope_index hands its positions as float32
        if positions.dtype.kind == "f":
            fraction = positions[~(np.isfinite(positions) & (positions == np.round(positions)))]
            if fraction.size:
                raise ThinkerError(
                    f"position_ids hold {fraction.flat[0]}; the graph's RoPE tables hold whole positions only"
                )
        if int(positions.min()) < 0:
            raise ThinkerError(
                f"position_ids hold {int(positions.min())}; positions count from 0 (give a pad any position from 0, "
                "as transformers' masked_fill(attention_mask == 0, 1) does: its mask hides it)"
            )
        if self.context_length is not None and int(positions.max()) >= self.context_length:
            raise ThinkerError(
                f"position {int(positions.max())} is past this model's context of {self.context_length} positions "
                "(max_position_embeddings); shorten the prompt or the number of new tokens"
            )

    def graph_positions(self, position_ids: np.ndarray) -> np.ndarray:
        """Positions in the graph's rank, from any form the Thinker takes: (B, T) text positions repeated on the
        three multimodal streams; (4, B, T), a text row before the three streams, as its streams (the text row only
        orders the attention mask, which the graph takes as attention_mask); (3, B, T) ones whose streams are equal
        (text) taken as (B, T) by a graph of (B, T) positions."""
        position_ids = as_numpy(position_ids)  # a torch tensor in any dtype, on any device
        if position_ids.ndim == 3 and len(position_ids) == 4:
            position_ids = position_ids[1:]
        if position_ids.ndim == 3 and len(position_ids) != 3:
            raise ThinkerError(
                f"position_ids of shape {position_ids.shape}; multimodal positions are (3, B, T) or (4, B, T)"
            )
        if position_ids.ndim == self.position_rank:
            return position_ids
        if position_ids.ndim == 2 and self.position_rank == 3:
            return np.broadcast_to(position_ids, (3, *position_ids.shape))
        if position_ids.ndim == 3 and self.position_rank == 2:
            if (position_ids == position_ids[:1]).all():
                return position_ids[0]
            raise ThinkerError(
                f"{self.model_path}: position_ids with distinct multimodal streams, and this graph takes (B, T) text "
                "positions: exported with --positions text (export with --positions multimodal for them), or a "
                "model without multimodal RoPE, which has one stream"
            )
        raise ThinkerError(
            f"position_ids of shape {position_ids.shape}; this model takes rank {self.position_rank} "
            "((B, T), or (3, B, T) with multimodal RoPE)"
        )

    def _forward_bound(self, feeds: dict[str, np.ndarray], state: DecoderState) -> np.ndarray:
        """A step through IO binding: on CUDA every state stays on the device (the last step's presents bound as
        this step's pasts); a shared KV buffer, on either device, is bound as its layer's past and present, which
        GroupQueryAttention writes in place. Only the logits come back to the host."""
        self._reserve_kv(state)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")  # first: get_outputs() follows the binding order
        for past, present in zip(self.past_names, self.present_names, strict=True):
            value = state.cache[past]
            if isinstance(value, np.ndarray):  # the CPU's states: an OrtValue over the array, no copy
                value = ort.OrtValue.ortvalue_from_numpy(value)
            binding.bind_ortvalue_input(past, value)
            if past in self.shared_kv:
                binding.bind_ortvalue_output(present, value)
            else:
                binding.bind_output(present, self.device, 0)  # onnxruntime allocates it there
        for name in self._probe_outputs:
            binding.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(binding)
        except RuntimeError as err:
            # run() raises onnxruntime's own types (ORT_RUN_ERRORS), which the export's check reports in one line;
            # a bound run's failure comes as a bare RuntimeError ("Error in execution: ..."), and a graph failing
            # there showed a traceback (a mutation run)
            raise OrtFail(str(err)) from None
        logits, *outputs = binding.get_outputs()
        presents, probed = outputs[: len(self.past_names)], outputs[len(self.past_names) :]
        self.probed = {name: value.numpy() for name, value in zip(self.probe_names, probed, strict=True)}
        for past, value in zip(self.past_names, presents, strict=True):
            if past not in self.shared_kv:  # a shared buffer already holds its present
                state.cache[past] = value.numpy() if self.device == "cpu" else value
        return logits.numpy()

    def _reserve_kv(self, state: DecoderState) -> None:
        """Grows each shared KV buffer (B, H, slots, D) to hold the mask's columns, to twice its slots at least (a
        sequence that outgrows its buffer copies it a logarithmic number of times); the new slots are zeros. On CUDA
        the copy goes through the host: ``generate`` sizes the buffer once, so only a step-by-step caller that did not
        pass ``new_tokens`` pays it."""
        slots = state.attention_mask.shape[1]
        for name in self.shared_kv:
            buffer = state.cache[name]
            shape = buffer.shape if isinstance(buffer, np.ndarray) else buffer.shape()
            if shape[2] >= slots:
                continue
            host = buffer if isinstance(buffer, np.ndarray) else buffer.numpy()
            grown = np.zeros((*shape[:2], max(slots, 2 * shape[2]), shape[3]), host.dtype)
            grown[:, :, : shape[2]] = host
            state.cache[name] = grown if self.device == "cpu" else ort.OrtValue.ortvalue_from_numpy(grown, "cuda", 0)

    # --- the verbs ------------------------------------------------------------------------------------------------
    def prefill(
        self,
        input_ids: np.ndarray | None = None,
        attention_mask: np.ndarray | None = None,
        new_tokens: int = 0,
        inputs_embeds: np.ndarray | None = None,
        position_ids: np.ndarray | None = None,
        visual_pos_masks: np.ndarray | None = None,
        deepstack_visual_embeds: list | None = None,
    ) -> tuple[np.ndarray, DecoderState]:
        """The prompt (left-padded when rows differ in length) through an empty cache. Logits (B, T, V), or (B, 1, V)
        from a ``--logits last`` graph: each row's last kept position. ``new_tokens``: how many tokens will follow,
        which a shared KV buffer is sized for up front. ``inputs_embeds`` (B, T, hidden), in place of ``input_ids``:
        the prompt's embeddings (``model.embeds.onnx``). ``position_ids``: the prompt's own, (3, B, T) for an image
        or audio prompt of a multimodal-RoPE model (the reference processor's ``get_rope_index``); each row then
        continues one past its last kept position on each stream, as transformers' ``generate`` does
        (``next_positions``; the state's ``next_position`` is then (3, B) on a multimodal-RoPE graph, (B,) otherwise).
        Default: counted from the mask. ``visual_pos_masks`` (B, T) and ``deepstack_visual_embeds`` (a list of
        (visual positions, hidden) features): a Qwen3-VL or Qwen3-Omni image prompt's DeepStack features, as its
        model hands them to its text decoder."""
        new_tokens = whole_number(new_tokens, "new_tokens")
        input_ids, inputs_embeds, attention_mask = self._checked_prompt(input_ids, attention_mask, inputs_embeds)
        if self.right_padding_only and (np.diff(attention_mask, axis=1) > 0).any():
            raise ThinkerError(
                f"{self.model_path}: onnxruntime-genai's graph takes right-padded batches only, and a row of this "
                f"one has pads before its tokens; run {MODEL_FILE}, which takes them"
            )
        if self.left_padding_only and (np.diff(attention_mask, axis=1) < 0).any():
            raise ThinkerError(
                f"{self.model_path}: Qwen3.8's graph takes left-padded batches only (its PLE states carry each row's "
                "last slots on), and a row of this one has pads after its tokens; pad the rows on the left"
            )
        if position_ids is None:
            positions = position_ids_from_mask(attention_mask)
            next_position = positions[:, -1] + 1
            following = int(attention_mask.sum(axis=1).max())
            prompt = f"a prompt of {following} tokens"
        else:
            positions = self._prompt_positions(position_ids, attention_mask, input_ids, inputs_embeds)
            next_position = next_positions(positions, attention_mask)
            following = int(next_position.max())  # its own positions may run ahead of its tokens (a video's)
            prompt = f"a prompt at positions up to {following - 1}"
        # Refused before the first token rather than at the step that runs out (``generate``'s streamer would have
        # printed the rest): the last new token is never fed back, so it takes no position.
        needed = max(following, following + new_tokens - 1)
        if self.context_length is not None and needed > self.context_length:
            raise ThinkerError(
                f"{prompt} and {new_tokens} new tokens need {needed} positions, past this model's "
                f"context of {self.context_length}; shorten the prompt or lower max_new_tokens"
            )
        slots = attention_mask.shape[1] + max(0, new_tokens - 1)
        self.refuse_slots_past_table(slots, attention_mask.shape[1], not attention_mask.all())
        deepstack = self.deepstack_features(visual_pos_masks, deepstack_visual_embeds, attention_mask.shape)
        cache = self.empty_cache(attention_mask.shape[0], slots=attention_mask.shape[1] + new_tokens)
        state = DecoderState(attention_mask, next_position, cache, cached=0)
        return self.forward(input_ids, positions, state, inputs_embeds, deepstack), state

    def refuse_slots_past_table(self, slots: int, steps: int, padded: bool) -> None:
        """Where the fused graph's kernels read their RoPE table by slot or by step (``rotates_by_slot``,
        ``steps_within_table``), ``slots`` mask columns (pads included) or ``steps`` new tokens in one run past its
        rows are refused here, before onnxruntime stops on them, though every position fits (a QA run: a prompt
        padded past the context, an image prompt longer than the table). ``padded``: the new tokens' columns hold
        pads, whose trimming the advice names only then."""
        rows = self.rope_rows
        if rows is None:
            return
        if self.rotates_by_slot and slots > rows:
            raise ThinkerError(
                f"{self.model_path}: {slots} slots of attention_mask (pads included) with the new tokens, past the "
                f"{rows} rows of this graph's RoPE table, which its GroupQueryAttention reads one per slot (--graph "
                "fused): trim the batch's padding, or export with --graph plain, which reads one per position"
            )
        if self.steps_within_table and steps > rows:
            trim = ", pads included: trim the batch's padding, or" if padded else ";"
            raise ThinkerError(
                f"{self.model_path}: {steps} new tokens in one run, past the {rows} rows of this graph's RoPE table, "
                "which its MRotaryEmbedding takes at most at once (--graph fused), whatever their positions"
                f"{trim} export with --graph plain, which reads one row per position"
            )

    def _prompt_positions(self, position_ids, attention_mask, input_ids, inputs_embeds) -> np.ndarray:
        """A prompt's own ``position_ids`` in the graph's form, checked against the prompt (before its next
        positions are reckoned from them)."""
        batch, steps = attention_mask.shape
        positions = for_every_row(self.graph_positions(position_ids), batch)
        self._check_positions(positions, batch, steps, np.shape(position_ids), described(input_ids, inputs_embeds))
        if self.rotates_by_slot:
            # GroupQueryAttention rotating q and k itself numbers a prompt's tokens by their slots from the row's
            # first kept one (export/fused_graph.py): right for positions that count up one a token, not others
            kept = attention_mask.astype(bool)
            gaps = [np.diff(row[keep]) for row, keep in zip(positions, kept, strict=True)]
            if any((gap != 1).any() for gap in gaps):
                raise ThinkerError(
                    f"{self.model_path}: position_ids that do not count up one a token, and this graph's "
                    "GroupQueryAttention rotates a prompt by its slots (the fused graph of a model without "
                    "multimodal RoPE); export with --graph plain for such positions"
                )
        return positions

    def decode_one_token(self, tokens: np.ndarray, state: DecoderState) -> np.ndarray:
        """One new token per row after the cache. Returns logits (B, V)."""
        self._check_state(state)
        tokens = as_numpy(tokens)
        batch = tokens.shape[0] if tokens.ndim else 0
        if tokens.size != batch or batch != state.attention_mask.shape[0]:
            raise ThinkerError(
                f"tokens of shape {tokens.shape} for a batch of {state.attention_mask.shape[0]}; decode_one_token "
                "takes one token per row"
            )
        mask = state.attention_mask
        state.attention_mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        try:
            logits = self.forward(tokens.reshape(batch, 1), state.next_position[..., None], state)  # (B, 1) / (3, B, 1)
        except BaseException:  # a refused token leaves the state as it was, so that the caller may go on from it
            state.attention_mask = mask
            raise
        state.next_position = state.next_position + 1
        return logits[:, -1]

    def _stop_tokens(self, eos_token_id, pad_token_id) -> tuple[set[int], int]:
        """``generate``'s eos ids and pad id: those given, else the folder's (``model_stop_tokens``); the pad, where
        none is named, the first eos id, as transformers' ``generate`` pads (0 without one)."""
        folder_eos, folder_pad, where = model_stop_tokens(self.model_path.parent)
        eos_name = "eos_token_id" if eos_token_id is not None else f"{where}: eos_token_id"  # named by its file
        pad_name = "pad_token_id" if pad_token_id is not None else f"{where}: pad_token_id"
        eos_token_id = folder_eos if eos_token_id is None else eos_token_id
        pad_token_id = folder_pad if pad_token_id is None else pad_token_id
        stops_nowhere = eos_token_id is None or (isinstance(eos_token_id, list | tuple) and not eos_token_id)
        eos = [] if stops_nowhere else token_ids(eos_token_id, eos_name)
        if pad_token_id is None:
            return set(eos), eos[0] if eos else 0
        pad = token_ids(pad_token_id, pad_name, one=True)[0]
        if self.vocab_size is not None and pad >= self.vocab_size:  # fed to the graph once a row stops: said first
            raise ThinkerError(
                f"{pad_name}={pad} is outside this model's vocabulary [0, {self.vocab_size}): a row that stops is "
                "padded with it and fed to the model; give a token id of the vocabulary"
            )
        return set(eos), pad

    def generate(
        self,
        input_ids: np.ndarray | None = None,
        attention_mask: np.ndarray | None = None,
        max_new_tokens: int = 32,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        streamer=None,
        inputs_embeds: np.ndarray | None = None,
        position_ids: np.ndarray | None = None,
        visual_pos_masks: np.ndarray | None = None,
        deepstack_visual_embeds: list | None = None,
    ) -> np.ndarray:
        """Greedy continuation; returns (B, T + n) tokens, or the (B, n) new ones for a prompt given as
        ``inputs_embeds`` (as transformers' ``generate`` does). Rows that reach EOS are padded from there on (as
        transformers' ``generate`` does) and the loop stops when every row has. ``eos_token_id`` and
        ``pad_token_id`` default to the model folder's own (generation_config.json, else config.json), as
        transformers' ``generate`` takes its model's generation config; ``eos_token_id=[]`` stops at none.
        ``streamer``: one of transformers' streamers (``TextStreamer``, ``TextIteratorStreamer``), fed as its
        ``generate`` feeds it: ``put`` the prompt (its ids, when given), then each step's new tokens as they come,
        then ``end``. ``inputs_embeds``, ``position_ids``, ``visual_pos_masks`` and ``deepstack_visual_embeds``: as
        ``prefill`` takes them."""
        max_new_tokens = whole_number(max_new_tokens, "max_new_tokens")
        eos, pad = self._stop_tokens(eos_token_id, pad_token_id)
        deepstack = {"visual_pos_masks": visual_pos_masks, "deepstack_visual_embeds": deepstack_visual_embeds}
        # the prefill checks the whole request (the context included) before the streamer is given anything
        logits, state = self.prefill(
            input_ids, attention_mask, max_new_tokens, inputs_embeds, position_ids, **deepstack
        )
        batch = state.attention_mask.shape[0]
        # a prompt of embeddings streams as no tokens, as transformers' generate puts it
        prompt = np.zeros((batch, 0), np.int64) if input_ids is None else as_numpy(input_ids).astype(np.int64)
        if streamer is not None:
            streamer.put(prompt)
        next_logits = last_kept_logits(logits, state.attention_mask)
        done = np.zeros(batch, dtype=bool)
        new_tokens = []
        for step in range(max_new_tokens):
            token = np.where(done, pad, next_logits.argmax(-1)).astype(np.int64)
            new_tokens.append(token)
            if streamer is not None:
                streamer.put(token)
            done |= np.isin(token, list(eos))
            if done.all() or step == max_new_tokens - 1:
                break
            next_logits = self.decode_one_token(token, state)
        if streamer is not None:
            streamer.end()
        new = np.stack(new_tokens, axis=1) if new_tokens else np.zeros((batch, 0), np.int64)
        return new if input_ids is None else np.concatenate([prompt, new], axis=1)


# A probe named TENSOR + FLOAT32_VIEW reads TENSOR through a Cast to float32, whatever its type; where onnxruntime
# runs TENSOR's producer in float32 and rounds its output to float16 only for readers that keep float16 (the CPU
# provider's inserted casts), the pair of casts is dropped and the view holds the float32 value those other readers
# take (export/routing.py: what the MoE op routes by).
FLOAT32_VIEW = "/float32"


def probe_output(name: str, kind: int) -> str:
    """The graph output that returns the probe ``name`` of element type ``kind``: itself; a float32 view
    (``FLOAT32_VIEW``); or for bfloat16 a float32 copy (exact), as numpy has no bfloat16 for ``session.run`` or
    ``OrtValue.numpy()`` to hand back."""
    return f"{name}{FLOAT32_VIEW}" if kind == TensorProto.BFLOAT16 else name


def shared_kv_names(graph: onnx.GraphProto) -> frozenset[str]:
    """The ``past_key_values.*`` inputs that a GroupQueryAttention node reads as its past key or value (inputs 3 and
    4), whose present (its outputs 1 and 2) is the graph's ``present.*`` of the same name, and that no other node
    reads (in a subgraph either): the KV that kernel can write in place. Another reader would see the buffer's
    unused slots in its shape, or values the kernel has already overwritten."""
    readers = Counter(name for node in all_nodes(graph) for name in node.input)
    shared = set()
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 5:
            continue
        for past, present in zip(node.input[3:5], node.output[1:3], strict=False):
            writes_its_present = present == past.replace("past_key_values.", "present.", 1)
            if past.startswith("past_key_values.") and writes_its_present and readers[past] == 1:
                shared.add(past)
    return frozenset(shared)


def all_positions_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A ``--logits last`` graph with its selection of the last position left out: the head reads every position
    and ``logits`` is (B, T, V), as from ``--logits all``; every other node is the shipped graph's. A graph output
    naming the selection's result (a probe of the head's input, as the accuracy guard adds) becomes the head's input
    at every position too. The weights stay where the model's external data says (load the result with its folder
    named, as ``OnnxDecoder`` does)."""
    prefix = f"/lm_head/{LAST_POSITION_SCOPE}/"
    selection = [node for node in model.graph.node if node.name.startswith(prefix)]
    picks = [node for node in selection if node.op_type == "GatherND"]
    made = {name for node in selection for name in node.output}
    read = {
        name for node in model.graph.node if not node.name.startswith(prefix) for name in node.input if name in made
    }
    if len(picks) != 1 or len(read) != 1:
        raise ThinkerError(f"a --logits last graph without its {prefix}GatherND; export the model again")
    hidden, (picked,) = picks[0].input[0], read
    full = onnx.ModelProto()
    full.CopyFrom(model)
    del full.graph.node[:]
    for node in model.graph.node:
        if node.name.startswith(prefix):
            continue
        copy = full.graph.node.add()
        copy.CopyFrom(node)
        copy.input[:] = [hidden if name == picked else name for name in node.input]
    if any(output.name == picked for output in model.graph.output):
        full.graph.node.add().CopyFrom(onnx.helper.make_node("Identity", [hidden], [picked], name="/lm_head/probed"))
    positions = full.graph.output[0].type.tensor_type.shape.dim[1]
    positions.Clear()
    positions.dim_param = "sequence_length"
    return full


def last_kept_logits(logits: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """(B, V): each row's logits at its last kept position, the column its next token follows: the last column of a
    left-padded row, the last before its pads of a right-padded one. A ``--logits last`` graph gives that one
    position already."""
    if logits.shape[1] == 1:
        return logits[:, 0]
    last = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1], axis=1)
    return logits[np.arange(len(logits)), last]


def described(input_ids, inputs_embeds) -> str:
    """The new positions as the caller gave them, for messages: their ids' shape or their embeddings'."""
    if inputs_embeds is None:
        return f"input_ids of shape {np.shape(input_ids)}"
    return f"inputs_embeds of shape {np.shape(inputs_embeds)}"


def for_every_row(positions: np.ndarray, batch: int) -> np.ndarray:
    """``positions`` (..., B, T) with a batch of 1 standing for every row of ``batch``, as transformers takes them."""
    if positions.ndim >= 2 and positions.shape[-2] == 1 and batch > 1:
        return np.broadcast_to(positions, (*positions.shape[:-2], batch, positions.shape[-1]))
    return positions


def as_numpy(value):
    """``value`` as a numpy array: a torch tensor (a tower's output, in any dtype, bfloat16 too, which numpy lacks:
    floats narrower than float32 as float32) without importing torch; anything else through ``np.asarray``."""
    if hasattr(value, "detach") and hasattr(value, "is_floating_point"):
        value = value.detach().cpu()
        # float64 stays float64, so that a value past float32's range is named as given, not as the inf it casts to
        return (value.float() if value.is_floating_point() and value.dtype.itemsize < 4 else value).numpy()
    return np.asarray(value)


def whole_number(value, name: str) -> int:
    """``value`` as an int (a Python or numpy integer, 0 or more), refused by ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ThinkerError(f"{name}={value!r}; expected a whole number, 0 or more")
    return int(value)


def token_ids(value, name: str, one: bool = False) -> list[int]:
    """A token id or a list of them (``one``: a single id) as ints, refused by ``name`` otherwise: a string or a
    float would never equal a generated token, and generation would run past it without a word."""
    try:
        ids = as_numpy(value)
    except (TypeError, ValueError):
        ids = None
    fits = (
        ids is not None and ids.dtype.kind in "iu" and ids.size > 0 and (ids.ndim == 0 or (ids.ndim == 1 and not one))
    )
    if not fits or int(ids.min()) < 0:
        expected = "a token id" if one else "a token id or a list of them"
        raise ThinkerError(f"{name}={value!r}; expected {expected} (whole numbers, 0 or more)")
    return [int(token) for token in np.atleast_1d(ids)]


def zeros_and_ones(value, name: str, meaning: str) -> np.ndarray:
    """A mask (numpy, a list, a torch tensor in any dtype) as numpy, refused by ``name`` unless every value is 0 or
    1 (``meaning`` says what 1 is): a float 0.5 would be cast to 0, a 2 to true, without a word."""
    try:
        mask = as_numpy(value)
    except (TypeError, ValueError) as err:
        raise ThinkerError(f"{name}: not an array of 0 and 1 ({err})") from None
    if mask.dtype.kind not in "biuf" or not ((mask == 0) | (mask == 1)).all():
        raise ThinkerError(f"{name} holds values other than 0 and 1 ({meaning})")
    return mask


def next_positions(position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """The positions each row's next token takes after a prompt at ``position_ids``: (B,) for (B, T) positions,
    (3, B) for (3, B, T) ones (a batch of 1 stands for every row): on each stream, one past the position of the
    row's last kept slot, as transformers' ``generate`` continues every stream of a multimodal prompt. A text
    prompt's last position + 1; after an image, whose grid numbers fewer positions than its tokens, the text that
    follows it carries on from the image's largest position, and so does generation after that text."""
    last = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1], axis=1)  # (B,): the last kept slot
    positions = np.broadcast_to(position_ids, (*position_ids.shape[:-2], *attention_mask.shape))
    index = np.broadcast_to(last[:, None], (*positions.shape[:-1], 1))
    return (np.take_along_axis(positions, index, axis=-1)[..., 0] + 1).astype(np.int64)


# The states whose graph reads each row's last slots (export/ple_graph.py), which pads after its tokens would be.
LAST_SLOT_STATES = (".ngram_context", ".ple_conv_state")


def refuse_pads_between_tokens(new_slots: np.ndarray, linear_attention: bool) -> None:
    """Refuses a pad between kept slots of one forward's new slots (B, T), where the graph cannot give the row's own
    result. ``linear_attention``: the graph and transformers' layers (which the Thinker follows) carry their conv
    window and recurrent state through such a slot differently, and neither as the row without it, so the logits
    part by several (3.4 on a Qwen3.5, 5.9 on a Qwen3-Next; found by a QA run). Else a fused graph whose
    GroupQueryAttention rotates a prompt's tokens by their slots (``rotates_by_slot``): every token after the pad
    is rotated a position too far (2.5 apart on SmolLM2, silently; found by a QA run). Pads before a row's tokens
    (left padding), after them (right padding) and whole masked steps agree with the row run alone
    (tests/export/test_onnx_hybrid.py, test_onnx_fused.py)."""
    kept = np.cumsum(new_slots, axis=1)
    holes = np.flatnonzero(((new_slots == 0) & (kept > 0) & (kept < kept[:, -1:])).any(axis=1))
    if not holes.size:
        return
    row = int(holes[0])
    if linear_attention:
        raise ThinkerError(
            f"row {row} of attention_mask masks a slot between its new tokens, and this model's linear-attention "
            "layers take pads before or after a row's tokens only; pad the rows on the left or on the right"
        )
    raise ThinkerError(
        f"row {row} of attention_mask masks a slot between its new tokens, and this graph's GroupQueryAttention "
        "rotates a prompt's tokens by their slots (the fused graph), which would count the pad; pad the rows on "
        "the left or on the right, or export with --graph plain, which takes such masks"
    )


def position_ids_from_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Each kept slot's position counts the kept slots before it. Pads before a row's tokens get 0 (any valid row
    of the tables); pads after them repeat its last position, so that one past a row's last slot is one past its
    last token in either padding (onnxruntime-genai's right-padded rows)."""
    return np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0).astype(np.int64)


# What onnxruntime raises when a loaded graph fails to run (a kernel's check on its inputs, an index out of range).
ORT_RUN_ERRORS = (OrtFail, InvalidArgument, RuntimeException, EPFail, NotImplementedByOrt)


def _device_zeros(shape: list[int], onnx_type: int) -> ort.OrtValue:
    """A CUDA OrtValue of zeros (an empty KV cache allocates nothing). Zeros are all-zero bits in every float and
    integer type, so a host array of the same item size (bfloat16 has no numpy dtype) is copied in once."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(shape, onnx_type, "cuda", 0)
    if 0 not in shape:
        bits = np.zeros(shape, {1: np.float32, 7: np.int64}.get(onnx_type, np.uint16))  # float32, int64, half
        value.update_inplace(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_type))
    return value
