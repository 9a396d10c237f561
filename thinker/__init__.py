# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""Thinker: a transformers-native decoder for Qwen-style checkpoints.

``import thinker`` registers the classes with transformers' Auto* factories, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works on a converted folder, and marks them for auto class so
that every ``save_pretrained`` writes ``auto_map`` and the modeling source (the folder then also loads with
``trust_remote_code=True`` where this package is not installed). ``ThinkerForCausalLM.from_pretrained`` also
accepts a checkpoint of any supported source family once the converter has registered its loader
(``import converter.load``), and converts it on load (see ``thinker/foreign.py``).

This package imports nothing outside itself (torch and transformers aside); the converter and the exporter import it.
"""

import transformers

from . import modeling_thinker
from .configuration_thinker import ThinkerConfig
from .foreign import accept_foreign_checkpoints
from .modeling_thinker import (
    AUTO_CLASSES,
    ThinkerForCausalLM,
    ThinkerForQuestionAnswering,
    ThinkerForSequenceClassification,
    ThinkerForTokenClassification,
    ThinkerModel,
    ThinkerPreTrainedModel,
)

transformers.AutoConfig.register(ThinkerConfig.model_type, ThinkerConfig, exist_ok=True)
ThinkerConfig.register_for_auto_class()
# The model and its heads, registered as Qwen3's are: with the Auto classes here, and in the auto_map of a saved folder
# (every one of them, whichever is saved: ThinkerPreTrainedModel.save_pretrained).
for _auto_class, _name in AUTO_CLASSES.items():
    _model = getattr(modeling_thinker, _name)
    getattr(transformers, _auto_class).register(ThinkerConfig, _model, exist_ok=True)
    _model.register_for_auto_class(_auto_class)

# from_pretrained dispatches foreign checkpoints to the loader the converter registers (the task heads refuse them).
# It is attached here rather than written in modeling_thinker.py so that the copy shipped beside checkpoints as
# remote code stays the model alone.
accept_foreign_checkpoints(ThinkerForCausalLM, lambda model: model)
accept_foreign_checkpoints(ThinkerModel, lambda model: model.model)
for _head in (ThinkerForSequenceClassification, ThinkerForTokenClassification, ThinkerForQuestionAnswering):
    accept_foreign_checkpoints(_head, None)

__all__ = [
    "ThinkerConfig",
    "ThinkerModel",
    "ThinkerForCausalLM",
    "ThinkerForSequenceClassification",
    "ThinkerForTokenClassification",
    "ThinkerForQuestionAnswering",
    "ThinkerPreTrainedModel",
]
