"""``thinker export``, ``thinker generate`` and ``thinker demo`` at the command line: what a mutation run of
export/cli.py and export/names.py found untested (each mutation passed every other test): the console's verify
and guard lines, refusals of options given for nothing, the defaults the help promises, and ``--prompt -``."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import assert_error, assert_nothing_written, thinker, thinker_meeting_pipes
from click.testing import CliRunner

from export.cli import embeds_figure, fallback_words, genai_figure, held_figure, indexer_figure, routes_followed
from thinker_common.cli import main

# --- the verify line's parts, as export_report.json's figures give them ------------------------------------------


def test_the_verify_line_names_positions_half_precision_cannot_hold():
    """A half-precision graph's positions excused by their own rounding: how many, and the largest difference of the
    rest; none excused, the difference alone."""
    excused = {"max_abs_diff": 0.25, "positions_excused": 3, "max_abs_diff_beyond_spread": 0.0123}
    assert held_figure(excused) == "max |Δlogit| 0.25 at 3 position(s) half precision cannot hold, 0.0123 elsewhere"
    assert held_figure({"max_abs_diff": 0.25, "positions_excused": 0}) == "max |Δlogit| 0.25"


def test_routes_followed_are_counted_over_every_comparison():
    """The routing choices the reference followed, summed over the check's nested comparisons (the long prompts,
    onnxruntime-genai's graph), and said on the verify line."""
    figures = {
        "max_abs_diff": 0.01,
        "routes_followed": 1,
        "genai_graph": {"max_abs_diff": 0.02, "routes_followed": 2},
        "indexer_prompts": {"max_abs_diff": 0.03, "inner": {"routes_followed": 4}},
    }
    assert routes_followed(figures) == 7
    assert held_figure(figures) == ("max |Δlogit| 0.01, the reference routing 7 token(s) as the graph did at near ties")
    assert routes_followed({"max_abs_diff": 0.01}) == 0


def test_the_guard_names_both_kinds_of_float_fallback_and_their_size():
    guard = {"nodes_to_float_matmul": ["a", "b"], "experts_to_float_moe": ["c"], "float_fallback_bytes": 3 * 2**20}
    words = fallback_words(guard)
    assert words == (
        "; their 2 8-bit projections as float32 MatMuls and 1 8-bit expert layers as float32 MoE ops "
        "(3.0 MiB, faster than 8-bit at level 1)"
    ), words
    experts = fallback_words({"experts_to_float_moe": ["c"], "float_fallback_bytes": 2**20})
    assert experts.startswith("; their 1 8-bit expert layers as float32 MoE ops ("), experts
    assert fallback_words({}) == ""


def test_the_indexer_part_says_when_half_precision_is_not_judged():
    judged = {"indexer_prompts": {"max_abs_diff": 0.5, "tolerance": 0.25}}
    assert indexer_figure(judged) == "; on prompts the indexers prune 0.5 (tolerance 0.25)"
    unjudged = {"indexer_prompts": {"max_abs_diff": 0.5, "tolerance": 0.25, "judged": False}}
    assert indexer_figure(unjudged) == "; on prompts the indexers prune 0.5 (not judged: half precision)"
    assert indexer_figure({}) == ""


def test_the_genai_and_embeds_parts_give_their_own_figures():
    figures = {
        "genai_graph": {"max_abs_diff": 0.0042},
        "embeds_graph": {"max_abs_diff": 0.0031, "positions_excused": 2, "max_abs_diff_beyond_spread": 0.001},
    }
    assert genai_figure(figures) == "; model.genai.onnx on right-padded rows 0.0042"
    assert embeds_figure(figures) == (
        "; model.embeds.onnx with foreign embeddings 0.0031 at 2 position(s) half precision cannot hold, "
        "0.001 elsewhere"
    )
    assert genai_figure({}) == "" and embeds_figure({}) == ""


# --- thinker export: options given for nothing are refused ---------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [["--max-perplexity-increase", "1"], ["--min-top1", "0.5"], ["--embedding", "float"], ["--block-size", "64"]],
    ids=lambda option: option[0],
)
def test_each_quantize_option_without_quantize_is_refused(option, thinker_folder, tmp_path):
    """Each option of a quantized export, given without --quantize, is refused by name before anything is written
    (the last of them, --max-perplexity-increase, was silently ignored with it dropped from the list: a mutation
    run)."""
    output = tmp_path / "out"
    result = thinker("export", thinker_folder("qwen3"), output, "--no-verify", *option)
    assert_error(result, f"{option[0]} needs --quantize")
    assert_nothing_written(output)


# --- thinker export: what the console says of the report ---------------------------------------------------------


