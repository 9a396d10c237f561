"""The ONNX folder's model card: what the graph is, how to run it, and what its verify measured.

``thinker_common/model_card.py`` writes it; the Thinker folder's card gives the license, languages and base model it
carries.
"""

from __future__ import annotations

from pathlib import Path

from thinker_common.model_card import copy_license, markdown_table, source_card, weights_of, write_card
from thinker_common.side_files import has_vocabulary, read_json, tokenizer_files

from .names import EMBEDS_MODEL_FILE, GENAI_CONFIG_FILE


def verify_section(report: dict) -> str:
    """The checks section from ``export_report.json``'s ``verify``: the float graph against PyTorch, or the
    quantized graph's three checks; or that there were none (``--no-verify``)."""
    figures = report.get("verify")
    lines = ["## Verify", ""]
    if not figures:
        return "\n".join([*lines, "Not verified: exported with --no-verify."])
    if "graph" in figures:  # quantized: the graph checked for what it is, and the rounding's cost apart
        graph, cost, weights = figures["graph"], figures["cost"], figures["weights"]
        rows = [
            [
                "the graph (float activations) against the PyTorch Thinker with the same dequantized weights",
                f"max \\|Δlogit\\| {graph['max_abs_diff']:.3g}, tolerance {graph['tolerance']:.3g}",
            ],
            [
                "each quantized weight against its float original",
                f"worst relative error {weights['relative_error']:.3g} (limit {weights['limit']})",
            ],
        ]
        if "indexer_prompts" in graph:
            rows.append(["the same, on prompts the indexers prune", indexer_cell(graph["indexer_prompts"])])
        if "embeds_graph" in graph:
            rows.append([f"the same, `{EMBEDS_MODEL_FILE}` on a prompt with foreign embeddings", embeds_cell(graph)])
        if "skipped" not in cost:
            rows.append(
                [
                    f"what quantization costs, over {cost['tokens']} tokens of English against the float model",
                    f"top-1 agreement {cost['top1_agreement']:.1%}, perplexity {cost['perplexity_change']:+.1%}",
                ]
            )
        lines.append(markdown_table(["check", "measured"], rows))
    else:
        rows = [
            [
                f"{figures['max_abs_diff']:.3g}",
                f"{figures['tolerance']:.3g}",
                f"{figures['top1_agreement']:.1%}",
                str(figures["positions"]),
                figures["provider"],
            ]
        ]
        lines += [
            "onnxruntime against the PyTorch Thinker in float32, prefill of a left-padded batch then decode steps:",
            "",
            markdown_table(["max \\|Δlogit\\|", "tolerance", "top-1", "positions", "provider"], rows),
        ]
        if "indexer_prompts" in figures:
            long = indexer_cell(figures["indexer_prompts"])
            lines += ["", f"On prompts long enough for the indexers to prune: {long}."]
        if "embeds_graph" in figures:
            lines += ["", f"`{EMBEDS_MODEL_FILE}` on a prompt with foreign embeddings: {embeds_cell(figures)}."]
        if "widened" in figures:  # a bfloat16 export checked where no CUDA runs
            lines += ["", f"{figures['widened'][0].upper()}{figures['widened'][1:]}."]
    lines += ["", "The figures in full are in `export_report.json`."]
    return "\n".join(lines)


def embeds_cell(figures: dict) -> str:
    """The ``--inputs-embeds`` graph's check: its max |Δlogit| (beyond half precision's spread, where one was
    measured), at the tolerance of the check it belongs to."""
    embeds = figures["embeds_graph"]
    held = embeds.get("max_abs_diff_beyond_spread", embeds["max_abs_diff"])
    return f"max \\|Δlogit\\| {held:.3g}, tolerance {figures['tolerance']:.3g}"


def indexer_cell(figures: dict) -> str:
    """Qwen3.8's long-prompt check, in words: its max |Δlogit| and tolerance, or why it was not judged."""
    judged = figures.get("judged", True)
    verdict = f"tolerance {figures['tolerance']:.3g}" if judged else f"not judged: {figures['why']}"
    return f"max \\|Δlogit\\| {figures['max_abs_diff']:.3g}, {verdict}"


