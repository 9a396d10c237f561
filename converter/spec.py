"""The data a source family is made of: how to recognise it, how its config translates, and its tensor table.

A family module (``converter/families/*.py``) builds one ``Family`` from these types and nothing else; the engine
(``converter/engine.py``) is the only code that interprets them. Tensor names are templates: ``{layer}``
(``LAYER_INDEX``) stands for a decoder layer index, ``{expert}`` (``EXPERT_INDEX``) for an expert index and ``{part}``
(``PART_INDEX``) for the index of a piece a checkpoint stores one tensor in. A rule whose templates hold ``{layer}``
applies to every layer; a template holding ``{expert}`` or ``{part}`` stands for the list of that name for every
index, in order, as many as the Thinker config's field in ``LIST_INDICES`` says (so
``mlp.experts.{expert}.gate_proj.weight`` on the source side of a rule gathers all experts of the layer).

Which rules apply is decided by the target: the engine builds the Thinker model from the translated config on the
meta device and keeps the rules whose targets it has (a q_proj bias rule is inert for a model without biases, an
expert rule for a dense layer). Several rules may produce the same targets: they are alternatives (per-expert or
fused expert layouts on disk), and the first whose source tensors are all present wins.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ops import Identity, Op

LAYER_INDEX = "{layer}"
EXPERT_INDEX = "{expert}"
PART_INDEX = "{part}"
# Each list index, and the ThinkerConfig field that counts it.
LIST_INDICES = {EXPERT_INDEX: "num_experts", PART_INDEX: "split_ngram_parts"}

ConfigTranslator = Callable[[Mapping[str, Any]], dict[str, Any]]
# (the config a source carries, its tensor names) -> a Hugging Face config dict: for formats that are not Hugging
# Face's (a GGUF file's metadata), some of whose settings are recorded only by which tensors are present.
HFConfigReader = Callable[[Mapping[str, Any], Collection[str]], dict[str, Any]]
# (source folder, dtype) -> the reference model for parity, called like a transformers causal LM.
ReferenceLoader = Callable[[Path, Any], Any]
# (source folder, dtype) -> the same reference as a ``converter.streamed.StreamedModel``: built on the meta device,
# its weights read one layer at a time, for parity layer by layer.
LayeredReferenceLoader = Callable[[Path, Any], Any]
# Thinker config -> the source family's config.json dict: the way back (``thinker-convert THINKER OUT --to FAMILY``).
ConfigExporter = Callable[[Any], dict[str, Any]]
# (Thinker config, the source) -> None, or ThinkerError naming a stored tensor the table drops that disagrees with it.
SourceCheck = Callable[[Any, Any], None]
# Thinker config -> {source name: tensor}: tensors the family's class saves that the Thinker derives from its config.
DerivedTensors = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class TensorRule:
    """Source tensors -> Thinker tensors through one declared operation.

    ``sources`` and ``targets`` are name templates; the operation receives the source tensors in template order
    (each ``{expert}`` template expanded in place) and returns the targets in template order.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: Op = field(default_factory=Identity)

    def inverted(self) -> TensorRule:
        """The same rule read backwards: Thinker tensors -> source tensors."""
        return TensorRule(self.targets, self.sources, self.op.inverse())


def rule(sources: str | Sequence[str], targets: str | Sequence[str], op: Op | None = None) -> TensorRule:
    """A table entry; single names may be given as plain strings."""
    return TensorRule(_names(sources), _names(targets), op or Identity())


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def renames(pairs: Mapping[str, str]) -> tuple[TensorRule, ...]:
    """Plain one-to-one renames, the bulk of every table."""
    return tuple(rule(source, target) for source, target in pairs.items())


