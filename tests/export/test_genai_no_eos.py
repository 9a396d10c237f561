"""A model whose configs name no eos token still runs in onnxruntime-genai (issue 15): 0.18 refused the
``"eos_token_id": -1`` the export used to write, and did not load the folder at all. Run in genai's own virtual
environment, as test_onnx_genai.py does; genai stops at the pad id written in its place, so transformers is given
the same stop to compare with."""

from __future__ import annotations

import json
import subprocess

import torch
from export_helpers import save_thinker
from test_onnx_genai import NEW_TOKENS, PROMPT, SCRIPT

from export.exporter import export_model


def test_genai_loads_a_model_without_eos(genai_python, tmp_path):
    from thinker import ThinkerForCausalLM

    folder = save_thinker(tmp_path / "thinker", "qwen3", eos_token_id=None)
    assert "eos_token_id" not in json.loads((folder / "generation_config.json").read_text())
    report = export_model(folder, tmp_path / "onnx", verify=False)
    genai = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())["model"]
    assert genai["eos_token_id"] == genai["pad_token_id"] == 0 and report["notes"]

    cases = [{"folder": str(tmp_path / "onnx"), "prompt": PROMPT, "max_new_tokens": NEW_TOKENS}]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (sequence,) = json.loads(done.stdout)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=0)
    assert sequence == expected[0].tolist()
