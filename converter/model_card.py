"""The Thinker folder's model card: where the weights came from, how to load them, and the parity check's figures.

``thinker_common/model_card.py`` writes it; this module says what a conversion (and the way back) puts in it.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from thinker_common.model_card import (
    card_metadata,
    copy_license,
    hub_repo_of,
    hub_snapshot,
    in_hub_snapshot,
    markdown_table,
    replace_checks,
    source_card,
    weights_of,
    write_card,
)
from thinker_common.parity_inputs import GATE_TOLERANCE

from .parity_report import GREEDY_TOKENS, HALF_TOP1_MIN, LAYER_DECODE_STEPS, PARITY_FILE, ParityReport

if TYPE_CHECKING:
    from .engine import LeftOut


def tool_version() -> str:
    try:
        return version("thinker")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(source tree)"


def source_top(source: str, resolved: Path) -> Path | None:
    """The folder SOURCE names, of which ``resolved`` (the checkpoint's folder or GGUF file) is a part or the whole:
    the Hub snapshot, or the local folder."""
    local = Path(source).expanduser()
    return hub_snapshot(resolved) or (local if local.is_dir() else None)


def source_line(source: str, resolved: Path) -> tuple[str, str | None]:
    """(how the card names the source, its Hub repo id or None). ``resolved`` is what SOURCE led to: where it is a
    part of the folder or repo SOURCE names (``--subfolder``, ``--gguf-file``), the card names that part too."""
    resolved = Path(resolved)
    top = source_top(source, resolved)
    inside = Path(os.path.relpath(resolved, top)).as_posix() if top is not None else "."
    part = "" if inside in (".", "") or inside.startswith("..") else f", the {_kind(resolved)} `{inside}`"
    repo = hub_repo_of(source, resolved)
    if repo is None:
        return f"`{Path(source).name or source}`{part} (a local checkpoint)", None
    commit, _ = in_hub_snapshot(resolved)
    at = f" at commit `{commit}`" if commit else ""
    return f"[`{repo}`](https://huggingface.co/{repo}){at}{part}", repo


def _kind(path: Path) -> str:
    return "file" if path.is_file() else "folder"


def parity_section(
    report: ParityReport | None,
    skipped: str,
    against: str = "the source family's own transformers class",
    advice: str = "`thinker verify SOURCE FOLDER` checks it and writes the figures here",
) -> str:
    """The checks section: what was checked ``against`` and what passing took, the parity figures per dtype (and
    the worst stage, layer by layer), or why there are none and how to check (``advice``)."""
    if report is None:
        return f"## Parity\n\nNot checked: {skipped}. {advice}."
    rows = []
    for result in report.results:
        greedy = "—" if result.greedy_identical is None else f"{result.greedy_identical}/{result.greedy_prompts}"
        rows.append(
            [
                result.dtype,
                f"{result.max_abs_diff:.3g}",
                f"{result.mean_abs_diff:.3g}",
                f"{result.tolerance:.2g}",
                f"{result.top1_agreement:.1%}",
                greedy,
                "pass" if result.passed else f"FAIL ({result.first_divergence})",
            ]
        )
    header = ["dtype", "max \\|Δlogit\\|", "mean \\|Δlogit\\|", "tolerance", "top-1", "greedy", "result"]
    lines = ["## Parity", "", parity_criteria(report, against), "", markdown_table(header, rows)]
    if report.rounding_note:
        lines += ["", report.rounding_note]
    return "\n".join(lines)


def parity_criteria(report: ParityReport, against: str) -> str:
    """What the check ran and what passing took, for the dtypes ``report`` holds: the gate's own rules
    (converter/parity.py, converter/layer_parity.py)."""
    whole = report.mode == "whole-model"
    if whole:
        ran = (
            "the two models side by side, on fixed prompts (a left-padded batch, short and long, and greedy "
            "continuations)"
        )
        exact = f"every greedy continuation ({GREEDY_TOKENS} tokens) identical"
    else:  # no continuation: each generated token would read both models again
        ran = (
            "one layer at a time, on fixed prompts (a left-padded batch, short and long; no greedy continuations, "
            "layer by layer, but "
            f"{LAYER_DECODE_STEPS} decode steps, both models fed the reference's greedy token)"
        )
        exact = "the top-1 token identical at every position"
    rules = []
    for dtype in dict.fromkeys(result.dtype for result in report.results):
        bound = f"max |Δlogit| ≤ {GATE_TOLERANCE[getattr(torch, dtype)]:g} × max(1, the logit scale)"
        bound += " (the prompts' and each decode step's alike)"
        needs = exact if dtype == "float32" else f"top-1 agreement ≥ {HALF_TOP1_MIN:.0%}"
        rules.append(f"in {dtype}, {bound} and {needs}")
    stages = "" if whole else ", and each stage within the same factor × max(1, the reference's output of it)"
    return (
        f"Checked against {against}, {ran}. Passing takes, {'; '.join(rules)}{stages}. The figures in full"
        f"{'' if whole else ', per stage,'} are in `{PARITY_FILE}`."
    )


def export_line(folder: str, beyond_genai: list[str] | None) -> str:
    if beyond_genai:
        return (
            f"`thinker export {folder} ONNX_FOLDER` writes it as an ONNX decoder for onnxruntime (`thinker generate`, "
            f"`export.runtime.OnnxDecoder`); onnxruntime-genai has no model type for the state of its "
            f"{', '.join(beyond_genai)}, so no genai_config.json is written."
        )
    return f"`thinker export {folder} ONNX_FOLDER` writes it as an ONNX decoder for onnxruntime and onnxruntime-genai."


def left_out_parts(left: list[LeftOut], quote: str = "") -> str:
    """``model.visual.* (12 tensors), mtp.* (3 tensors)``: what ``engine.left_out`` found, as a note lists it
    (``quote="`"``: as the card does)."""
    return ", ".join(f"{quote}{part.prefix}*{quote} ({part.count} tensor{'s' * (part.count > 1)})" for part in left)


def left_out_section(left: list[LeftOut], deepstack: bool = False) -> str:
    """The card's word on the source's parts a conversion leaves out (``engine.left_out``), and how a prompt that
    needs a tower reaches the decoder without it (``deepstack``: with the vision tower's DeepStack features, which
    the decoder adds into its first layers: without them an image prompt's logits differ); empty where nothing was
    left out."""
    if not left:
        return ""
    parts = left_out_parts(left, quote="`")
    text = f"## Left out\n\nThis folder is the source's text decoder; these parts of the source are not in it: {parts}."
    if not all(part.mtp for part in left):
        text += (
            " For a prompt with audio, images or video, run the towers with the source's own transformers class and "
            "pass the embeddings they give, at the placeholder tokens, as `inputs_embeds` (with the `position_ids` "
            "its processor computes where the model has multimodal RoPE)"
            + (
                ", and an image or video's DeepStack features as the source model hands them to its text decoder, "
                "`visual_pos_masks=` and `deepstack_visual_embeds=`"
                if deepstack
                else ""
            )
            + "; `thinker export --inputs-embeds` writes the ONNX graph that takes them."
        )
    if blocks := [f"`{part.prefix}*`" for part in left if part.mtp]:
        text += (
            f" {', '.join(blocks)} {'is' if len(blocks) == 1 else 'are'} the multi-token-prediction block, for "
            "speculative decoding, which the source's own causal-LM class does not run either."
        )
    return text + "\n"


# What a GGUF file's metadata says of its license and languages, as the card's fields.
GGUF_CARD_FIELDS = {"general.license": "license", "general.languages": "language"}


def gguf_card_metadata(metadata: dict) -> dict:
    """The card fields a GGUF file's metadata (``GGUFSource.metadata``) records: a GGUF usually travels without the
    model card that said them."""
    return {field: metadata[key] for key, field in GGUF_CARD_FIELDS.items() if metadata.get(key)}


def write_thinker_card(
    folder: Path,
    source: str,
    root: Path,
    family: str,
    dtype: str,
    report: ParityReport | None,
    skipped: str = "converted with --no-verify",
    name: str | None = None,
    beyond_genai: list[str] | None = None,
    recorded: dict | None = None,
    left: list[LeftOut] | None = None,
    deepstack: bool = False,
    tokenizer: bool = True,
    top: Path | None = None,
) -> list[str]:
    """README.md (and the source's license files) in the Thinker folder ``folder`` (to be installed as ``name``);
    the names written. ``beyond_genai``: what the model has whose state onnxruntime-genai cannot carry;
    ``recorded``: card fields the weights file itself records (``gguf_card_metadata``), which the source folder's
    own card overrides; ``left``: the source's parts left out (``engine.left_out``); ``tokenizer``: whether the
    folder has the source's tokenizer (a weights-only checkpoint has none, and the card then shows no use of one);
    ``top``: the folder whose card and license cover the source (default: the folder SOURCE names)."""
    root = Path(root)
    named, repo = source_line(source, root)  # with the folder or file of the repo the weights are (a part of it)
    top = top or source_top(source, root)
    root = root.parent if root.is_file() else root  # a GGUF file: its folder holds the card and license
    card, license_folder = source_card(root, top)
    carried = {**(recorded or {}), **card}
    metadata = {
        **{key: value for key, value in carried.items() if key != "base_model"},
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "base_model": repo,
        "tags": ["thinker", family],
    }
    here = name or Path(folder).name
    title = repo.split("/")[-1] if repo else here
    if tokenizer:
        side_files = "The tokenizer and generation config are the source's."
        tokenizer_import, tokenizer_line = ", AutoTokenizer", f'\ntokenizer = AutoTokenizer.from_pretrained("{here}")'
        calls = "both calls (the tokenizer reads the same config, and asks otherwise)"
    else:
        side_files = (
            "The generation config is the source's; the source carries no tokenizer, so neither does this folder: "
            "the model takes token ids, and text once the model's tokenizer files are copied in."
        )
        tokenizer_import = tokenizer_line = ""
        calls = "the call"
    body = f"""# {title} (Thinker)

The weights of {named}, family `{family}`, converted by `thinker-convert` {tool_version()} into a Thinker folder
({dtype}): one transformers `PreTrainedModel` for every Qwen-style architecture, with its modeling code beside the
weights. {side_files}

## Use

```python
import thinker  # registers the Thinker classes with transformers' Auto classes
from transformers import AutoModelForCausalLM{tokenizer_import}

model = AutoModelForCausalLM.from_pretrained("{here}", dtype="auto"){tokenizer_line}
```

Without Thinker installed, the folder's own modeling code runs: drop the import and pass `trust_remote_code=True` to
{calls}.

{export_line(here, beyond_genai)}
""" + (f"\n{section}" if (section := left_out_section(left or [], deepstack)) else "")
    write_card(folder, metadata, body, parity_section(report, skipped))
    return ["README.md", *copy_license(license_folder, folder)]


def write_way_back_card(
    folder: Path, thinker_folder: Path, family: str, architecture: str, report: ParityReport | None, name: str
) -> list[str]:
    """README.md (and the license files) of a folder the way back wrote from ``thinker_folder``: the Thinker card's
    license and base model carried on, the parity figures against the Thinker."""
    carried = card_metadata(thinker_folder)
    metadata = {**carried, "library_name": "transformers", "pipeline_tag": "text-generation", "tags": [family]}
    origin = weights_of(carried)
    body = f"""# {name}

Written back from the Thinker folder `{Path(thinker_folder).name}`{origin} by `thinker-convert --to {family}`
{tool_version()}, in the layout of transformers' `{architecture}`: it loads with transformers alone.

```python
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{name}", dtype="auto")
```
"""
    write_card(
        folder,
        metadata,
        body,
        parity_section(
            report,
            "written back with --no-verify",
            against=f"the Thinker it was written from, this folder loaded as transformers' `{architecture}`",
            advice=f"`thinker convert {Path(thinker_folder).name} OUTPUT --to {family}` without --no-verify checks "
            "what it writes",
        ),
    )
    return ["README.md", *copy_license(thinker_folder, folder)]


def update_parity(folder: Path, report: ParityReport) -> bool:
    """``thinker verify``'s passing figures into the card's parity section, where the card is this tool's."""
    return replace_checks(folder, parity_section(report, ""))
