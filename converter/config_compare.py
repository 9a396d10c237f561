"""Whether two Thinker configs describe the same model: every field of ``ThinkerConfig`` but the runtime switches.

The way back (``converter/back.py``) checks that a family's config translates forward to the model it came from;
``thinker verify`` checks that a converted folder's config.json is the one its source translates to (an edited
``max_position_embeddings`` or RoPE scaling changes the model where the fixed parity prompts do not reach).
"""

from __future__ import annotations

from thinker import ThinkerConfig

# Runtime switches that do not change the model, left out of the comparison.
RUNTIME_FIELDS = {"use_cache", "output_router_logits"}


def config_differences(expected: ThinkerConfig, actual: ThinkerConfig) -> list[str]:
    """``name (expected -> actual)`` for each model field the two configs disagree on, in the fields' order."""
    first, second = expected.to_dict(), actual.to_dict()
    return [
        f"{name} ({first.get(name)!r} -> {second.get(name)!r})"
        for name in ThinkerConfig.__annotations__
        if name not in RUNTIME_FIELDS and first.get(name) != second.get(name)
    ]
