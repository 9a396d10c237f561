"""What ``--inputs-embeds`` costs a caller: ``model.embeds.onnx`` (the token lookup in its own session,
``embed.onnx``, run before every step) against ``model.onnx`` of the same export, under ``OnnxDecoder`` on the CPU.

One ``--inputs-embeds`` export of the real SmolLM2-135M (bench/exports.py's ``ours-fused-embeds``, made here if
missing; its ``model.onnx`` is the default fused export's) is loaded twice in one process: as ``model.onnx``, fed
token ids, and as ``model.embeds.onnx``, fed the same ids (looked up through ``embed.onnx``, as a decode step is) or
the prompt's embeddings themselves. The three take turns (rounds of a prefill and ``--steps`` decode steps each,
the order rotated every round), batch 1, and their logits are compared (bit for bit is expected: the same nodes).

    python bench/bench_inputs_embeds.py                # ~4 minutes
    python bench/bench_inputs_embeds.py --report       # the table again, from the results file

Writes bench/results/inputs_embeds.json and bench/results/README-inputs-embeds.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from results_io import command_line, writable_folder, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402

RESULTS = Path(__file__).with_name("results")
FORMS = ("model.onnx, ids", "model.embeds.onnx, ids", "model.embeds.onnx, embeddings")


def run(decoder, prompt: np.ndarray, embeds: np.ndarray | None, steps: int) -> tuple[float, list[float], np.ndarray]:
    """(prefill seconds, each decode step's seconds, the last logits) for one greedy run of ``steps`` steps."""
    mask = np.ones_like(prompt)
    started = time.perf_counter()
    if embeds is None:
        logits, state = decoder.prefill(prompt, mask, new_tokens=steps)
    else:
        logits, state = decoder.prefill(None, mask, new_tokens=steps, inputs_embeds=embeds)
    prefill = time.perf_counter() - started
    token, times = logits[:, -1].argmax(-1), []
    for _ in range(steps):
        started = time.perf_counter()
        logits = decoder.decode_one_token(token, state)
        times.append(time.perf_counter() - started)
        token = logits.argmax(-1)
    return prefill, times, logits


def measure(folder: Path, prompt_length: int, steps: int, rounds: int, threads: int) -> dict:
    from export.names import EMBEDS_MODEL_FILE
    from export.runtime import OnnxDecoder

    ids_decoder = OnnxDecoder(folder, provider="cpu", threads=threads)
    embeds_decoder = OnnxDecoder(folder / EMBEDS_MODEL_FILE, provider="cpu", threads=threads)
    prompt = np.random.default_rng(0).integers(0, ids_decoder.vocab_size, (1, prompt_length), dtype=np.int64)
    embeds = embeds_decoder.embed(prompt)
    runs = {
        FORMS[0]: lambda: run(ids_decoder, prompt, None, steps),
        FORMS[1]: lambda: run(embeds_decoder, prompt, None, steps),
        FORMS[2]: lambda: run(embeds_decoder, prompt, embeds, steps),
    }
    for form in FORMS:  # warm-up: the first runs of a session allocate its arenas
        runs[form]()
    prefill = {form: [] for form in FORMS}
    decode = {form: [] for form in FORMS}
    last = {}
    for round_ in range(rounds):
        shift = round_ % len(FORMS)  # each form leads as often as the others: the first run of a round is quicker
        for form in FORMS[shift:] + FORMS[:shift]:
            seconds, step_times, last[form] = runs[form]()
            prefill[form].append(seconds)
            decode[form].append(statistics.median(step_times))
    reference = last[FORMS[0]]
    return {
        "prompt_tokens": prompt_length,
        "prefill_s": prefill,
        "decode_step_s": decode,
        "max_abs_diff_from_model_onnx": {form: float(np.abs(last[form] - reference).max()) for form in FORMS},
        "decode_ratio": {form: report.ratio_interval(decode[form], decode[FORMS[0]]) for form in FORMS[1:]},
        "prefill_ratio": {form: report.ratio_interval(prefill[form], prefill[FORMS[0]]) for form in FORMS[1:]},
    }


def markdown(results: dict) -> str:
    figures = results["smollm2-135m"]
    rows = []
    for form in FORMS:
        prefill = 1e3 * statistics.median(figures["prefill_s"][form])
        decode = 1e3 * statistics.median(figures["decode_step_s"][form])
        ratios = [figures[kind].get(form) for kind in ("prefill_ratio", "decode_ratio")]
        cells = [report.ratio_cell(tuple(r)) if r else "1 (the reference)" for r in ratios]
        diff = figures["max_abs_diff_from_model_onnx"][form]
        rows.append([form, f"{prefill:.1f}", cells[0], f"{decode:.2f}", cells[1], f"{diff:.3g}"])
    header = [
        "graph, fed",
        "prefill (ms)",
        "time / model.onnx's",
        "decode step (ms)",
        "time / model.onnx's",
        "max |Δlogit|",
    ]
    return (
        f"Command: `{results['command']}`; SmolLM2-135M (real weights), fused float32 export with --inputs-embeds, "
        f"a {figures['prompt_tokens']}-token prompt then {results['steps']} decode steps, batch 1, "
        f"{results['threads']} threads, {results['rounds']} rounds with the order rotated each; medians, ratios "
        "with their 90 % bootstrap interval (bench/report.py); max |Δlogit|: the last step's logits against "
        "model.onnx's.\n\n" + report.table(header, rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="print the table of the results file and stop")
    parser.add_argument("--out", type=writable_folder, default=RESULTS)
    args = parser.parse_args()
    out_json = args.out / "inputs_embeds.json"
    if args.report:
        print(markdown(json.loads(out_json.read_text())))
        return
    model = models.smollm2()
    export = exp.run_export("ours-fused-embeds", model, args.threads, fresh=False)
    if export.error:
        raise SystemExit(f"the export failed: {export.error}")
    results = {
        "command": command_line(),
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "smollm2-135m": measure(export.folder, args.prompt, args.steps, args.rounds, args.threads),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(out_json, json.dumps(results, indent=2) + "\n")
    write_result((args.out / "README-inputs-embeds.md"), markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
