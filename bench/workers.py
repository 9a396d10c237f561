"""Runtimes kept loaded side by side: one ``decode_worker.py`` process each, driven over JSON lines.

The orchestrator starts a group of workers at once and interleaves their repetitions (worker 1, worker 2, ...,
worker 1, ...), so that the load other jobs put on the shared cores lands on every runtime alike and the ratios
between them hold even when the absolute figures drift; ``interleave_fresh`` starts the group anew for every
repetition, so that the repetitions also sample what a process happens to get.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from peer_envs import python_of

WORKER = Path(__file__).with_name("decode_worker.py")


@dataclass
class Runtime:
    """One row of the tables: a graph (or HF folder) run by a backend."""

    label: str  # e.g. "ours-fused on onnxruntime"
    graph: str  # export name (exports.py) or "hf"
    backend: str  # ort | genai | torch
    builder_peer: str | None = None  # label of the builder runtime it is compared with
    worker_options: tuple[str, ...] = ()  # more decode_worker.py options: ("--provider", "cuda"), ...
    results: dict = field(default_factory=dict)  # request key -> list of replies


class Worker:
    def __init__(self, runtime: Runtime, folder: Path, threads: int) -> None:
        self.runtime = runtime
        python = python_of("genai") if runtime.backend == "genai" else Path(sys.executable)
        command = [str(python), str(WORKER), runtime.backend, str(folder), "--threads", str(threads)]
        command += runtime.worker_options
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._read()  # {"ready": true}, once the model is loaded

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.runtime.label}: the worker died:\n{self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def request(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


@contextmanager
def started(runtimes: list[Runtime], folders: dict[str, Path], threads: int):
    """Workers for ``runtimes`` (those whose graph exists), closed on exit."""
    workers = []
    try:
        for runtime in runtimes:
            if runtime.graph in folders:
                print(f"  loading {runtime.label}", file=sys.stderr, flush=True)
                workers.append(Worker(runtime, folders[runtime.graph], threads))
        yield workers
    finally:
        for worker in workers:
            worker.process.kill()


def interleave_fresh(
    runtimes: list[Runtime], folders: dict[str, Path], threads: int, requests: list[dict], reps: int
) -> None:
    """Runs every request ``reps`` times on every runtime, round-robin; replies are collected in
    ``runtime.results[key]`` (key: the request as text). Every repetition starts the group's workers afresh (loaded
    in turn, the order reversed every other repetition) and closes them after: one process holds a runtime for one
    repetition only. What a process happens to get (where its weights land in memory, which core its threads run on)
    moves a runtime's figures by 5-15 % on this machine and stays with it for the process's life, so repetitions
    inside one process all carry the same draw; fresh ones sample it. Before its first timed request of a shape, each
    worker runs that request once untimed, two of its tokens only: on CUDA the first run of a shape loads kernels and
    sizes buffers, which a timed prefill must not carry. The warm-up asks for the request's own length, not a shorter
    one: onnxruntime-genai sizes the KV cache by it, and on Hopper GroupQueryAttention runs the prompt through cuDNN
    with a plan built per KV capacity (about a second), which a two-token request's capacity did not warm (the
    second GPU session's genai prefill figures carried it)."""
    for rep in range(reps):
        order = runtimes if rep % 2 == 0 else runtimes[::-1]
        with started(order, folders, threads) as workers:
            warm: set[str] = set()
            for request in requests:
                key = json.dumps(request, sort_keys=True)
                if request["op"] == "generate" and key not in warm:
                    warm.add(key)
                    for worker in workers:
                        worker.request(**request, steps=2)
                for worker in workers:
                    print(f"  rep {rep + 1}/{reps} {request} {worker.runtime.label}", file=sys.stderr, flush=True)
                    reply = worker.request(**request)
                    worker.runtime.results.setdefault(json.dumps(request, sort_keys=True), []).append(reply)


def runtime_entry(runtime: Runtime, requests: list[dict]) -> dict:
    """A runtime's row of the results: what it is, and ``summary`` of each request under ``batch<B>``."""
    entry = {"label": runtime.label, "graph": runtime.graph, "backend": runtime.backend}
    entry["builder_peer"] = runtime.builder_peer
    for request in requests:
        entry[f"batch{request['batch']}"] = summary(runtime, request)
    return entry


def summary(runtime: Runtime, request: dict) -> dict | None:
    """Medians over the repetitions of a ``generate`` request: prefill seconds, decode tokens/s per sequence and
    for the whole batch, row 0's greedy tokens."""
    replies = runtime.results.get(json.dumps(request, sort_keys=True))
    if not replies:
        return None
    steps = request["new"] - 1
    per_repetition = [
        {
            "prefill_ms": 1e3 * r["prefill_s"],
            "decode_tokens_per_s": steps / r["decode_s"],
            "batch_tokens_per_s": steps / r["decode_s"] * request["batch"],
        }
        for r in replies
    ]
    return {
        **{key: statistics.median(r[key] for r in per_repetition) for key in per_repetition[0]},
        "tokens": replies[0].get("tokens", []),
        "repetitions": len(replies),
        "per_repetition": per_repetition,  # in order: repetition i of every runtime of a group ran side by side
    }
