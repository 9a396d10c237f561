"""A Thinker folder's config.json read as the commands read it: its values by key first, in the words of
``thinker_common/config_values.py``, then built by ``ThinkerConfig`` and checked again; one line naming the file
where it does not build. The exporter and the way back (``--to``) read a Thinker folder through it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thinker import ThinkerConfig
from thinker_common.config_values import check_model_config
from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json


def load_thinker_config(folder: Path, raw: Any = None) -> ThinkerConfig:
    """A Thinker folder's config: config.json's values (``raw`` where the caller has read them) checked by key first,
    before the config computes from them, then built and checked again as built; one line naming the file where
    transformers cannot build it."""
    where = f"{folder}/config.json"
    raw = read_json(Path(folder) / "config.json") if raw is None else raw
    if isinstance(raw, Mapping):
        check_model_config(raw, where)
    try:
        config = ThinkerConfig.from_pretrained(folder)
    except Exception as err:  # transformers' config loading raises many types for a damaged file
        raise ThinkerError(f"{where}: not a readable Thinker config ({' '.join(str(err).split())})") from None
    check_model_config(config.to_dict(), where)
    return config
