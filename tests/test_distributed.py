"""Tensor parallelism: two CPU ranks (torchrun, gloo) running a saved Thinker with its own ``tp_plan`` give the
single-process logits. The rank script is ``tests/tp_worker.py``."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

import thinker  # noqa: F401

TESTS = Path(__file__).resolve().parent
# Parameters split across ranks: attention heads, MLP and expert columns / rows (the config's plan, column-parallel
# biases included), the vocabulary of the head (the model's plan) and of the embedding (which transformers adds).
# Norms, the biases of row-parallel layers and the router stay whole.
SHARDED = re.compile(
    r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$|\.(o_proj|down_proj)\.weight$|\.experts\.\w+_proj$"
    r"|^model\.embed_tokens\.weight$|^lm_head\.weight$"
)


@pytest.fixture(scope="module")
def tp_results(tiny_thinker_dirs, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("tp-out")
    folders = [str(tiny_thinker_dirs[kind]) for kind in ("dense", "moe")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # two ranks on a small machine
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, str(TESTS / "tp_worker.py"), str(out), *folders],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


@pytest.mark.parametrize("run", ["dense-eager", "moe-eager", "moe-grouped_mm"])
def test_tensor_parallel_logits_equal_single_process(tp_results, tiny_thinker_dirs, run):
    result = tp_results[run]
    assert result["tp_size"] == 2
    kind, experts_implementation = run.split("-")
    model = AutoModelForCausalLM.from_pretrained(tiny_thinker_dirs[kind], experts_implementation=experts_implementation)
    with torch.no_grad():
        expected = model(result["input_ids"]).logits
    assert_close(result["logits"], expected, atol=1e-5, rtol=1e-5)

    # ... and the model really was split: each rank holds half of every planned weight, all of the others.
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert result["local_shapes"].keys() == full_shapes.keys()
    sharded = [name for name in full_shapes if SHARDED.search(name)]
    assert any(".experts." in name for name in sharded) == (kind == "moe")
    for name, full in full_shapes.items():
        local = math.prod(result["local_shapes"][name])
        assert local == (math.prod(full) // 2 if name in sharded else math.prod(full)), name
