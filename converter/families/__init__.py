"""The registry of source families: one module each, pure data interpreted by ``converter.engine``.

Adding a family means writing its module (for a Hugging Face family, one ``common.hf_family(...)`` call) and
listing its ``Family`` here; the engine does not change. Order matters only where two families could claim the
same checkpoint: the first that recognises it wins.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from thinker.configuration_thinker import ThinkerConfig
from thinker_common.errors import ThinkerError, peft_adapter_error

from ..spec import Family
from .common import refuse_missing_decoder_config
from .gguf import GGUF_FAMILIES, UNSUPPORTED_GGUF
from .gpt2 import GPT2
from .llama import LLAMA
from .llms_from_scratch_qwen3 import LLMS_FROM_SCRATCH_QWEN3
from .qwen2 import QWEN2
from .qwen2_5_omni import QWEN2_5_OMNI, QWEN2_5_OMNI_THINKER
from .qwen2_moe import QWEN2_MOE
from .qwen2_vl import QWEN2_VL
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5
from .qwen3_5_moe import QWEN3_5_MOE
from .qwen3_asr import QWEN3_ASR
from .qwen3_moe import QWEN3_MOE
from .qwen3_next import QWEN3_NEXT
from .qwen3_omni import QWEN3_OMNI, QWEN3_OMNI_THINKER
from .qwen3_vl import QWEN3_VL, QWEN3_VL_MOE
from .qwen4_exp import QWEN4_EXP
from .uomni import UOMNI

FAMILIES: tuple[Family, ...] = (
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    QWEN3_OMNI,
    QWEN3_OMNI_THINKER,
    QWEN3_VL,
    QWEN3_VL_MOE,
    QWEN2_VL,
    QWEN2_5_OMNI,
    QWEN2_5_OMNI_THINKER,
    QWEN3_ASR,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    QWEN4_EXP,
    LLAMA,
    GPT2,
    *GGUF_FAMILIES,
    UOMNI,
    LLMS_FROM_SCRATCH_QWEN3,
)


def detect_family(source_config: Mapping[str, Any], tensor_names: Collection[str]) -> Family:
    """The family whose recognition rules match the source config and tensor names."""
    _check_identity_keys(source_config)
    # By the model type first, as transformers picks its class (and the parity check its reference), then by the
    # architectures or config keys: a config whose two disagree (a hand edit) was converted by whichever family came
    # first in FAMILIES, another than the reference's (helper-248)
    for family in FAMILIES:
        if family.named_by_model_type(source_config) and family.tensors_fit(tensor_names):
            return family
    for family in FAMILIES:
        if family.recognises(source_config, tensor_names):
            return family
    key = next((f.model_type_key for f in FAMILIES if f.model_type_key in source_config), "model_type")
    model_type = source_config.get(key)
    if key == "model_type" and model_type == ThinkerConfig.model_type:  # a Thinker's save_pretrained, a Trainer's
        raise ThinkerError(
            "the source is already a Thinker folder (model_type 'thinker'): `thinker export` and `thinker generate` "
            "take it as it is, and `thinker-convert SOURCE OUTPUT --to FAMILY` writes it back as FAMILY's own folder"
        )
    if key == "general.architecture" and model_type in UNSUPPORTED_GGUF:
        raise ThinkerError(UNSUPPORTED_GGUF[model_type])
    # the names of this kind of source: config.json's model_types, or a GGUF's general.architecture values
    supported = sorted({name for family in FAMILIES if family.model_type_key == key for name in family.model_types})
    if any(name.startswith("base_model.model.") for name in tensor_names):  # peft's save_pretrained of an adapter
        raise peft_adapter_error(f"tensor names under base_model.model., {sorted(tensor_names)[0]}")
    if model_type in supported:
        if key == "model_type":  # another release's layout (a thinker_config where a text_config is read) says so
            refuse_missing_decoder_config(source_config, model_type)
        raise ThinkerError(
            f"the source declares {key} {model_type!r}, but its tensor names match no known layout of it "
            f"(first tensors: {', '.join(sorted(tensor_names)[:3])})"
        )
    if key == "general.architecture":  # a GGUF file: its metadata has no class names, and no config keys to match
        raise ThinkerError(f"GGUF {key} {model_type!r} is not supported; supported: {', '.join(supported)}")
    by_keys = [f"{family.name} ({', '.join(family.config_keys)})" for family in FAMILIES if family.config_keys]
    raise ThinkerError(
        f"source {key} {model_type!r} (architectures {source_config.get('architectures')}) is not supported; "
        f"supported: {', '.join(supported)}; or, for a config without model_type, one holding the keys of "
        f"{'; '.join(by_keys)}"
    )


def _check_identity_keys(source_config: Mapping[str, Any]) -> None:
    """The two keys that name a family must be what transformers writes: a string, and a list of class names."""
    model_type = source_config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ThinkerError(f"config.json: 'model_type' must be a string such as \"qwen3\", not {model_type!r}")
    architectures = source_config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        raise ThinkerError(
            f"config.json: 'architectures' must be a list of class names such as [\"Qwen3ForCausalLM\"], "
            f"not {architectures!r}"
        )


def family_by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ThinkerError(f"no source family named {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["FAMILIES", "detect_family", "family_by_name"]
