"""Thinker: a transformers-native decoder for Qwen-style checkpoints.

``import thinker`` registers the classes with transformers' Auto* factories, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works on a converted folder, and marks them for auto class so
that every ``save_pretrained`` writes ``auto_map`` and the modeling source (the folder then also loads with
``trust_remote_code=True`` where this package is not installed).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_thinker import ThinkerConfig
from .modeling_thinker import ThinkerForCausalLM, ThinkerModel, ThinkerPreTrainedModel

AutoConfig.register(ThinkerConfig.model_type, ThinkerConfig, exist_ok=True)
AutoModel.register(ThinkerConfig, ThinkerModel, exist_ok=True)
AutoModelForCausalLM.register(ThinkerConfig, ThinkerForCausalLM, exist_ok=True)

ThinkerConfig.register_for_auto_class()
ThinkerModel.register_for_auto_class("AutoModel")
ThinkerForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["ThinkerConfig", "ThinkerModel", "ThinkerForCausalLM", "ThinkerPreTrainedModel"]