def run_export_reporting(monkeypatch, tmp_path, report: dict, *options: str):
    """``thinker export`` with export_model answering ``report`` (the console's lines are the command's own: the
    figures are the report's); returns the run and the keyword arguments export_model was given."""
    import export.exporter

    given = {}

    def export_model(model_dir, output, **kwargs):
        given.update(kwargs)
        return report

    monkeypatch.setattr(export.exporter, "export_model", export_model)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "source"), str(tmp_path / "out"), *options])
    assert result.exit_code == 0, result.output
    return result, given


REPORT = {
    "graph": "fused",
    "nodes": 321,
    "parameters": 1234567,
    "sizes": {"model.onnx": 2048, "model.onnx.data": 3 * 2**20, "README.md": 10},
}


def test_the_console_gives_a_quantized_exports_guard_verify_and_cost(monkeypatch, tmp_path):
    """The guard's agreement before and after its move, the graph's and the weights' checks with their limits, and
    the quantization cost with its sign (a perplexity that rose printed without its +, and the weights' limit
    replaced by the error, passed every test: a mutation run); the quality gate and guard as given."""
    from export.fidelity import FIDELITY_SOURCE

    guard = {
        "moved_to_level_1": ["layers.1"],
        "text": FIDELITY_SOURCE,
        "agreement_before": 0.812,
        "min_agreement": 0.9,
        "agreement": 0.95,
    }
    verify = {
        "graph": {"max_abs_diff": 0.0123, "tolerance": 0.05, "genai_graph": {"max_abs_diff": 0.0042}},
        "weights": {"relative_error": 0.0456, "limit": 0.1},
        "cost": {"top1_agreement": 0.93, "perplexity_change": 0.034, "tokens": 120},
    }
    report = REPORT | {"notes": ["a note of the export"], "accuracy_guard": guard, "verify": verify}
    limits = ["--min-top1", "0.6", "--max-perplexity-increase", "0.5"]
    result, given = run_export_reporting(monkeypatch, tmp_path, report, "--quantize", "int4", *limits)
    assert result.stdout.splitlines() == [
        f"wrote {tmp_path / 'out'} (fused graph): 321 nodes, 1,234,567 parameters "
        "(model.onnx 2.0 KiB, model.onnx.data 3.0 MiB)",
        "accuracy guard: int8 activations agree with float ones on 81.2% of the next tokens of the paragraph "
        "(at least 90%): layers.1 moved to level 1 (95.0%)",
        "verify: max |Δlogit| 0.0123 (tolerance 0.05) against the model with the same dequantized weights; "
        "model.genai.onnx on right-padded rows 0.0042; worst weight 0.0456 (limit 0.1) off the float one",
        "quantization cost: top-1 agreement 93.0% with the float model, perplexity +3.4% over 120 tokens of English",
    ], result.stdout
    assert "note: a note of the export" in result.stderr
    gate = given["quality"]
    assert (gate.min_top1, gate.max_perplexity_increase, gate.required) == (0.6, 0.5, True)
    assert given["accuracy_guard"] == 0.9  # --accuracy-guard's default
    spec = given["quantize"]  # the defaults --help gives: blocks of 32, rtn, level 4 for float32, 8192 int8 rows
    assert (spec.bits, spec.block_size, spec.algo, spec.accuracy_level, spec.head_int8_rows) == (4, 32, "rtn", 4, 8192)


def test_the_console_gives_a_float_exports_verify_and_its_widened_note(monkeypatch, tmp_path):
    """The float verify line: difference, tolerance, top-1 agreement over the positions compared, the provider, the
    genai graph's figure; a bfloat16 graph checked widened says so on its own line."""
    verify = {
        "max_abs_diff": 1.5e-05,
        "tolerance": 0.0001,
        "top1_agreement": 1.0,
        "positions": 14,
        "batch": 2,
        "provider": "CPUExecutionProvider",
        "genai_graph": {"max_abs_diff": 2e-05},
        "widened": "checked widened to float32",
    }
    result, given = run_export_reporting(monkeypatch, tmp_path, REPORT | {"verify": verify}, "--threads", "3")
    assert result.stdout.splitlines()[1:] == [
        "verify: max |Δlogit| 1.5e-05 (tolerance 0.0001), top-1 agreement 100.0% over 14 positions on "
        "CPUExecutionProvider; model.genai.onnx on right-padded rows 2e-05",
        "verify note: checked widened to float32",
    ], result.stdout
    assert (given["quantize"], given["quality"], given["threads"]) == (None, None, 3)
    defaults = {key: given[key] for key in ("dtype", "verify", "graph", "positions", "logits", "inputs_embeds")}
    assert defaults == {
        "dtype": "float32",
        "verify": True,
        "graph": "fused",
        "positions": None,
        "logits": "all",
        "inputs_embeds": False,
    }, defaults


