"""Thinker: a transformers-native decoder for Qwen-style checkpoints.

``import thinker`` registers the classes with transformers' Auto* factories, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works on a converted folder, and marks them for auto class so
that every ``save_pretrained`` writes ``auto_map`` and the modeling source (the folder then also loads with
``trust_remote_code=True`` where this package is not installed). ``ThinkerForCausalLM.from_pretrained`` also
accepts a checkpoint of any supported source family once the converter has registered its loader
(``import converter.load``), and converts it on load (see ``thinker/foreign.py``).

This package imports nothing outside itself (torch and transformers aside); the converter and the exporter import it.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_thinker import ThinkerConfig
from .foreign import accept_foreign_checkpoints
from .modeling_thinker import ThinkerForCausalLM, ThinkerModel, ThinkerPreTrainedModel

AutoConfig.register(ThinkerConfig.model_type, ThinkerConfig, exist_ok=True)
AutoModel.register(ThinkerConfig, ThinkerModel, exist_ok=True)
AutoModelForCausalLM.register(ThinkerConfig, ThinkerForCausalLM, exist_ok=True)

ThinkerConfig.register_for_auto_class()
ThinkerModel.register_for_auto_class("AutoModel")
ThinkerForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# ThinkerForCausalLM.from_pretrained dispatches foreign checkpoints to the loader the converter registers. It is
# attached here rather than written in modeling_thinker.py so that the copy shipped beside checkpoints as remote
# code stays the model alone.
accept_foreign_checkpoints(ThinkerForCausalLM)

__all__ = ["ThinkerConfig", "ThinkerModel", "ThinkerForCausalLM", "ThinkerPreTrainedModel"]
