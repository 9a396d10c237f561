"""Both graphs take their RoPE tables from one builder (``decoder_graph.rope_tables``), which refuses a partial
rotary factor: the Thinker rotates only part of each head then, which neither graph expresses yet (the fused one
used to slice the tables silently)."""

from __future__ import annotations

import pytest
from export_helpers import save_thinker

from common.errors import ThinkerError

PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_partial_rotary_is_refused_by_both_graphs(graph, tmp_path):
    from export.exporter import export_model

    folder = save_thinker(tmp_path / "thinker", "qwen3", head_dim=16, rope_parameters=PARTIAL)
    with pytest.raises(ThinkerError, match=r"RoPE covers 8 of head_dim=16 dimensions \(partial_rotary_factor 0\.5\)"):
        export_model(folder, tmp_path / "onnx", verify=False, graph=graph)
    assert not (tmp_path / "onnx").exists() and [p.name for p in tmp_path.iterdir()] == ["thinker"]