@dataclass(frozen=True)
class Family:
    """One source family: recognition, config translation, tensor table, deliberate drops.

    - ``model_types`` / ``architectures``: the source config's ``model_type`` (the key ``model_type_key``:
      ``general.architecture`` in GGUF metadata) or any of its ``architectures`` selects the family;
      ``tensor_hints``, when given, must also match (at least one of these exact tensor names is present), which
      tells apart layouts that share a config.
    - ``config_keys``: for checkpoints of training scripts, whose config has no ``model_type``: a config without
      one that holds all of these keys selects the family (``tensor_hints`` must still match).
    - ``translate_config``: source config dict -> ``ThinkerConfig`` keyword arguments; refuses (``ThinkerError``)
      what Thinker cannot represent rather than converting to a different model. ``to_hf_config``, for a format
      whose config is not Hugging Face's (GGUF metadata), first turns it into a Hugging Face config dict.
    - ``layer_count_keys`` / ``expert_count_keys``: how the source config spells its layer and expert counts (at
      any nesting depth), checked against the checkpoint's size before anything is built from them.
    - ``config_label``: what error messages call the source's config (``config.json``; ``GGUF metadata``).
    - ``tensors``: the table; ``dropped``: source tensors skipped on purpose (templates, like the table), e.g.
      buffers older checkpoints saved; ``dropped_prefixes``: whole sub-models skipped on purpose by name prefix
      (a multimodal checkpoint's vision tower), whose layer counts the Thinker config does not know;
      ``dropped_extra_layers``: the layer prefix (``blk.{layer}.``) under which a source stores blocks past the
      decoder's ``num_hidden_layers`` that the model does not run (llama.cpp's multi-token-prediction block).
    - ``head``: the source name of the output projection, checked against ``tie_word_embeddings``;
      ``other_heads``: its names in the family's other layouts (``head_in`` picks the one present); ``tie_key``:
      where the source config sets the tie transformers follows (an omni model's ``thinker_config``'s), for messages.
    - ``reference``: loads the parity reference from the source folder; None means transformers'
      ``AutoModelForCausalLM``. ``layered_reference``: the same reference for parity layer by layer, built on the
      meta device with its weights read one layer at a time (``converter.streamed``); None means the class
      ``AutoModelForCausalLM`` picks, its tensors through transformers' own loading conversions. Its masks,
      position embeddings and any per-layer state (linear attention's) come from the model's own forward, so a
      family needs its own only where its reference is not that class, or its weights are not the folder's
      tensors (a sub-model, a GGUF file). ``no_reference``: set, instead, for a family that has no transformers
      class; it says why, and verification is then skipped (or refused when asked for) with that message.
    - ``export_config``: the inverse of ``translate_config``, for families a Thinker folder can be written back to
      (``--to``); the tensors go back through ``inverted_tensors``.
    - ``check_source``: for dropped tensors the Thinker derives from its config instead (Qwen4-Exp's hash buffers):
      refuses, naming it, a stored one the translated config does not imply (the reference would run it).
      ``derived_back``: the same tensors for the way back, by the names the way back writes them under, so that the
      written folder holds every tensor the family's class saves (else transformers' load report calls them missing).
    """

    name: str
    description: str
    model_types: tuple[str, ...]
    translate_config: ConfigTranslator
    tensors: tuple[TensorRule, ...]
    architectures: tuple[str, ...] = ()
    tensor_hints: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    head: str | None = "lm_head.weight"
    other_heads: tuple[str, ...] = ()
    tie_key: str = "tie_word_embeddings"
    config_keys: tuple[str, ...] = ()
    dropped_prefixes: tuple[str, ...] = ()
    dropped_extra_layers: str | None = None
    reference: ReferenceLoader | None = None
    layered_reference: LayeredReferenceLoader | None = None
    no_reference: str | None = None
    export_config: ConfigExporter | None = None
    model_type_key: str = "model_type"
    to_hf_config: HFConfigReader | None = None
    layer_count_keys: tuple[str, ...] = ("num_hidden_layers",)
    expert_count_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    config_label: str = "config.json"
    check_source: SourceCheck | None = None
    derived_back: DerivedTensors | None = None

    def recognises(self, config: Mapping[str, Any], tensor_names: Collection[str]) -> bool:
        declared = self.named_by_model_type(config) or any(
            architecture in self.architectures for architecture in config.get("architectures") or ()
        )
        if not declared and self.config_keys and not config.get(self.model_type_key):
            declared = all(key in config for key in self.config_keys)
        return declared and self.tensors_fit(tensor_names)

    def named_by_model_type(self, config: Mapping[str, Any]) -> bool:
        """Whether the config's model type (``model_type_key``) is one of this family's: what transformers picks a
        class by, over ``architectures``."""
        return config.get(self.model_type_key) in self.model_types

    def tensors_fit(self, tensor_names: Collection[str]) -> bool:
        return not self.tensor_hints or any(hint in tensor_names for hint in self.tensor_hints)

    def head_in(self, tensor_names: Collection[str]) -> str | None:
        """The head's name in the layout ``tensor_names`` are in (``head`` where none of them is present)."""
        return next((name for name in (self.head, *self.other_heads) if name in tensor_names), self.head)

    def hf_config(self, config: Mapping[str, Any], tensor_names: Collection[str]) -> Mapping[str, Any]:
        """The source config as ``translate_config`` reads it."""
        return config if self.to_hf_config is None else self.to_hf_config(config, tensor_names)

    def inverted_tensors(self) -> tuple[TensorRule, ...]:
        """The table read backwards (Thinker -> source), for writing a Thinker folder out in this family's layout."""
        return tuple(entry.inverted() for entry in self.tensors)
