"""Greedy generation with onnxruntime-genai, run in its own virtual environment by test_onnx_genai.py and
test_onnx_hybrid.py.

Reads [{"folder": ..., "prompt": [ids] or "prompts": [[ids], ...], "max_new_tokens": n, "provider": "cuda"
(optional: the folder's own providers otherwise)}, ...] as JSON on stdin and
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


def greedy(folder: str, prompt: list[int], max_new_tokens: int, provider: str | None = None) -> list[int]:
    model = load(folder, provider)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_new_tokens)
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


def run(case: dict):
    if "prompts" in case:
        args = case["folder"], case["prompts"], case["max_new_tokens"], case.get("provider"), case.get("pad", "right")
        return greedy_batch(*args)
    return greedy(case["folder"], case["prompt"], case["max_new_tokens"], case.get("provider"))


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))
