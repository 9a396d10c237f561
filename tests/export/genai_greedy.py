"""Greedy generation with onnxruntime-genai, run in its own virtual environment by test_genai.py.

Reads [{"folder": ..., "prompt": [ids], "max_new_tokens": n}, ...] as JSON on stdin and prints the full token
sequence of each as JSON: one process for every case, since loading onnxruntime-genai takes a while.
"""

import json
import sys

import onnxruntime_genai as og


def greedy(folder: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    print(json.dumps([greedy(c["folder"], c["prompt"], c["max_new_tokens"]) for c in cases]))
