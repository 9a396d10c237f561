# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""Thinker: a transformers-native decoder for Qwen-style checkpoints.

``import thinker`` registers the classes with transformers' Auto* factories, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works on a converted folder, and marks them for auto class so
that every ``save_pretrained`` writes ``auto_map`` and the modeling source (the folder then also loads with
``trust_remote_code=True`` where this package is not installed). ``ThinkerForCausalLM.from_pretrained`` also
accepts a checkpoint of any supported source family and converts it on load (see ``thinker/foreign.py``).
"""

import transformers
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

# The task heads, registered as Qwen3's are: with the Auto classes here, and in the auto_map of a saved folder.
from .modeling_thinker import (  # noqa: E402
    ThinkerForQuestionAnswering,
    ThinkerForSequenceClassification,
    ThinkerForTokenClassification,
)

for _auto_class, _head in (
    ("AutoModelForSequenceClassification", ThinkerForSequenceClassification),
    ("AutoModelForTokenClassification", ThinkerForTokenClassification),
    ("AutoModelForQuestionAnswering", ThinkerForQuestionAnswering),
):
    getattr(transformers, _auto_class).register(ThinkerConfig, _head, exist_ok=True)
    _head.register_for_auto_class(_auto_class)

# ThinkerForCausalLM.from_pretrained("Qwen/Qwen3-0.6B") converts on load, through the converter's family tables.
accept_foreign_checkpoints(ThinkerForCausalLM)

__all__ = ["ThinkerConfig", "ThinkerModel", "ThinkerForCausalLM", "ThinkerPreTrainedModel"]