# --- thinker generate and thinker demo -----------------------------------------------------------------------------


def test_generate_runs_to_its_default_of_32_new_tokens(onnx_folder, tmp_path):
    """Without -n, a folder naming no end-of-sequence token generates the 32 tokens --help and the README give."""
    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    for name in ("generation_config.json", "config.json"):
        config = json.loads((folder / name).read_text())
        config.pop("eos_token_id", None)
        (folder / name).write_text(json.dumps(config))
    result = thinker("generate", folder, "--prompt", "the cat")
    assert result.exit_code == 0, result.output
    assert "generation stops only after --max-new-tokens 32" in result.stderr, result.stderr
    assert "\n32 tokens in " in result.stderr, result.stderr


def test_demo_passes_its_documented_defaults(monkeypatch, tmp_path):
    """`thinker demo` continues "The capital of France is" by 12 tokens under ./thinker-demo (README), as given."""
    from pathlib import Path

    import export.demo

    monkeypatch.chdir(tmp_path)  # should the stand-in miss, the real demo writes into tmp_path, not the checkout
    given = []
    monkeypatch.setattr(export.demo, "run_demo", lambda *args: given.append(args[:3]))
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    assert given == [(Path("thinker-demo"), "The capital of France is", 12)]


def test_a_prompt_from_stdin_loses_its_line_ending_whole():
    """``--prompt -``: the newline that ends the text goes, a Windows file's \\r\\n as well as \\n; a line break
    inside stays."""
    from export.cli import _stdin_prompt

    for given, read in [("the cat\r\n", "the cat"), ("the cat\n", "the cat"), ("a\nb\n", "a\nb"), ("x", "x")]:
        with CliRunner().isolation(input=given):
            assert _stdin_prompt() == read, given


def test_a_prompt_from_stdin_that_is_not_text_is_one_line(onnx_folder):
    result = CliRunner().invoke(main, ["generate", str(onnx_folder("qwen3")), "-p", "-"], input=b"\xff\xfe the cat")
    assert_error(result, "--prompt -: stdin is not text in utf-8 (invalid start byte)")


def test_an_onnx_folder_without_config_json_takes_genai_configs_vocabulary(onnx_folder, tmp_path):
    """An ONNX folder without config.json: genai_config.json's vocab_size bounds the prompt's token ids."""
    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    (folder / "config.json").unlink()
    genai = json.loads((folder / "genai_config.json").read_text())
    genai["model"]["vocab_size"] = 8  # as if the tokenizer came from another model
    (folder / "genai_config.json").write_text(json.dumps(genai))
    result = thinker("generate", folder, "--prompt", "the cat sat", "-n", "2")
    assert_error(result, "the tokenizer gives token id 8 for --prompt, beyond the model's vocabulary of 8")


def test_a_broken_link_for_model_onnx_is_named_as_the_model(onnx_folder, tmp_path):
    """model.onnx a link to nothing is still an ONNX folder's model, refused as such, not said to be missing beside
    itself."""
    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(folder / "gone.onnx")
    message = assert_error(thinker("generate", folder, "--prompt", "the cat"), f"{folder / 'model.onnx'}: ")
    assert "missing beside" not in message, message


def test_a_model_onnx_that_is_no_file_is_named_for_what_it_is(onnx_folder, tmp_path):
    """OnnxDecoder (and so `thinker generate`) on a model.onnx that is a link to nothing, or a named pipe (which
    reading would wait on forever): said to be that, not "no such ONNX model" (the advice to export one, where the
    user has one to restore)."""
    import os

    from export.runtime import OnnxDecoder
    from thinker_common.errors import ThinkerError

    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    model = folder / "model.onnx"
    model.unlink()
    model.symlink_to(folder / "gone.onnx")
    with pytest.raises(ThinkerError) as broken:
        OnnxDecoder(folder)
    assert str(broken.value) == (
        f"{model}: a broken symlink (to {folder / 'gone.onnx'}); restore the file it points to, or delete it"
    )
    model.unlink()
    os.mkfifo(model)  # in a thread that releases the pipe, so that a check gone wrong fails rather than hangs
    run = thinker_meeting_pipes("generate", folder, "--prompt", "the cat", pipes=[model], timeout=60)
    assert_error(
        run,
        f"{model}: a named pipe (reading it would wait forever), not a regular file; an ONNX folder's model and "
        "weights are plain files: copy the whole folder again, or export it again",
    )
    model.unlink()
    with pytest.raises(ThinkerError) as missing:
        OnnxDecoder(folder)
    assert str(missing.value) == f"{model}: no such ONNX model; export one with `thinker export`"
