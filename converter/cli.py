"""``thinker-convert`` and ``thinker verify``: click commands over ``converter.convert``.

``convert_command`` is the ``thinker-convert`` console script and, under the name ``convert``, a command of the
``thinker`` group (``thinker_common/cli.py``), with ``verify_command`` as ``verify``. A ``ThinkerError`` ends either
command with one red line on stderr and exit code 1 (click's usage errors exit with 2); ``--debug`` shows the traceback
instead. The converter itself (torch, transformers) is imported inside the commands, so that ``--help`` and usage
errors answer at once.
"""

from __future__ import annotations

from pathlib import Path

import click

from thinker_common.cli import CONTEXT, console_script, reports_errors
from thinker_common.dtypes import FLOAT_DTYPES
from thinker_common.errors import ThinkerError
from thinker_common.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size

CONVERT_HELP = """Convert SOURCE into a Thinker checkpoint folder at OUTPUT.

\b
SOURCE is one of:
  - a local folder: config.json with *.safetensors (sharded or not)
    or pytorch_model*.bin / *.pt / *.pth weights
  - one weights file: .safetensors, .bin, .pt or .pth (config.json beside
    it), or a llama.cpp .gguf
  - a Hugging Face Hub repo id such as Qwen/Qwen3-0.6B, downloaded into
    the standard cache (only the files a conversion needs); HF_TOKEN,
    HF_ENDPOINT and HF_HUB_OFFLINE are honoured
Float weights, or a fine-grained FP8 release (Qwen/Qwen3-8B-FP8: FP8
weights with a scale per block), dequantized as transformers does.

\b
Supported families:
  qwen2         Qwen2 / Qwen2.5 (qkv bias)
  qwen3         Qwen3 (qk-norm)
  qwen2_moe     Qwen2-MoE (shared expert)
  qwen3_moe     Qwen3-MoE (fused or per-expert tensors)
  qwen3_omni    Qwen3-Omni-MoE thinker text decoder (audio, vision, talker
                and code2wav dropped)
  qwen3_omni_thinker
                Qwen3-Omni-MoE thinker saved alone: its text decoder (audio
                and vision towers dropped)
  qwen3_vl      Qwen3-VL text decoder (vision tower dropped)
  qwen3_vl_moe  Qwen3-VL-MoE text decoder (vision tower dropped; experts
                stored transposed)
  qwen2_vl      Qwen2-VL / Qwen2.5-VL text decoder (vision tower dropped)
  qwen2_5_omni  Qwen2.5-Omni thinker text decoder (audio, vision, talker
                and token2wav dropped)
  qwen2_5_omni_thinker
                Qwen2.5-Omni thinker saved alone: its text decoder (audio and
                vision towers dropped)
  qwen3_asr     Qwen3-ASR text decoder (audio tower dropped)
  qwen3_5       Qwen3.5 / Qwen3.6 dense (hybrid Gated DeltaNet; causal-LM
                or vision-language layout)
  qwen3_5_moe   Qwen3.5 / Qwen3.6 MoE (hybrid Gated DeltaNet, shared expert;
                causal-LM or vision-language layout)
  qwen3_next    Qwen3-Next (hybrid Gated DeltaNet, fused per-key-head
                projections, MoE with shared expert)
  qwen4_exp     Qwen3.8 (hyper-connections, a sparse-attention indexer,
                hashed n-gram embeddings; causal-LM or vision-language
                layout); exported to ONNX for onnxruntime (no
                onnxruntime-genai type carries its state)
  llama         Llama-style (SmolLM, TinyLlama, ...)
  gpt2          GPT-2-style (PrimeGPT: LayerNorm, learned positions, GELU,
                Conv1D)
  gguf-*        llama.cpp GGUF: llama, qwen2, qwen3, qwen2moe, qwen3moe, and
                Qwen3.5 / Qwen3.6's qwen35 and qwen35moe architectures (.gguf)
  uomni         μOmni ThinkerLM (tok_emb / blocks.N / head; fused or split
                qkv; interleaved RoPE)
  llms_from_scratch_qwen3
                LLMs-from-scratch Qwen3 (tok_emb / trf_blocks.N.att.W_query
                ... / out_head; plain .pth)
The last two are training-script formats with no transformers class: a *.pt /
*.pth state dict with its config.json; the test suite proves their parity
(--verify needs a transformers class).

With --to FAMILY the direction reverses: SOURCE is a Thinker folder, written back as FAMILY's own folder.

Before any weight is read, the mapping is checked from the tensor headers: every source tensor must be mapped or
dropped on purpose, every Thinker parameter produced once with the right shape, and the tie setting must match
the tensors (a tied checkpoint may also hold its head, if it equals the embedding: compared, then dropped);
otherwise nothing is written and the error names the tensors. Weights are then streamed one tensor
(or one layer's experts) at a time, so memory stays at the largest tensor, not the model.

Every conversion is verified against the source family's own transformers class before OUTPUT is installed: the
two whole models side by side when both fit in half the available memory (or in THINKER_VERIFY_MEMORY, a size such
as 8GB, when set), otherwise one layer at a time, which needs the memory of one layer whatever the model's size
(--verify-by-layer asks for it); --no-verify skips the check.

OUTPUT receives model.safetensors (or model-0000i-of-0000N.safetensors shards with model.safetensors.index.json),
config.json with the modeling code (loads with AutoModelForCausalLM after `import thinker`, or with
trust_remote_code=True), generation_config.json, the tokenizer files, parity.json when verified, and a model card
(README.md: the base model, the source's license, which its LICENSE file copied beside it, and the parity figures).
It is written
into a hidden folder beside OUTPUT (.OUTPUT.partial-HOST-PID-XXXXXXXX) and renamed into place when complete; such a
folder left by a killed run is removed by the next run into the same OUTPUT, and may be deleted by hand. With
--force, the old OUTPUT is swapped for the new one in one step. Code shipped with a checkpoint (auto_map) is never
run, and .bin / .pt files are read with torch.load(weights_only=True).

\b
Examples:
  thinker-convert Qwen/Qwen3-0.6B ./qwen3-0.6b-thinker
  thinker-convert ./qwen2-folder ./out --dtype bfloat16 --max-shard-size 2GB
  thinker-convert ./SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2 --force
  thinker-convert unsloth/Qwen3.5-0.8B-GGUF ./qwen3.5-0.8b --gguf-file Qwen3.5-0.8B-Q8_0.gguf
  thinker-convert acme/model-parts ./text --subfolder text
  thinker-convert Qwen/Qwen3-30B-A3B ./qwen3-moe --verify-by-layer
  thinker-convert ./qwen3-0.6b-thinker ./qwen3-0.6b-again --to qwen3
"""

