"""onnxruntime-genai runs the exported folders as written (genai_config.json untouched) and its greedy tokens
equal transformers' greedy tokens. It runs in its own virtual environment (see the ``genai_python`` fixture),
because its CPU onnxruntime must not share one with onnxruntime-gpu."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("genai_greedy.py")
CASES = [
    ("qwen2", "float32"),
    ("qwen3", "float32"),
    ("qwen3_moe", "float32"),
    ("gpt2", "float32"),
    ("qwen3", "float16"),
]
PROMPT = [5, 9, 17, 33, 4, 21]
NEW_TOKENS = 10


def transformers_greedy(folder: Path, dtype: torch.dtype) -> list[int]:
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0].tolist()


def test_genai_greedy_equals_transformers(genai_python, thinker_folder, onnx_folder):
    cases = [{"folder": str(onnx_folder(f, d)), "prompt": PROMPT, "max_new_tokens": NEW_TOKENS} for f, d in CASES]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sequences = json.loads(done.stdout)

    for family, dtype in CASES:  # every session on all cores: 0 is onnxruntime's "one thread per physical core"
        config = json.loads((onnx_folder(family, dtype) / "genai_config.json").read_text())
        assert config["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 0
    for (family, dtype), sequence in zip(CASES, sequences, strict=True):
        expected = transformers_greedy(thinker_folder(family), getattr(torch, dtype))
        # Both stop at the model's eos (id 2) when it comes up: the same rule, so the same tokens.
        assert sequence == expected, f"{family} {dtype}: genai {sequence} != transformers {expected}"
