"""A model whose weights stay on disk: built on the meta device, each unit read from its files just before it runs
and dropped as soon as it has run, so that running the whole model costs the memory of its largest unit.

A unit is a decoder layer (an instance of a class the model lists in ``_no_split_modules``, transformers' own
declaration of what must never be split, which accelerate's device maps also keep whole), or any other module that
owns parameters directly (the embeddings, the final norm, the head). The model's own ``forward`` runs unchanged:
masks, position embeddings and any per-layer state are computed exactly as the model computes them, and forward
hooks load and drop each unit around its call. An observer may look at each unit's inputs and output, and run the
unit again on other inputs, while its weights are in memory (``converter/layer_parity.py`` does).

For transformers models, a unit's tensors go through transformers' own loading function,
``convert_and_load_state_dict_in_model``, with the weight conversions ``from_pretrained`` would use
(``get_model_conversion_mapping``: per-expert tensors fused into 3-D experts for Qwen-MoE, prefix changes of
multimodal checkpoints, legacy names), restricted to the checkpoint keys that land in the unit. So a unit holds
exactly what ``from_pretrained`` would have put there, in the same dtype.

Why not accelerate's disk offload (``from_pretrained(device_map=..., offload_folder=...)``), which also loads one
layer at a time through hooks: before the first forward it writes every tensor a conversion touches into the
offload folder (for a Qwen-MoE checkpoint with per-expert tensors, nearly the whole model written to disk a second
time), and transformers refuses disk offload for GGUF files. Here nothing is written; a unit is converted in memory
when it is needed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from thinker.modeling_thinker import CACHE_ARG
from thinker_common.dtypes import safetensors_code
from thinker_common.eager import EAGER
from thinker_common.errors import ThinkerError
from thinker_common.sources import TensorSource


class LazyTensor:
    """One checkpoint tensor, read when indexed (``tensor[...]``), which is how transformers' loader materialises
    the safetensors slices it is normally given."""

    def __init__(self, read: Callable[[], torch.Tensor], shape: Sequence[int], dtype: torch.dtype) -> None:
        self._read, self.shape, self.dtype = read, tuple(shape), dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._read()[index]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        """The safetensors code of its dtype, as a safetensors slice answers (transformers' quantizers ask)."""
        return safetensors_code(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def lazy_tensors(source: TensorSource, rounded_to: torch.dtype | None = None) -> dict[str, LazyTensor]:
    """Every tensor of a source (``thinker_common.sources``), none read yet; ``rounded_to``: each floating-point
    one rounded to that dtype as it is read, and handed back in its own."""

    def read(name: str) -> torch.Tensor:
        tensor = source.load(name)
        if rounded_to is None or not tensor.is_floating_point():
            return tensor
        return tensor.to(rounded_to).to(tensor.dtype)

    return {
        name: LazyTensor(lambda name=name: read(name), source.shape(name), source.dtype(name))
        for name in source.names()
    }


@dataclass
class Unit:
    """What is loaded and dropped at once: a module, the parameter (and persistent buffer) names it owns, and the
    checkpoint keys they are made from."""

    name: str  # module path, "" for the root
    module: nn.Module
    tensors: list[str]  # full names of the parameters and persistent buffers the unit owns
    is_layer: bool
    keys: list[str] = field(default_factory=list)  # checkpoint keys that load them
    ties: dict[str, str] = field(default_factory=dict)  # tied parameter -> the parameter it shares storage with

    def nbytes(self, tensors: Mapping[str, LazyTensor]) -> int:
        return sum(tensors[key].nbytes for key in self.keys)


# (unit, positional args, keyword args, output) -> None; called after the unit ran, while its weights are loaded.
Observer = Callable[[Unit, tuple, dict, Any], None]
# (model, input_ids, attention_mask, position_ids) -> logits: how a batch is fed to the model.
Caller = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# (model, input_ids, attention_mask, position_ids, cache or None) -> (logits, cache): a pass that keeps the model's own
# cache, for decode steps after a prompt.
CachedCaller = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]]


