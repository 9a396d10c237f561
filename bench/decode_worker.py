"""One runtime with one model loaded, timing requests read as JSON lines on stdin (a reply per line on stdout).

Started by bench_fast.py, in our environment (backends ``ort`` and ``torch``) or in the onnxruntime-genai one
(``genai``), so that several runtimes stay loaded side by side and the orchestrator can interleave their
repetitions. It imports nothing from this repository: it must run in the peers' environments too.

Requests:
  {"op": "generate", "batch": B, "prompt": P, "new": N}   greedy, every row the same length (no padding):
      prefill_s (the prompt's forward), decode_s (the N - 1 single-token forwards after it), tokens (row 0's new ids);
      with "steps": S, only the first S of the N tokens, every buffer sized for N (a warm-up of the timed request)
  {"op": "decode_at", "context": L, "steps": K}           batch 1: K single-token forwards after a context of L
      tokens; decode_s only (ort feeds a random cache of length L instead of running the prefill)

Backends:
  ort     any ONNX decoder with the Optimum / onnxruntime-genai IO names (ours, the builder's, Optimum's): feeds the
          inputs the graph declares (position_ids only where it has one) and feeds presents back as pasts
  genai   og.Model + og.Generator, greedy, with the session's intra-op threads set through a config overlay
  torch   a transformers model (its own class, attn_implementation="eager"); timed inside ``generate`` by a
          logits processor that stamps each step
  thinker our folders through ``export.runtime.OnnxDecoder`` (the one backend that imports this repository): on
          CUDA it keeps the cache on the device by IO binding, as ``thinker generate`` does
  ort-states  any decoder folder with a genai_config.json whose carried state is named past*.{i}.* -> present.{i}.*
          (ours, onnxruntime-genai's builder's and mobius-onnx's hybrid graphs: KV, conv and recurrent states),
          fed what it declares: input_ids, or inputs_embeds from the folder's own embedding model (mobius's
          vision-language package), position_ids of rank 2 or 3; zeros start the states; presents fed back

``--provider cuda`` (bench_gpu.py) runs genai on its CUDA provider (``--cuda-graph``: with CUDA graph capture), torch
on the GPU in float16 with a synchronize before each stamp, and thinker on onnxruntime's CUDA provider; every timer
stops only after the device has finished (a host copy of what the step produced).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

VOCAB_CAP = 49152  # prompts draw ids below this, so every model (and a borrowed tokenizer) knows them


def tokens_to_run(new: int, steps: int | None) -> int:
    """How many of a request's ``new`` tokens to generate: all, or a warm-up's first ``steps``."""
    return new if steps is None else min(steps, new)


def prompt_ids(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB_CAP, size=(batch, length), dtype=np.int64)


class OrtBackend:
    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past = [n for n in inputs if n.startswith("past_key_values.")]
        self.present = [n.replace("past_key_values.", "present.") for n in self.past]
        first = inputs[self.past[0]]
        self.kv_heads, self.head_dim = first.shape[1], first.shape[3]
        if not isinstance(self.head_dim, int):  # the builder's graphs leave it symbolic; its config has it
            self.head_dim = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
        self.cache_dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[first.type]
        self.has_positions = "position_ids" in inputs

    def forward(self, ids: np.ndarray, mask: np.ndarray, cache: dict) -> tuple[np.ndarray, dict]:
        feeds = {"input_ids": ids, "attention_mask": mask, **cache}
        if self.has_positions:
            start = mask.shape[1] - ids.shape[1]
            feeds["position_ids"] = np.broadcast_to(np.arange(start, mask.shape[1]), ids.shape).astype(np.int64)
        outputs = self.session.run(["logits", *self.present], feeds)
        return outputs[0][:, -1], dict(zip(self.past, outputs[1:], strict=True))

    def prefill_logits(self, ids: np.ndarray) -> np.ndarray:
        """(T, V) logits of one row of token ids through an empty cache (for fidelity figures)."""
        ids = ids[None].astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), **self.cache(1, 0)}
        if self.has_positions:
            feeds["position_ids"] = np.arange(ids.shape[1])[None]
        return self.session.run(["logits"], feeds)[0][0]

    def cache(self, batch: int, length: int, rng=None) -> dict:
        """An empty cache, or (``rng``) a random one of ``length`` slots standing in for a prefilled context."""
        shape = (batch, self.kv_heads, length, self.head_dim)
        if rng is None:
            return {name: np.zeros(shape, self.cache_dtype) for name in self.past}
        return {name: (0.5 * rng.standard_normal(shape)).astype(self.cache_dtype) for name in self.past}

    def generate(self, batch: int, prompt: int, new: int, steps: int | None = None) -> dict:
        new = tokens_to_run(new, steps)  # the cache grows by concatenation: nothing sized ahead
        ids = prompt_ids(batch, prompt)
        mask = np.ones_like(ids)
        started = time.perf_counter()
        logits, cache = self.forward(ids, mask, self.cache(batch, 0))
        prefilled = time.perf_counter()
        tokens = [logits.argmax(-1)]
        for _ in range(new - 1):
            mask = np.ones((batch, mask.shape[1] + 1), np.int64)
            logits, cache = self.forward(tokens[-1][:, None].astype(np.int64), mask, cache)
            tokens.append(logits.argmax(-1))
        done = time.perf_counter()
        return {"prefill_s": prefilled - started, "decode_s": done - prefilled, "tokens": [int(t[0]) for t in tokens]}

    def decode_at(self, context: int, steps: int) -> dict:
        cache = self.cache(1, context, np.random.default_rng(0))
        token = np.array([[1]], np.int64)
        started = time.perf_counter()
        for step in range(steps):
            logits, cache = self.forward(token, np.ones((1, context + step + 1), np.int64), cache)
            token = logits.argmax(-1)[:, None].astype(np.int64)
        return {"decode_s": time.perf_counter() - started}


class GenaiBackend:
    def __init__(self, folder: Path, threads: int, provider: str = "cpu", cuda_graph: bool = False) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.cuda = provider == "cuda"
        config = og.Config(str(folder))
        config.clear_providers()  # CPU, unless:
        if self.cuda:
            config.append_provider("cuda")
            if cuda_graph:
                config.set_provider_option("cuda", "enable_cuda_graph", "1")
        overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)

    def run(self, ids: np.ndarray, new: int, steps: int | None = None) -> tuple[float, float, list[int]]:
        """Greedy generation of ``new`` tokens, or its first ``steps`` (a warm-up: onnxruntime-genai sizes its KV
        buffers by ``max_length``, and on Hopper GroupQueryAttention's prompt runs cuDNN attention with a plan built
        per KV capacity, so only a warm-up with the timed run's ``max_length`` warms what the timed run uses)."""
        params = self.og.GeneratorParams(self.model)
        length = ids.shape[1] + new
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=ids.shape[0])
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(ids)  # runs the prompt's forward
        if self.cuda:
            generator.get_logits()  # a host copy: the prompt's kernels have finished
        prefilled = time.perf_counter()
        for _ in range(tokens_to_run(new, steps)):  # the first picks from the prompt's logits
            generator.generate_next_token()
        sequence = generator.get_sequence(0)  # a host copy (on CUDA: the last step has finished)
        done = time.perf_counter()
        return prefilled - started, done - prefilled, [int(t) for t in sequence[ids.shape[1] :]]

    def generate(self, batch: int, prompt: int, new: int, steps: int | None = None) -> dict:
        prefill, decode, tokens = self.run(prompt_ids(batch, prompt), new, steps)
        return {"prefill_s": prefill, "decode_s": decode, "tokens": tokens}

    def decode_at(self, context: int, steps: int) -> dict:
        _, decode, _ = self.run(prompt_ids(1, context), steps + 1)
        return {"decode_s": decode}