VERIFY_HELP = """Compare a converted Thinker folder with its SOURCE, the source family's own transformers class.

Runs fixed prompts (a left-padded batch of 7, 4, 141 and 100 tokens, the long ones cut to fit the context, and
8-token greedy continuations) through both models, prints a table and
writes CONVERTED/parity.json with, per dtype, max and mean |Δlogit|, top-1 agreement and greedy agreement. Fails
(exit 1) when float32 logits (the prompts', and each decode step's while both continuations have taken the same
tokens) differ by more than 1e-4 × max(1, logit scale) or a greedy continuation differs; a float16 or bfloat16
folder is also run in its own dtype, both models alike, and fails beyond 1e-2 (float16) or 2e-2 (bfloat16) × max(1,
logit scale) or below 90 % top-1 agreement. It also fails where a tensor is not, bit for bit, what converting SOURCE
writes, or a bos, eos or pad id is not the one transformers reads from SOURCE (no logit shows them). A failure names
the first layer whose hidden states diverge; a failing
report goes to CONVERTED/parity.failed.json, and a parity.json already there is kept. With --report PATH the report
goes to PATH alone and CONVERTED is only read (a read-only copy, a shared cache). SOURCE is given as to
thinker-convert.

When the two models do not fit in half the available memory (or in THINKER_VERIFY_MEMORY), or with
--verify-by-layer, they run one layer at a time, each read from its own files: every layer of the Thinker runs on
the reference's input to that layer, parity.json records each layer's max and mean |Δ| against the dtype's
tolerance (1e-4 in float32) × max(1, the reference layer's largest output), and a failure names the first layer
beyond it. The top-1 token at every prompt position stands in for the greedy continuations there, and 2 decode
steps run after the prompts (both models fed the reference's greedy token, each step reading both models once
more), their logits held to the same tolerance: a cache or a recurrent state carried wrong fails either way.

\b
Examples:
  thinker verify Qwen/Qwen3-0.6B ./qwen3-0.6b-thinker
  thinker verify Qwen/Qwen3-30B-A3B ./qwen3-moe --verify-by-layer
  thinker verify Qwen/Qwen3-0.6B /mnt/models/qwen3-0.6b-thinker --report qwen3-parity.json
"""