def fixed_malloc_thresholds() -> None:
    """glibc's malloc raises its mmap threshold (up to 32 MB) each time a block above it is freed, as a unit's
    tensors are, and serves every smaller block from its heap from then on, which keeps what is freed: a streamed
    check's resident set grew past the memory of a layer by the activations of every pass (bench/bench_big.py, a
    2-layer Qwen3-30B-A3B-shaped check: 4.99 GiB peak; 3.59 GiB with the thresholds fixed at 128 KB, glibc's default,
    which also stops that growth). Elsewhere (no glibc) nothing is done."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    trim_threshold, mmap_threshold = -1, -3  # glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    for option in (trim_threshold, mmap_threshold):
        mallopt(option, 128 * 1024)


def trim_freed_memory() -> None:
    """Hands the memory glibc's malloc holds freed back to the system (``malloc_trim``, which also releases free
    pages inside its heap). Where the thresholds must stay dynamic, for speed (export/awq.py's search allocates and
    frees blocks of a few MB thousands of times: mapped and faulted afresh each time, it took 1.8x as long), a call
    after each unit stops the growth ``fixed_malloc_thresholds`` stops: on SmolLM2 the scales' resident set grew by
    11 MB a layer without it and stayed flat with it. Elsewhere (no glibc) nothing is done."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return


def without_router_loss(model: nn.Module) -> None:
    """Logits are compared, not the router's load-balancing loss, which a source's config may ask for (fine-tuned
    MoE checkpoints keep ``output_router_logits``) and which transformers' MoE classes fail to compute on a batch
    with pads (the layer check) or a decode step after a cache: switched off on every config a module reads."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False):
            config.output_router_logits = False


def call_causal_lm(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM on a (left-padded) batch; one pass, no cache."""
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


def call_causal_lm_cached(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> tuple[torch.Tensor, Any]:
    """A transformers causal LM on a batch, with its own cache (``None`` starts one, as generate() does): (logits,
    the cache to pass with the next tokens). The cache argument's name is the installed transformers' (``cache``
    from 5.24, ``past_key_values`` before: the Thinker's CACHE_ARG), and ``cache`` is passed only once there is one,
    so a family class of either era starts its own."""
    given = {CACHE_ARG: cache} if cache is not None else {}
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **given)
    return output.logits, getattr(output, CACHE_ARG)


