"""The GPU bench's harness, run without a GPU: what a repetition times (every shape warmed up before it is timed),
what a runtime that dies part-way keeps (the figures it made), and which nodes the profiler says the CPU ran. The
workers are stand-ins that answer at once; no timing is asserted."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_gpu  # noqa: E402
import profile_genai  # noqa: E402
import workers  # noqa: E402


class StandInWorker:
    """Answers each request at once; dies (as a worker whose kernel refused) on a batch in ``dies_at``."""

    def __init__(self, runtime: workers.Runtime, log: list, dies_at: set[int]) -> None:
        self.runtime, self.log, self.dies_at = runtime, log, dies_at

    def request(self, **request) -> dict:
        self.log.append((self.runtime.label, request))
        if request["batch"] in self.dies_at:
            raise RuntimeError(
                f"{self.runtime.label}: the worker died:\nbatch_size must be 1 (batch {request['batch']})"
            )
        return {"prefill_s": 0.01, "decode_s": 0.1 * request["batch"], "tokens": [1, 2]}


@pytest.fixture
def stand_in_workers(monkeypatch):
    log: list = []
    dies_at: set[int] = set()

    @contextmanager
    def started(runtimes, folders, threads):
        yield [StandInWorker(runtime, log, dies_at) for runtime in runtimes if runtime.graph in folders]

    monkeypatch.setattr(workers, "started", started)
    return log, dies_at


def generate(batch: int, new: int = 64) -> dict:
    return {"op": "generate", "batch": batch, "prompt": 128, "new": new}


def test_each_shape_is_warmed_up_just_before_it_is_first_timed(stand_in_workers):
    log, _ = stand_in_workers
    runtimes = [workers.Runtime("a", "a", "genai"), workers.Runtime("b", "b", "genai")]
    workers.interleave_fresh(runtimes, {"a": Path("a"), "b": Path("b")}, 2, [generate(1), generate(8)], reps=2)
    first_rep = [(label, r["batch"], r["new"], r.get("steps")) for label, r in log[: len(log) // 2]]
    # a warm-up is the timed request itself cut to two steps: the same length sizes the same buffers (the KV
    # capacity onnxruntime-genai allocates, the cuDNN attention plan Hopper builds per capacity)
    assert first_rep == [
        ("a", 1, 64, 2), ("b", 1, 64, 2), ("a", 1, 64, None), ("b", 1, 64, None),  # batch 1: warmed, then timed
        ("a", 8, 64, 2), ("b", 8, 64, 2), ("a", 8, 64, None), ("b", 8, 64, None),  # batch 8 after batch 1's
    ]  # fmt: skip
    assert [label for label, _ in log[len(log) // 2 :]][:2] == ["b", "a"]  # the second repetition loads b first
    assert all(len(replies) == 2 for replies in runtimes[0].results.values())  # the warm-ups are not kept


def test_a_runtime_that_dies_at_batch_8_keeps_its_batch_1_figures(stand_in_workers, monkeypatch):
    _, dies_at = stand_in_workers
    dies_at.add(8)
    graphed = ("--provider", "cuda", "--cuda-graph")
    group = [workers.Runtime("ours (graph)", "ours", "genai", "builder (graph)", graphed)]
    group.append(workers.Runtime("builder (graph)", "builder", "genai", None, graphed))
    plain = [workers.Runtime("ours", "ours", "genai", "builder", ("--provider", "cuda"))]
    args = argparse.Namespace(prompt=128, new=64, batches=[1, 8], threads=2, reps=1)
    folders = {"ours": Path("ours"), "builder": Path("builder")}

    entries = bench_gpu.measure([plain, group], folders, args, lambda entries: None)
    ours_plain, ours_graph, builder_graph = entries
    assert "error" in ours_plain and ours_plain["batch1"] is not None and ours_plain["batch8"] is None
    # CUDA graph groups are asked for batch 1 only (bench_gpu.CUDA_GRAPH_BATCHES), so they do not die here
    assert "error" not in ours_graph and ours_graph["batch1"]["decode_tokens_per_s"] == pytest.approx(630.0)
    assert "batch8" not in builder_graph

    results = {"runtimes": entries, "batches": [1, 8], "prompt": 128}
    row = next(line for line in bench_gpu.speed_table(results).splitlines() if line.startswith("| ours |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "630.0"  # batch 1 decode, kept
    assert cells[4].startswith("failed: batch_size must be 1")  # batch 8, with the kernel's own words


def test_the_first_runs_file_renders_again():
    """``--report`` on bench/results/gpu-run1.json, whose failed rows predate ``builder_peer``, prints every row."""
    results = json.loads((Path(__file__).resolve().parent.parent / "bench/results/gpu-run1.json").read_text())
    assert any("builder_peer" not in runtime for runtime in results["runtimes"])  # what this test is about
    rows = [line for line in bench_gpu.speed_table(results).splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(results["runtimes"])
    assert sum("failed: RuntimeError" in row for row in rows) == 2


def kernel_event(name: str, op: str, provider: str, ts: int) -> dict:
    args = {"op_name": op, "provider": provider}
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": 5, "args": args}


def test_the_profile_names_the_nodes_the_cpu_ran_beside_cuda():
    warm_up = [{"name": "model_run", "ts": -900, "dur": 500}, {"name": "model_run", "ts": -300, "dur": 100}]
    runs = [{"name": "model_run", "ts": 0, "dur": 100}, {"name": "model_run", "ts": 200, "dur": 100}]
    events = (
        warm_up
        + runs
        + [
            kernel_event("/model/warm_up", "Gather", "CPUExecutionProvider", -890),  # the warm-up's: left out
            kernel_event("/model/attn_mask/Cast_1", "Cast", "CPUExecutionProvider", 210),
            kernel_event(
                "/model/layers.0/attn/GroupQueryAttention", "GroupQueryAttention", "CUDAExecutionProvider", 220
            ),
            kernel_event("/model/prompt_only", "Shape", "CPUExecutionProvider", 10),  # the prompt's run: not a step
        ]
    )
    figures = profile_genai.summarize(events, wall=0.001, decode_steps=1)
    assert figures["cpu_nodes"] == {"/model/attn_mask/Cast_1": "Cast"}
    assert figures["prompt_run_ms"] == 0.1 and figures["prompt_by_op_ms"] == {"Shape": 0.005}  # the prompt, apart
    assert figures["nodes_per_step"] == {"CPU": 1.0, "CUDA": 1.0} and figures["decode_steps"] == 1
    cpu_only = [kernel_event("/model/x", "MatMul", "CPUExecutionProvider", 210)]
    assert profile_genai.summarize(runs + cpu_only, wall=0.001, decode_steps=1)["cpu_nodes"] == {}
