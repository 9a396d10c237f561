"""Greedy generation with onnxruntime-genai, run in its own virtual environment by test_onnx_genai.py and
test_onnx_hybrid.py.

Reads [{"folder": ..., "prompt": [ids] or "prompts": [[ids], ...], "max_new_tokens": n, "provider": "cuda"
(optional: the folder's own providers otherwise), "num_beams": k (optional, one prompt: beam search)}, ...] as JSON on
stdin and
prints, for each case, the full token sequence (one prompt) or the list of each row's new tokens (several prompts,
padded with the model's pad id as a batch; "pad": "right" (the default) or "left"), as JSON: one process for every
case, since loading onnxruntime-genai takes a while.

onnxruntime-genai pads a batch on the right (``PadInputs`` in src/models/model.cpp, used by
``Tokenizer.encode_batch``) and reads it so: each row's mask is 0 on its *trailing* pad ids only (a leading pad is a
prompt token to it, mask 1, position = its column), its positions count from column 0, its prefill logits are taken
at its last non-pad token, and each decode step appends mask 1 and the row's next position
(src/models/position_inputs.cpp, logits.cpp). "left" is kept to show what a left-padded batch means to it.
"""

import json
import sys

import numpy as np
import onnxruntime_genai as og


def load(folder: str, provider: str | None = None):
    if provider is None:
        return og.Model(folder)
    config = og.Config(folder)
    config.clear_providers()
    config.append_provider(provider)
    return og.Model(config)


def greedy(
    folder: str, prompt: list[int], max_new_tokens: int, provider: str | None = None, num_beams: int = 1
) -> list[int]:
    """The one prompt's whole sequence, greedy; ``num_beams`` > 1: beam search's best beam (early stopping)."""
    model = load(folder, provider)
    params = og.GeneratorParams(model)
    beams = {"num_beams": num_beams, "early_stopping": True} if num_beams > 1 else {}
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_new_tokens, **beams)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def greedy_batch(
    folder: str, prompts: list[list[int]], max_new_tokens: int, provider: str | None = None, pad_side: str = "right"
) -> list[list[int]]:
    config = json.load(open(f"{folder}/genai_config.json"))
    pad = config["model"]["pad_token_id"]
    width = max(map(len, prompts))
    model = load(folder, provider)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=width + max_new_tokens, batch_size=len(prompts))
    generator = og.Generator(model, params)
    padded = [p + [pad] * (width - len(p)) if pad_side == "right" else [pad] * (width - len(p)) + p for p in prompts]
    generator.append_tokens(np.array(padded, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)][width:] for i in range(len(prompts))]


def greedy_turns(folder: str, turns: list[list[int]], between: int, max_new_tokens: int, rewind: str) -> list[int]:
    """A second turn appended after ``between`` generated tokens, then ``max_new_tokens`` more: the whole sequence.
    onnxruntime-genai 0.18 has not run the last generated token through the model when the next ``append_tokens``
    comes, and does not run it then either: its state lacks that token. ``rewind``, the ways round it that README
    gives: "generated", ``rewind_to`` where the generated tokens begin and append them again in front of the turn
    (``rewind_to`` the last token alone is refused where past and present KV are separate buffers: "greater than the
    current length"); "snapshot", the same with ``snapshot_state()`` taken after each turn is appended (a hybrid
    model's recurrent state rewinds only to a snapshot's length, else to 0); "start", ``rewind_to(0)`` and append the
    whole conversation; "" appends the turn as it is. An error is returned as text."""
    model = load(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=sum(map(len, turns)) + between + max_new_tokens + 1)
    generator = og.Generator(model, params)

    def append(tokens: list[int]) -> None:
        generator.append_tokens(tokens)
        if rewind == "snapshot":
            generator.snapshot_state()

    try:
        append(turns[0])
        for turn in turns[1:]:
            generated_from = len(generator.get_sequence(0))
            for _ in range(between):
                generator.generate_next_token()
            if rewind:
                start = 0 if rewind == "start" else generated_from
                before = [int(t) for t in generator.get_sequence(0)][start:]
                generator.rewind_to(start)
                turn = before + turn
            append(turn)
        for _ in range(max_new_tokens):
            generator.generate_next_token()
    except Exception as err:  # onnxruntime-genai's own error, as the test reports it
        return f"error: {err}"
    return [int(t) for t in generator.get_sequence(0)]


def run(case: dict):
    if "turns" in case:
        return greedy_turns(case["folder"], case["turns"], case["between"], case["max_new_tokens"], case["rewind"])
    if "prompts" in case:
        args = case["folder"], case["prompts"], case["max_new_tokens"], case.get("provider"), case.get("pad", "right")
        return greedy_batch(*args)
    return greedy(
        case["folder"], case["prompt"], case["max_new_tokens"], case.get("provider"), case.get("num_beams", 1)
    )


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))