def write_onnx_card(folder: Path, thinker_folder: Path, report: dict, name: str, top: Path | None = None) -> list[str]:
    """README.md (and the Thinker folder's license files) in the ONNX folder ``folder``, to be installed as
    ``name``; the names written. Where no genai_config.json was written (a model whose state onnxruntime-genai has
    no type for: the report's notes say why), the card runs it with onnxruntime alone. ``top``: the folder SOURCE
    names, where the Thinker folder is a part of it (``--subfolder``), whose card and license cover it."""
    carried, license_folder = source_card(thinker_folder, top)
    quantized = report.get("quantize")
    genai = (folder / GENAI_CONFIG_FILE).is_file()
    runtimes = ["onnxruntime", "onnxruntime-genai"] if genai else ["onnxruntime"]
    metadata = {
        **carried,
        "library_name": runtimes[-1],
        "pipeline_tag": "text-generation",
        "base_model_relation": "quantized" if quantized and carried.get("base_model") else None,
        "tags": ["onnx", *runtimes, "thinker"],
    }
    origin = weights_of(carried)
    precision = report["dtype"]
    if quantized:
        algo = quantized["algo"] + (", activation-aware scales" if quantized.get("awq") else "")
        blocks = f"blocks of {quantized['block_size']}"
        if quantized.get("scaled_block_size"):  # int4's default: the scales' projections in their own blocks
            coarse, block = quantized["scaled_block_size"], quantized["block_size"]
            blocks = f"blocks of {coarse} where the scales cover, {block} elsewhere"
        precision += f", weights {quantized['weights']} in {blocks} ({algo})"
        precision += head_precision(quantized)
    files = (
        "`genai_config.json` for onnxruntime-genai"
        if genai
        else "no `genai_config.json`: onnxruntime-genai has no model type for its state (`export_report.json`'s notes)"
    )
    # a SOURCE converted on the way came through a temporary Thinker folder: the card names the source
    at = f" at commit `{report['commit']}`" if report.get("commit") else ""
    within = "/".join(filter(None, [report.get("subfolder"), report.get("gguf_file")]))  # the part of SOURCE read
    at += f", the {'file' if report.get('gguf_file') else 'folder'} `{within}`" if within else ""
    if report.get("converted"):
        decoder = f"`{report['source']}`{at}, converted"
    elif report.get("commit"):  # a Thinker folder on the Hub, as it is
        decoder = f"the Thinker folder `{report['source']}`{at}"
    else:
        decoder = f"the Thinker folder `{Path(thinker_folder).name}`"
    config = read_json(Path(thinker_folder) / "config.json") or {}
    embeds = embeds_run(name, report, config) if report.get("inputs_embeds") else ""
    has_tokenizer = has_vocabulary(tokenizer_files(folder))
    tokenizer = "The tokenizer is the model's." if has_tokenizer else "The source had no tokenizer."
    if not has_tokenizer:  # text examples would fail: token ids (the report's notes say so too)
        run = TOKEN_IDS_RUN.format(name=name, genai=TOKEN_IDS_GENAI if genai else "")
    elif genai:
        prefix = report.get("genai_prompt_prefix") or []
        append = GENAI_APPEND_PREFIX.format(count=len(prefix), prefix=prefix) if prefix else GENAI_APPEND
        run = GENAI_RUN.format(name=name, max_length=genai_max_length(folder), append=append)
        if "linear_attention" in (config.get("layer_types") or ()):
            run += HYBRID_BEAMS
    else:
        run = ONNXRUNTIME_RUN.format(name=name)
    body = f"""# {name}

The decoder of {decoder}{origin}, exported by `thinker export` as ONNX ({precision}, the {report["graph"]} graph)
with its whole decoding state as inputs and outputs: `model.onnx` for onnxruntime on left- or right-padded batches,
{files}.
{LAST_LOGITS if report.get("logits") == "last" else ""}{tokenizer}

## Run

{run}
{embeds}"""
    write_card(folder, metadata, body, verify_section(report))
    return ["README.md", *copy_license(license_folder, folder)]


def embeds_run(name: str, report: dict, config: dict) -> str:
    """The card's ``--inputs-embeds`` section: text positions said where the export took them, DeepStack only for a
    model that takes its features (a QA run found both told to exports that refuse them)."""
    multimodal = bool((config.get("rope_parameters") or {}).get("mrope_section"))  # (3, B, T) positions possible
    positions = TEXT_POSITIONS if multimodal and report.get("positions") == "text" else ""
    deepstack = DEEPSTACK_RUN if config.get("deepstack_layers") else ""
    return EMBEDS_RUN.format(name=name, positions=positions, deepstack=deepstack)


# onnxruntime-genai 0.18 reorders the KV cache by beam, not the linear-attention states (RecurrentState::Update):
# test_onnx_genai.py pins it.
HYBRID_BEAMS = (
    "\nBeam search (`num_beams` above 1) goes wrong on this model under onnxruntime-genai 0.18, without an error: "
    "it reorders the attention cache by beam but not the linear-attention states. Greedy search and sampling are "
    "right.\n"
)


# --logits last: what a caller scoring a text must know before it reads the logits.
LAST_LOGITS = "Its logits are each row's last position only, `[batch, 1, vocab]` (`--logits last`): for generation. "


# The card's onnxruntime-genai example runs to this many tokens, or the model's context where it is shorter
# (onnxruntime-genai refuses a max_length past context_length).
CARD_MAX_LENGTH = 64