class TorchBackend:
    def __init__(self, folder: Path, threads: int, provider: str = "cpu", cuda_graph: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM, LogitsProcessor

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = "cuda" if provider == "cuda" else "cpu"
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        self.model.to(self.device).eval()
        synchronize = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)

        class Clock(LogitsProcessor):
            """Stamps the time each generation step's logits arrive (after that step's forward)."""

            def __init__(self) -> None:
                self.stamps: list[float] = []

            def __call__(self, input_ids, scores):
                synchronize()
                self.stamps.append(time.perf_counter())
                return scores

        self.clock_class = Clock

    def run(self, ids: np.ndarray, new: int) -> tuple[float, float, list[int]]:
        clock = self.clock_class()
        with self.torch.no_grad():
            started = time.perf_counter()
            out = self.model.generate(
                self.torch.from_numpy(ids).to(self.device),
                attention_mask=self.torch.ones(ids.shape, dtype=self.torch.long, device=self.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[clock],
            )
        return clock.stamps[0] - started, clock.stamps[-1] - clock.stamps[0], out[0, ids.shape[1] :].tolist()

    def generate(self, batch: int, prompt: int, new: int, steps: int | None = None) -> dict:
        # nothing here is sized by the request's length: a warm-up's shorter run warms the same kernels
        prefill, decode, tokens = self.run(prompt_ids(batch, prompt), tokens_to_run(new, steps))
        return {"prefill_s": prefill, "decode_s": decode, "tokens": tokens}

    def decode_at(self, context: int, steps: int) -> dict:
        _, decode, _ = self.run(prompt_ids(1, context), steps + 1)
        return {"decode_s": decode}


class StatesOrtBackend(OrtBackend):
    """Hybrid decoders of any exporter (see the module docstring); batch 1 and unpadded rows, as ``generate`` asks."""

    CONTROL = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")
    TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        genai = json.loads((folder / "genai_config.json").read_text())["model"]
        decoder = genai["decoder"]

        def session(name: str):
            return ort.InferenceSession(str(folder / name), options, providers=["CPUExecutionProvider"])

        self.session = session(decoder["filename"])
        # mobius's vision-language package: its decoder takes inputs_embeds from a separate embedding model
        self.embedding = session(genai["embedding"]["filename"]) if "embedding" in genai else None
        self.hidden_size = decoder["hidden_size"]
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name for o in self.session.get_outputs()}
        self.past, self.present, self.shapes, self.dtypes = [], [], {}, {}
        for name, info in inputs.items():
            if name in self.CONTROL:
                continue
            present = [
                p
                for p in (name.replace("past_key_values.", "present.", 1), name.replace("past.", "present.", 1))
                if p in outputs
            ]
            if len(present) != 1:
                raise ValueError(f"{folder}: no present output for {name}")
            self.past.append(name)
            self.present.append(present[0])
            if name.endswith((".key", ".value")):  # the builder leaves head_size symbolic: its config has it
                self.shapes[name] = [decoder["num_key_value_heads"], 0, decoder["head_size"]]
            else:
                self.shapes[name] = list(info.shape[1:])
            self.dtypes[name] = self.TYPES[info.type]
        self.position_rank = len(inputs["position_ids"].shape)

    def cache(self, batch: int, length: int, rng=None) -> dict:
        if length or rng is not None:
            raise ValueError("ort-states starts every sequence from zeros (generate requests only)")
        return {name: np.zeros([batch, *self.shapes[name]], self.dtypes[name]) for name in self.past}

    def forward(self, ids: np.ndarray, mask: np.ndarray, cache: dict) -> tuple[np.ndarray, dict]:
        start = mask.shape[1] - ids.shape[1]
        positions = np.broadcast_to(np.arange(start, mask.shape[1]), ids.shape).astype(np.int64)
        if self.position_rank == 3:
            positions = np.ascontiguousarray(np.broadcast_to(positions, (3, *ids.shape)))
        feeds = {"attention_mask": mask, "position_ids": positions, **cache}
        if self.embedding is not None:
            no_image = np.zeros((0, self.hidden_size), np.float32)
            feeds["inputs_embeds"] = self.embedding.run(None, {"input_ids": ids, "image_features": no_image})[0]
        else:
            feeds["input_ids"] = ids
        outputs = self.session.run(["logits", *self.present], feeds)
        return outputs[0][:, -1], dict(zip(self.past, outputs[1:], strict=True))


