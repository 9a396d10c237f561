"""The special tokens transformers' tokenizer puts in front of every prompt (a BOS: Llama's, or a GGUF's that sets
``tokenizer.ggml.add_bos_token``), which onnxruntime-genai 0.18's tokenizer leaves out.

transformers 5 saves a tokenizer with its BOS in tokenizer.json's post-processor and no ``add_bos_token`` in
tokenizer_config.json. onnxruntime-genai 0.18's tokenizer (the onnxruntime-extensions it carries) encodes such a
folder without the BOS, and does so with ``add_bos_token: true`` written in too, under six tokenizer classes
(measured here and in a QA run; later onnxruntime-extensions read the post-processor). A prompt without the BOS the
model was trained with is another prompt, so the export names the ids to put back: ``export_report.json``'s
``genai_prompt_prefix``, its notes, and the card's Run snippet, which puts them in front where genai's ids lack them
(a genai that adds them is left alone).
"""

from __future__ import annotations

from pathlib import Path

PROBE = "The capital of France is"


def leading_special_ids(folder: Path) -> list[int]:
    """The ids transformers' tokenizer of ``folder`` puts in front of a text's own: [] where it puts none, or where
    transformers loads no tokenizer from the folder (the export says so apart)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        own, full = (tokenizer(PROBE, add_special_tokens=special)["input_ids"] for special in (False, True))
    except Exception:  # whatever a folder's tokenizer files make transformers raise: the prefix is unknown, not wrong
        return []
    full, own = [int(i) for i in full], [int(i) for i in own]
    # the text's own ids as one run inside the whole: what comes before it (an EOS after it is not the prompt's start)
    start = next((at for at in range(len(full) - len(own) + 1) if full[at : at + len(own)] == own), 0)
    return full[:start]


def prefix_note(prefix: list[int]) -> str | None:
    """The export's note where a prompt needs ``prefix`` put back under onnxruntime-genai."""
    if not prefix:
        return None
    return (
        f"transformers' tokenizer puts {prefix} in front of every prompt (a BOS); onnxruntime-genai 0.18's "
        "og.Tokenizer leaves it out: put it back in front of the ids it encodes (README.md's Run does)"
    )