class StreamedModel:
    """``model`` (parameters on the meta device, buffers real) whose units are read from ``tensors`` as they run.

    - ``layer_classes``: the decoder-layer classes (default: the model's ``_no_split_modules``); ``whole_modules``:
      the names of other modules loaded as one unit, all their tensors at once, though they own none directly (the
      Thinker's hyper-connection mixer, which the layer-by-layer check runs whole).
    - ``load``: how a unit's tensors become its parameters; default ``transformers_loader`` for a
      ``PreTrainedModel``, else name for name.
    - ``compute_dtype``: the dtype units run in; a unit is loaded as the model was built (the checkpoint's dtype,
      as ``from_pretrained`` would hold it) and then widened, one tensor at a time, so the weights are the same
      rounded values in either dtype.
    - ``call``: how a batch is fed (``call_causal_lm``); ``takes_padding``: whether the model takes an attention
      mask at all (reference implementations written without one are fed one unpadded prompt at a time);
      ``cached_call``: how a batch is fed keeping the model's cache (``call_causal_lm_cached`` where ``call`` is the
      default; None for a model fed some other way, which then takes a whole sequence again for each new token).
    - ``hf_quantizer``: the transformers quantizer ``from_pretrained`` would load a quantized checkpoint with (an
      FP8 one, dequantizing: ``fp8_reference_quantizer``); its weight conversions join the model's.
    """

    def __init__(
        self,
        model: nn.Module,
        tensors: Mapping[str, LazyTensor],
        *,
        name: str | None = None,
        layer_classes: Sequence[type] | None = None,
        whole_modules: Sequence[str] = (),
        load: Callable[[StreamedModel, Unit], None] | None = None,
        compute_dtype: torch.dtype | None = None,
        call: Caller = call_causal_lm,
        cached_call: CachedCaller | None = None,
        takes_padding: bool = True,
        close: Callable[[], None] | None = None,
        hf_quantizer: Any = None,
    ) -> None:
        self.model = model.eval()
        without_router_loss(model)
        self.hf_quantizer = hf_quantizer
        self.tensors = tensors
        self.name = name or type(model).__name__
        self.compute_dtype = compute_dtype
        self.call = call
        self.cached_call = cached_call or (call_causal_lm_cached if call is call_causal_lm else None)
        self.takes_padding = takes_padding
        self._close = close
        # Called with each unit once its tensors are in place, before it runs: a caller may put other weights in
        # (export's quantized check puts in the graph's dequantized ones); they are dropped with the unit.
        self.after_load: Callable[[Unit], None] | None = None
        if layer_classes is None:
            layer_classes = decoder_layer_classes(model)
        self.units = find_units(model, tuple(layer_classes), tuple(whole_modules))
        self._load = load or (transformers_loader if _is_pretrained(model) else plain_loader)
        assign_keys(self)

    # --- running ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, ids, mask, positions)

    @torch.no_grad()
    def run_cached(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any = None
    ) -> tuple[torch.Tensor, Any]:
        """(logits, cache) by ``cached_call``, which the model must have."""
        return self.cached_call(self.model, ids, mask, positions, cache)

    @contextmanager
    def streaming(self, observe: Observer | None = None) -> Iterator[StreamedModel]:
        """Within the block, calling the model loads each unit just before it runs and drops it just after."""
        handles = []
        for unit in self.units:

            def before(module, args, kwargs, unit=unit):
                self.load_unit(unit)

            def after(module, args, kwargs, output, unit=unit):
                try:
                    _refuse_meta(unit, output)
                    if observe is not None:
                        observe(unit, args, kwargs, output)
                finally:
                    self.drop_unit(unit)

            handles.append(unit.module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(unit.module.register_forward_hook(after, with_kwargs=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for unit in self.units:
                self.drop_unit(unit)

    def load_unit(self, unit: Unit) -> None:
        if getattr(unit, "_meta", None) is not None:
            return  # already loaded (a module called twice in one forward)
        unit._meta = {name: self.get_tensor(name) for name in [*unit.tensors, *unit.ties, *unit.ties.values()]}
        self._load(self, unit)
        for tied, source in unit.ties.items():
            self.set_tensor(tied, self.get_tensor(source))
        missing = [name for name in [*unit.tensors, *unit.ties] if self.get_tensor(name).is_meta]
        if missing:
            self.drop_unit(unit)
            raise ThinkerError(
                f"{self.name}: no checkpoint tensor loads {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}; the checkpoint does not hold the whole model"
            )
        if self.compute_dtype is not None:
            self._widen([*unit.tensors, *unit.ties, *unit.ties.values()])
        if self.after_load is not None:
            self.after_load(unit)

    def drop_unit(self, unit: Unit) -> None:
        meta = getattr(unit, "_meta", None)
        if meta is None:
            return
        for name, tensor in meta.items():
            self.set_tensor(name, tensor)
        unit._meta = None

    def _widen(self, names: list[str]) -> None:
        """Each loaded floating tensor cast to ``compute_dtype``, one at a time (the old one freed before the next)."""
        done: dict[int, torch.Tensor] = {}
        for name in names:
            tensor = self.get_tensor(name)
            if not tensor.is_floating_point() or tensor.dtype == self.compute_dtype:
                continue
            if id(tensor) not in done:
                widened = tensor.detach().to(self.compute_dtype)
                done[id(tensor)] = nn.Parameter(widened, requires_grad=False) if _is_param(tensor) else widened
            self.set_tensor(name, done[id(tensor)])

    def get_tensor(self, name: str) -> torch.Tensor:
        """The model's parameter or buffer ``name`` as it is now (on the meta device when its unit is not loaded)."""
        return get_tensor(self.model, name)

    def set_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Puts ``tensor`` in as parameter (wrapped, without gradient) or buffer ``name``: for loaders and
        ``after_load``; the unit's drop puts the meta tensor back."""
        set_tensor(self.model, name, tensor)

    # --- facts --------------------------------------------------------------------------------------------------

    @property
    def layers(self) -> list[Unit]:
        return [unit for unit in self.units if unit.is_layer]

    def largest_unit_bytes(self) -> int:
        """The most checkpoint bytes one unit loads at once (ties included)."""
        return max((unit.nbytes(self.tensors) for unit in self.units), default=0)

    def close(self) -> None:
        if self._close is not None:
            self._close()


def get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """``model``'s parameter or buffer ``name``, by its full name."""
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` put in as ``model``'s parameter (wrapped, without gradient) or buffer ``name``, in place of the
    one there, which the caller may keep and put back."""
    module, _, attr = name.rpartition(".")
    owner = model.get_submodule(module)
    if attr in owner._parameters:
        owner._parameters[attr] = tensor if _is_param(tensor) else nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


def decoder_layer_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes of ``model``'s decoder layers: those its ``_no_split_modules`` names (transformers' own
    declaration of what must never be split)."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    return tuple(type(m) for m in model.modules() if type(m).__name__ in no_split)


def _is_param(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter)


def _is_pretrained(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _refuse_meta(unit: Unit, output: Any) -> None:
    first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    if isinstance(first, torch.Tensor) and first.is_meta:
        raise ThinkerError(f"{unit.name or 'the model'} computed with weights that were not loaded (meta tensors)")


# --- units -------------------------------------------------------------------------------------------------------


def find_units(model: nn.Module, layer_classes: tuple[type, ...], whole_modules: tuple[str, ...] = ()) -> list[Unit]:
    """The decoder layers (outermost instances of ``layer_classes``, all their tensors), the ``whole_modules`` (all
    their tensors) and every other module owning parameters directly (its own tensors only), in module order;
    together they own every parameter once."""
    units: list[Unit] = []
    inside_layer: list[str] = []
    persistent = _persistent_buffer_names(model)
    for name, module in model.named_modules():
        if any(name.startswith(layer + ".") for layer in inside_layer):
            continue
        prefix = f"{name}." if name else ""
        is_layer = bool(layer_classes) and isinstance(module, layer_classes)
        if is_layer or name in whole_modules:
            inside_layer.append(name)
            owned = [prefix + n for n, _ in module.named_parameters()]
            owned += [prefix + n for n, _ in module.named_buffers() if prefix + n in persistent]
            units.append(Unit(name, module, owned, is_layer=is_layer))
            continue
        owned = [prefix + n for n, _ in module.named_parameters(recurse=False)]
        owned += [prefix + n for n, _ in module.named_buffers(recurse=False) if prefix + n in persistent]
        if owned:
            units.append(Unit(name, module, owned, is_layer=False))
    return units


def _persistent_buffer_names(model: nn.Module) -> set[str]:
    """Buffers saved with the weights (non-persistent ones, RoPE tables, are computed by the model itself)."""
    parameters = {name for name, _ in model.named_parameters()}  # once: per name it made this quadratic
    return {name for name in model.state_dict(keep_vars=True) if name not in parameters}


def assign_keys(streamed: StreamedModel) -> None:
    """Each unit learns the checkpoint keys its tensors come from, and which of its parameters are tied to another
    unit's (a tied head loads the embedding's tensor)."""
    owner = {name: unit for unit in streamed.units for name in unit.tensors}
    targets = checkpoint_targets(streamed)
    for key, target in targets.items():
        if target in owner:
            owner[target].keys.append(key)
    tied = dict(getattr(streamed.model, "all_tied_weights_keys", None) or {})
    for tied_name, source in tied.items():
        unit = owner.get(tied_name)
        if unit is None or source not in owner or owner[source] is unit:
            continue
        unit.tensors.remove(tied_name)
        unit.ties[tied_name] = source
        unit.keys += [key for key, target in targets.items() if target == source]


def checkpoint_targets(streamed: StreamedModel) -> dict[str, str]:
    """Checkpoint key -> the model tensor it loads; keys that load nothing in this model are left out."""
    if not _is_pretrained(streamed.model):
        names = set(streamed.model.state_dict(keep_vars=True))
        return {key: key for key in streamed.tensors if key in names}
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = streamed.model
    mapping = _conversion_mapping(model, streamed.hf_quantizer)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    meta = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    targets = {}
    for key in streamed.tensors:
        # The same two steps as ``convert_and_load_state_dict_in_model``: every rename, then at most one converter.
        target, _ = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, _ = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if target in meta:
            targets[key] = target
    return targets


def _conversion_mapping(model: nn.Module, hf_quantizer: Any = None) -> list:
    """The weight conversions ``from_pretrained`` applies for this model (no user key mapping), with those of the
    quantizer it would load the checkpoint with, if any."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model, None, hf_quantizer)


def fp8_reference_quantizer(quantization_config: Any) -> Any:
    """The quantizer ``from_pretrained`` loads a fine-grained FP8 checkpoint with on a machine without an FP8 GPU:
    transformers' own, dequantizing each weight to the model's dtype as it is loaded."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=True)
    quantizer.quantization_config.dequantize = True
    return quantizer


# --- loaders -----------------------------------------------------------------------------------------------------


def transformers_loader(streamed: StreamedModel, unit: Unit) -> None:
    """The unit's checkpoint tensors through transformers' own loading function, as ``from_pretrained`` runs it."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as transformers_logging

    model = streamed.model
    dtype = _built_dtype(model)
    config = LoadStateDictConfig(
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=_conversion_mapping(model, streamed.hf_quantizer),
        hf_quantizer=streamed.hf_quantizer,
    )
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per unit otherwise
    try:
        info, _ = convert_and_load_state_dict_in_model(model, {key: streamed.tensors[key] for key in unit.keys}, config)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    problems = [f"{name}: {error.splitlines()[-1]}" for name, error in info.conversion_errors.items()]
    problems += [f"{name}: shape {tuple(got)}, expected {tuple(want)}" for name, got, want in info.mismatched_keys]
    if problems:
        raise ThinkerError(f"{streamed.name}: the checkpoint's tensors do not load: {'; '.join(problems[:3])}")


def _built_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model was built in (its floating parameters'): what ``from_pretrained(dtype=...)`` loads in."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()


def plain_loader(streamed: StreamedModel, unit: Unit) -> None:
    """Name for name, for models that are not transformers classes (a reference implementation's state dict)."""
    for key in unit.keys:
        current = streamed.get_tensor(key)
        tensor = streamed.tensors[key][...].to(current.dtype)
        if tuple(tensor.shape) != tuple(current.shape):
            raise ThinkerError(
                f"{streamed.name}: {key} has shape {tuple(tensor.shape)}, expected {tuple(current.shape)}"
            )
        streamed.set_tensor(key, nn.Parameter(tensor, requires_grad=False) if _is_param(current) else tensor)


# --- building ----------------------------------------------------------------------------------------------------


def empty_model(
    build: Callable[..., nn.Module], config: Any, dtype: torch.dtype, attention: str = "eager", **kwargs: Any
) -> nn.Module:
    """A transformers model of ``config`` in ``dtype`` with its parameters on the meta device (no memory) and its
    buffers (RoPE tables) computed as usual: accelerate's ``init_empty_weights`` around ``build``, a class's
    ``_from_config`` or ``AutoModelForCausalLM.from_config`` (which picks the class as ``from_pretrained`` does),
    with eager attention as the whole-model parity check uses (``attention``: another of transformers' attention
    implementations, for a model compared with itself only)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build(config, dtype=dtype, **(EAGER | {"attn_implementation": attention}), **kwargs).eval()
