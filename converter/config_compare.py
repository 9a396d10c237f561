"""Whether two Thinker configs describe the same model: every field of ``ThinkerConfig`` but the runtime switches.

The way back (``converter/back.py``) checks that a family's config translates forward to the model it came from;
``thinker verify`` checks that a converted folder's config.json is the one its source translates to (an edited
``max_position_embeddings`` or RoPE scaling changes the model where the fixed parity prompts do not reach).
"""

from __future__ import annotations

from thinker import ThinkerConfig

# Runtime switches that do not change the model, left out of the comparison.
RUNTIME_FIELDS = {"use_cache", "output_router_logits"}
# config.json keys that record how and where a config was written rather than the model, left out of a saved
# config's comparison; its dtype has a check of its own (converter/convert.py ``refuse_other_dtype``).
WRITING_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def config_differences(expected: ThinkerConfig, actual: ThinkerConfig) -> list[str]:
    """``name (expected -> actual)`` for each model field the two configs disagree on, in the fields' order."""
    first, second = expected.to_dict(), actual.to_dict()
    return [
        f"{name} ({first.get(name)!r} -> {second.get(name)!r})"
        for name in ThinkerConfig.__annotations__
        if name not in RUNTIME_FIELDS and first.get(name) != second.get(name)
    ]


def saved_config_differences(expected: ThinkerConfig, actual: ThinkerConfig) -> list[str]:
    """``config_differences``, then the keys of a saved config.json beyond ThinkerConfig's fields: ``architectures``
    and ``auto_map`` (the classes transformers' Auto API builds from the folder) and any key written in by hand, but
    not ``WRITING_KEYS``. ``expected`` as a conversion writes and reads it back (its ``auto_map`` filled in)."""
    first, second = expected.to_dict(), actual.to_dict()
    compared = set(ThinkerConfig.__annotations__) | RUNTIME_FIELDS | WRITING_KEYS
    others = [name for name in dict.fromkeys([*first, *second]) if name not in compared]
    return config_differences(expected, actual) + [
        f"{name} ({first.get(name)!r} -> {second.get(name)!r})"
        for name in others
        if first.get(name) != second.get(name)
    ]