class ThinkerBackend:
    """Our own runtime, ``export.runtime.OnnxDecoder``: prefill, then one ``decode_one_token`` per new token (its
    logits come back to the host every step, as ``generate`` needs them), over the graph ``thinker generate`` runs
    for prompts without padding (``generation_graph``: ``model.genai.onnx`` on CUDA), or ``model.onnx`` with
    ``any_padding``."""

    def __init__(
        self,
        folder: Path,
        threads: int,
        provider: str = "cpu",
        cuda_graph: bool = False,
        share_kv: bool | None = None,
        any_padding: bool = False,
    ) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from export.names import MODEL_FILE
        from export.runtime import OnnxDecoder, generation_graph

        graph = folder / MODEL_FILE if any_padding else generation_graph(folder, provider, share_kv)
        self.decoder = OnnxDecoder(graph, provider=provider, threads=threads, share_kv=share_kv)

    def generate(self, batch: int, prompt: int, new: int, steps: int | None = None) -> dict:
        ids = prompt_ids(batch, prompt)
        started = time.perf_counter()
        logits, state = self.decoder.prefill(ids, np.ones_like(ids), new_tokens=new)  # as generate sizes its cache
        prefilled = time.perf_counter()
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(tokens_to_run(new, steps) - 1):
            tokens.append(self.decoder.decode_one_token(tokens[-1], state).argmax(-1))
        done = time.perf_counter()
        return {"prefill_s": prefilled - started, "decode_s": done - prefilled, "tokens": [int(t[0]) for t in tokens]}


BACKENDS = {
    "ort": OrtBackend,
    "genai": GenaiBackend,
    "torch": TorchBackend,
    "ort-states": StatesOrtBackend,
    "thinker": ThinkerBackend,
}
CUDA_BACKENDS = ("genai", "torch", "thinker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=list(BACKENDS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cuda-graph", action="store_true", help="genai on CUDA: capture the decode step as a graph")
    parser.add_argument("--copy-kv", action="store_true", help="thinker: OnnxDecoder(share_kv=False)")
    parser.add_argument("--any-padding", action="store_true", help="thinker: model.onnx, whatever the provider")
    args = parser.parse_args()
    if args.copy_kv or args.any_padding:
        if args.backend != "thinker":
            parser.error(f"--copy-kv / --any-padding: OnnxDecoder's options (backend thinker), not {args.backend}'s")
        share_kv = False if args.copy_kv else None
        backend = ThinkerBackend(
            args.folder, args.threads, args.provider, share_kv=share_kv, any_padding=args.any_padding
        )
    elif args.provider == "cpu" and not args.cuda_graph:
        backend = BACKENDS[args.backend](args.folder, args.threads)
    elif args.backend in CUDA_BACKENDS:
        backend = BACKENDS[args.backend](args.folder, args.threads, args.provider, args.cuda_graph)
    else:
        parser.error(f"--provider cuda / --cuda-graph: backend {args.backend} runs on the CPU only")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        print(json.dumps(getattr(backend, op)(**request)), flush=True)


if __name__ == "__main__":
    main()