def _shard_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_size(value)
    except ThinkerError as err:
        raise click.BadParameter(str(err)) from None
    return value


revision_option = click.option(
    "--revision", metavar="REV", help="Hub branch, tag or commit of a repo-id SOURCE (default: main)."
)
subfolder_option = click.option(
    "--subfolder",
    metavar="PATH",
    help="The checkpoint's folder inside SOURCE (a Hub repo or a local folder), as transformers' "
    "from_pretrained(..., subfolder=PATH): of a Hub repo only that folder's files are downloaded, with the repo's "
    "card and license from its top.",
)
gguf_file_option = click.option(
    "--gguf-file",
    metavar="NAME",
    help="The GGUF file of SOURCE (a Hub repo or a folder holding several, one per quantisation) to read, by name "
    "or by its path inside SOURCE (Q4_K_M/model-Q4_K_M.gguf), converted or verified against: of a Hub repo only "
    "that file is downloaded, with the generation config, model card and license files beside it (transformers' "
    "from_pretrained(..., gguf_file=NAME) reads the generation config too).",
)


@click.command("thinker-convert", help=CONVERT_HELP, context_settings=CONTEXT)
@click.version_option(package_name="thinker", message="%(prog)s %(version)s")
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@revision_option
@subfolder_option
@gguf_file_option
@click.option(
    "--dtype",
    type=click.Choice(["auto", *FLOAT_DTYPES]),
    default="auto",
    show_default=True,
    help="Output dtype. auto rounds no tensor: config.json keeps the dtype the source config declares where it is "
    "float32, bfloat16 or float16 (else, a float64 config or none, the one of those three holding most of the "
    "source tensors' bytes, float32 if none; GGUF dequantizes to float32), and a tensor the source stores in a dtype "
    "that one cannot hold as it is stays as stored (Qwen3.5's float32 A_log and norms beside bfloat16 weights; "
    "float16 beside bfloat16; every tensor, where a config says bfloat16 of float32 weights). A dtype named casts "
    "every tensor; float16 refuses tensors whose values exceed ±65504, naming them.",
)
@click.option(
    "--max-shard-size",
    default=DEFAULT_MAX_SHARD_SIZE,
    show_default=True,
    callback=_shard_size,
    help="Largest safetensors shard, e.g. 500MB, 2GiB or a byte count; bigger outputs are split with an index.",
)
@click.option(
    "--verify/--no-verify",
    default=None,
    help="Check parity against the source family's transformers class and write parity.json (see `thinker "
    "verify`); on by default: the whole models when both fit in half the available memory (8 bytes per parameter "
    "in float32, and the prompts' logits and hidden states: 1 GB at a 152k vocabulary), layer by layer otherwise. "
    "A failed check writes nothing and exits 1.",
)
@click.option(
    "--verify-by-layer",
    is_flag=True,
    help="Verify one layer at a time whatever the model's size: the memory of one layer, not of two models.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing OUTPUT, only once the new one is complete, and only an earlier output of "
    "thinker (known by its model card): never another model's folder, which may be a source.",
)
@click.option(
    "--to",
    "to_family",
    metavar="FAMILY",
    help="The way back: SOURCE is a Thinker folder, written out as FAMILY's own Hugging Face folder (qwen2, qwen3, "
    "qwen2_moe, qwen3_moe, qwen3_5, qwen3_5_moe, qwen3_next, qwen4_exp, llama) through the family's table read "
    "backwards; a "
    "round trip is bit-exact. "
    "--verify (default on) compares it, loaded with its transformers class, with the Thinker.",
)
@reports_errors
def convert_command(
    source: str,
    output: Path,
    revision: str | None,
    subfolder: str | None,
    gguf_file: str | None,
    dtype: str,
    max_shard_size: str,
    verify: bool | None,
    verify_by_layer: bool,
    force: bool,
    to_family: str | None,
) -> None:
    from .convert import convert

    if to_family is not None:
        from .back import convert_back

        given = {
            "--revision picks a Hub revision": revision,
            "--subfolder picks a folder": subfolder,
            "--gguf-file picks a GGUF file": gguf_file,
        }
        if named := next((words for words, value in given.items() if value is not None), None):
            raise ThinkerError(f"{named} of SOURCE; --to takes a local Thinker folder, with none of these")
        result = convert_back(
            source,
            output,
            to_family,
            dtype=dtype,
            max_shard_size=max_shard_size,
            verify=verify,
            verify_by_layer=verify_by_layer,
            force=force,
        )
    else:
        result = convert(
            source,
            output,
            revision=revision,
            subfolder=subfolder,
            gguf_file=gguf_file,
            dtype=dtype,
            max_shard_size=max_shard_size,
            verify=verify,
            verify_by_layer=verify_by_layer,
            force=force,
        )
    if result.parity is not None:
        click.echo(result.parity.table())
        if result.parity.mode_note:
            click.secho(result.parity.mode_note, fg="yellow", err=True)
    for note in result.notes:
        click.secho(note, fg="yellow", err=True)
    click.echo(f"converted {source} ({result.family}) -> {result.output}: {result.weights()}, {result.seconds:.1f} s")