def genai_max_length(folder: Path) -> int:
    """The card's max_length: CARD_MAX_LENGTH within the context genai_config.json gives."""
    context = read_json(folder / GENAI_CONFIG_FILE).get("model", {}).get("context_length")
    return min(CARD_MAX_LENGTH, context) if isinstance(context, int) and context > 0 else CARD_MAX_LENGTH


def head_precision(quantized: dict) -> str:
    """The head's precision where it is not the weights' (``export_report.json``'s quantize entry)."""
    head = quantized.get("head")
    if head == "mixed":
        return f", the head int8 for its first {quantized['head_int8_rows']} rows and {quantized['weights']} after"
    return f", the head {head}" if head and head != quantized["weights"] else ""


GENAI_RUN = """```python
import onnxruntime_genai as og

model = og.Model("{name}")
tokenizer = og.Tokenizer(model)
params = og.GeneratorParams(model)
params.set_search_options(max_length={max_length})
generator = og.Generator(model, params)
{append}
while not generator.is_done():
    generator.generate_next_token()
print(tokenizer.decode(generator.get_sequence(0)))
```

or `thinker generate {name} --prompt "The capital of France is"`, or `export.runtime.OnnxDecoder` in Python."""

ONNXRUNTIME_RUN = """```bash
thinker generate {name} --prompt "The capital of France is"
```

or in Python, with every state carried from step to step:

```python
from transformers import AutoTokenizer
from export.runtime import OnnxDecoder

tokenizer = AutoTokenizer.from_pretrained("{name}")
decoder = OnnxDecoder("{name}")
prompt = tokenizer("The capital of France is", return_tensors="np")
tokens = decoder.generate(prompt["input_ids"], prompt["attention_mask"], max_new_tokens=32)
print(tokenizer.decode(tokens[0]))
```"""

GENAI_APPEND = """generator.append_tokens(tokenizer.encode("The capital of France is"))"""
# A tokenizer whose prompts begin with special tokens (a BOS), which onnxruntime-genai 0.18's leaves out
# (export/leading_tokens.py): put back where its ids lack them.
GENAI_APPEND_PREFIX = """ids = list(tokenizer.encode("The capital of France is"))
if ids[:{count}] != {prefix}:  # what transformers' tokenizer puts first (a BOS): onnxruntime-genai 0.18 leaves it out
    ids = {prefix} + ids
generator.append_tokens(ids)"""

# A folder without a tokenizer (the Thinker folder had none): prompts as token ids.
TOKEN_IDS_RUN = """The folder has no tokenizer, so it runs on token ids; copy the model's tokenizer files into it for
text prompts (`thinker generate`, onnxruntime-genai's `og.Tokenizer`).

```python
from export.runtime import OnnxDecoder

decoder = OnnxDecoder("{name}")
tokens = decoder.generate([[1, 2, 3]], max_new_tokens=32)  # the prompt's ids, then up to 32 new ones
```
{genai}"""

TOKEN_IDS_GENAI = """
With onnxruntime-genai, `generator.append_tokens([[1, 2, 3]])` takes the ids in the same way.
"""

# --inputs-embeds: how a prompt with a tower's embeddings goes in.
EMBEDS_RUN = """
## Prompts with audio, image or video embeddings

`model.embeds.onnx` is the same decoder taking `inputs_embeds` `[batch, seq, hidden]` (float32) in place of
`input_ids`, and `embed.onnx` looks tokens up (`input_ids` -> `inputs_embeds`); both read `model.onnx.data`. Write a
tower's embeddings into the placeholder slots of the prompt's token embeddings and pass the positions the reference
processor gives (`get_rope_index`: `[3, batch, seq]` with multimodal RoPE); each row then continues one past its
last position on each stream, as transformers' `generate` does.{positions}

```python
from export.runtime import OnnxDecoder

decoder = OnnxDecoder("{name}/model.embeds.onnx")
embeds = decoder.embed(input_ids)                # (batch, seq, hidden) float32
embeds[image_slots] = image_embeddings           # the tower's output, as numpy float32
new_tokens = decoder.generate(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids)
```

{deepstack}"""

# --positions text with --inputs-embeds on a multimodal-RoPE model: (B, T) positions, the three streams equal.
TEXT_POSITIONS = """ This export takes text positions (`--positions text`): prompts whose three position
streams are equal, text and audio; an image or video prompt's distinct streams are refused (export with `--positions
multimodal` for those)."""

# A model whose text decoder takes a vision tower's DeepStack features (Qwen3-VL, Qwen3-Omni).
DEEPSTACK_RUN = """
Qwen3-VL and Qwen3-Omni images and videos also hand the text decoder DeepStack features: pass them as their model
does, `visual_pos_masks=` and `deepstack_visual_embeds=`.
"""
