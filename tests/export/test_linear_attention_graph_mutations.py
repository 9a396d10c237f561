"""Gated DeltaNet graph details that the layer tests of test_linear_attention_graph.py do not reach with their
seeded weights (mutation run of export/linear_attention_graph.py): there the q and k heads have squared norms of
0.4 to 28, so where the l2 norm's epsilon sits (inside the root, 1e-6, as transformers' ``l2norm``) changes nothing
above the tolerance. With the conv weights scaled down the squared norms are 6e-7 to 1e-5, the epsilon's own size."""

from __future__ import annotations

import pytest
import torch
from test_linear_attention_graph import (
    FORMS,
    RELATIVE_TOLERANCE,
    export_gated_deltanet,
    gated_deltanet,
    linear_config,
    run_left_padded_batch,
)

CONV_SCALE = 1e-3  # q and k heads' squared norms 6e-7 .. 1e-5 (seed 0): the epsilon is not negligible there


@pytest.mark.parametrize("form", list(FORMS))
def test_small_query_and_key_norms_keep_the_epsilon_inside_the_root(form, tmp_path):
    """x / sqrt(sum(x²) + 1e-6) per head, as transformers' l2norm: an epsilon added after the root, a larger one, or
    the fused form's SimplifiedLayerNormalization epsilon not divided by dk would move q and k by tens of percent."""
    config = linear_config()
    module = gated_deltanet(config)
    with torch.no_grad():
        module.conv1d.weight.mul_(CONV_SCALE)
    session = export_gated_deltanet(module, config, FORMS[form], tmp_path)
    errors = run_left_padded_batch(session, module, config, (9, 6))
    assert max(errors.values()) <= RELATIVE_TOLERANCE, errors