def named_file(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """An option's file path (a click callback); an empty one is refused, where Path("") would be the working
    directory."""
    if value is not None and not value.strip():
        raise click.BadParameter("an empty path; name a new JSON file")
    return None if value is None else Path(value)


@click.command("verify", help=VERIFY_HELP, context_settings=CONTEXT)
@click.argument("source")
@click.argument("converted", type=click.Path(path_type=Path, exists=True, file_okay=False))
@revision_option
@subfolder_option
@gguf_file_option
@click.option("--verify-by-layer", is_flag=True, help="Run the two models one layer at a time whatever their size.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    callback=named_file,
    help="Write the report (passing or failing) to this new JSON file and nothing into CONVERTED: for a read-only "
    "folder or a shared cache.",
)
@reports_errors
def verify_command(
    source: str,
    converted: Path,
    revision: str | None,
    subfolder: str | None,
    gguf_file: str | None,
    verify_by_layer: bool,
    report_path: Path | None,
) -> None:
    from .convert import verify

    report = verify(
        source,
        converted,
        revision=revision,
        subfolder=subfolder,
        gguf_file=gguf_file,
        by_layer=verify_by_layer,
        report_path=report_path,
    )
    if report.mode_note:
        click.secho(report.mode_note, fg="yellow", err=True)
    click.echo(report.table())
    click.echo(f"parity holds; wrote {report_path or converted / 'parity.json'}")


thinker_convert = console_script(convert_command)  # the `thinker-convert` console script (pyproject.toml)

__all__ = ["convert_command", "thinker_convert", "verify_command"]


if __name__ == "__main__":  # python -m converter.cli SOURCE OUTPUT, as thinker-convert (it did nothing and exited 0)
    thinker_convert()
