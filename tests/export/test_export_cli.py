"""The ``thinker`` command line: export (with --verify) then generate, refusals, one-line errors, help."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from cli_helpers import earlier_output
from click.testing import CliRunner

from thinker_common.cli import main
from thinker_common.errors import ThinkerError


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_the_onnx_folder_carries_a_model_card(runner, thinker_folder, tmp_path):
    """README.md in the ONNX folder: the Thinker card's license and base model carried (and its LICENSE file), the
    verify's figures as export_report.json has them; a quantized export's card gives its three checks."""
    import shutil

    from huggingface_hub import ModelCard

    source = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    (source / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: tiny-org/tiny-qwen3\n---\n# card\n")
    (source / "LICENSE").write_text("Apache License, Version 2.0")
    output = tmp_path / "onnx"
    assert runner.invoke(main, ["export", str(source), str(output)]).exit_code == 0
    card = ModelCard.load(output / "README.md")
    assert card.data.license == "apache-2.0" and card.data.base_model == "tiny-org/tiny-qwen3"
    assert card.data.library_name == "onnxruntime-genai" and "onnx" in card.data.tags
    assert (output / "LICENSE").read_text() == "Apache License, Version 2.0"
    report = json.loads((output / "export_report.json").read_text())
    verify = report["verify"]
    assert f"| {verify['max_abs_diff']:.3g} | {verify['tolerance']:.3g} | 100.0% |" in card.text, card.text
    assert report["sizes"]["README.md"] == (output / "README.md").stat().st_size
    assert 'og.Model("onnx")' in card.text

    quantized = tmp_path / "int8"
    gate = ["--min-top1", "0", "--max-perplexity-increase", "100"]
    assert runner.invoke(main, ["export", str(source), str(quantized), "--quantize", "int8", *gate]).exit_code == 0
    card = ModelCard.load(quantized / "README.md")
    # the CLI's int8 scales for rounding first (export/awq.py), and the card says so
    assert card.data.base_model_relation == "quantized"
    assert "weights int8 in blocks of 32 (rtn, activation-aware scales)" in card.text
    graph = json.loads((quantized / "export_report.json").read_text())["verify"]["graph"]
    assert f"max \\|Δlogit\\| {graph['max_abs_diff']:.3g}, tolerance {graph['tolerance']:.3g}" in card.text
    assert "top-1 agreement" in card.text and "perplexity" in card.text
    assert "the head" not in card.text and "(`--logits last`)" not in card.text  # an int8 head, logits everywhere


def test_a_quantized_card_is_related_to_a_base_model_only_where_it_names_one(thinker_folder, tmp_path):
    """The Hub reads base_model_relation only beside a base_model: a quantized export of a model whose card names
    none gets neither (a mutation run wrote the relation alone); the card that names one is the test above's."""
    import shutil

    from huggingface_hub import ModelCard

    from export.model_card import write_onnx_card

    source = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# card\n")
    report = {"dtype": "float32", "graph": "fused", "quantize": {"weights": "int4", "block_size": 32, "algo": "rtn"}}
    output = tmp_path / "onnx"
    output.mkdir()
    write_onnx_card(output, source, report, "tiny-onnx")
    data = ModelCard.load(output / "README.md").data.to_dict()
    assert (
        data["license"] == "apache-2.0" and "weights int4 in blocks of 32 (rtn)" in (output / "README.md").read_text()
    )
    assert "base_model" not in data and "base_model_relation" not in data, data


def test_the_card_gives_the_perplexity_change_with_its_sign():
    """A quantized export's cost, as export_report.json has it (a fraction): a perplexity that rose reads +3.4%, one
    that fell -1.2% (a mutation run printed the rise as a fall)."""
    from export.model_card import verify_section

    def cost_line(change: float) -> str:
        figures = {
            "graph": {"max_abs_diff": 0.01, "tolerance": 0.05},
            "weights": {"relative_error": 0.01, "limit": 0.1},
            "cost": {"tokens": 100, "top1_agreement": 0.95, "perplexity_change": change},
        }
        return verify_section({"verify": figures})

    assert "top-1 agreement 95.0%, perplexity +3.4%" in cost_line(0.034), cost_line(0.034)
    assert "top-1 agreement 95.0%, perplexity -1.2%" in cost_line(-0.012), cost_line(-0.012)


@pytest.mark.parametrize("left", [(), ("chat_template.jinja",)], ids=["none", "a template alone"])
def test_a_folder_without_a_tokenizer_is_said_to_run_on_token_ids(left, runner, thinker_folder, tmp_path):
    """A Thinker folder without a tokenizer (a weights-only checkpoint's; or tokenizer files without a vocabulary,
    a chat template alone) exported without a word, and its card showed text prompts that fail (found by a QA run):
    a note on the console and in the report, and the card's example runs on token ids, as written."""
    import shutil

    from export.runtime import OnnxDecoder
    from thinker_common.side_files import tokenizer_files

    source = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    for name in tokenizer_files(source):
        (source / name).unlink()
    for name in left:
        (source / name).write_text("{{ messages[0]['content'] }}")
    output = tmp_path / "onnx"
    result = runner.invoke(main, ["export", str(source), str(output), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert "has no tokenizer, so neither has this one: it runs on token ids" in result.stderr, result.stderr
    notes = json.loads((output / "export_report.json").read_text())["notes"]
    assert any("runs on token ids" in note for note in notes), notes
    card = (output / "README.md").read_text()
    assert "tokenizer.encode" not in card and "--prompt" not in card and "runs on token ids" in card, card
    assert "decoder.generate([[1, 2, 3]], max_new_tokens=32)" in card
    assert OnnxDecoder(output).generate([[1, 2, 3]], max_new_tokens=4).shape == (1, 7)


def test_the_card_names_the_head_and_last_position_logits(runner, thinker_folder, tmp_path):
    options = ["--quantize", "int4", "--logits", "last", "--no-verify", "--accuracy-guard", "0"]
    for head, says in [("mixed", "the head int8 for its first 8 rows and int4 after"), ("int8", "the head int8")]:
        output = tmp_path / head
        rows = ["--head-int8-rows", "8"] if head == "mixed" else []
        args = ["export", str(thinker_folder("qwen3")), str(output), *options, "--quantize-head", head, *rows]
        assert runner.invoke(main, args).exit_code == 0
        card = (output / "README.md").read_text()
        # the CLI's int4 scales for rounding first (export/awq.py), and the card says so
        assert f"weights int4 in blocks of 32 (rtn, activation-aware scales), {says}, the fused graph)" in card, card
        assert "logits are each row's last position only, `[batch, 1, vocab]` (`--logits last`)" in card

    whole = runner.invoke(main, [*args[:2], str(tmp_path / "whole"), *options, "--head-int8-rows", "1000"])
    assert whole.exit_code == 0, whole.output
    assert "the mixed head's 1000 int8 rows (--head-int8-rows) cover the whole vocabulary" in whole.stderr
    assert (
        "weights int4 in blocks of 32 (rtn, activation-aware scales), the head int8, the fused graph)"
        in (tmp_path / "whole/README.md").read_text()
    )


def test_export_then_generate(runner, thinker_folder, tmp_path):
    source = thinker_folder("qwen3_moe")
    output = tmp_path / "onnx"
    result = runner.invoke(main, ["export", str(source), str(output), "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert "verify: max |Δlogit|" in result.stdout

    names = {p.name for p in output.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "export_report.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= names
    # the model's config without the auto_map of the PyTorch code the ONNX folder does not carry
    exported, thinker_config = (json.loads((f / "config.json").read_text()) for f in (output, source))
    assert "auto_map" in thinker_config and exported == {k: v for k, v in thinker_config.items() if k != "auto_map"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    report = json.loads((output / "export_report.json").read_text())
    assert report["dtype"] == "float32" and report["opset"] == 21 and report["nodes"] > 0
    assert report["verify"]["passed"] is True and report["verify"]["max_abs_diff"] <= 1e-4
    assert report["verify"]["decode_steps"] == 6 and report["verify"]["batch"] == 2
    genai = json.loads((output / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 2
    assert (genai["model"]["eos_token_id"], genai["model"]["bos_token_id"], genai["model"]["pad_token_id"]) == (2, 1, 0)

    prompt = ["--prompt", "the cat sat on the mat", "--max-new-tokens", "6"]
    onnx_run = runner.invoke(main, ["generate", str(output), *prompt])
    torch_run = runner.invoke(main, ["generate", str(source), *prompt])
    assert onnx_run.exit_code == 0, onnx_run.output
    assert torch_run.exit_code == 0, torch_run.output
    assert onnx_run.stdout.strip() and onnx_run.stdout == torch_run.stdout
    assert "onnxruntime (cpu, model.onnx)" in onnx_run.stderr and "transformers" in torch_run.stderr


def test_generate_is_plain_greedy_on_both_paths(runner, thinker_folder, onnx_folder, tmp_path):
    """generation_config.json's processors (Qwen2.5-Instruct ships repetition_penalty 1.05) are not applied by
    transformers' side alone: a Thinker folder and its export continue a prompt alike."""
    import shutil

    from transformers import AutoTokenizer

    from thinker import ThinkerForCausalLM

    folder = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(repetition_penalty=5.0, no_repeat_ngram_size=1)
    (folder / "generation_config.json").write_text(json.dumps(config))
    text = "the cat sat on the mat"
    prompt = ["--prompt", text, "--max-new-tokens", "8"]
    torch_run = runner.invoke(main, ["generate", str(folder), *prompt])
    onnx_run = runner.invoke(main, ["generate", str(onnx_folder("qwen3")), *prompt])
    assert torch_run.exit_code == 0 and onnx_run.exit_code == 0, torch_run.output + onnx_run.output
    assert torch_run.stdout.strip() and torch_run.stdout == onnx_run.stdout
    # ... where the folder's own settings would have changed the Thinker's tokens
    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt").input_ids
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        processed = model.generate(ids, max_new_tokens=8, do_sample=False)
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0)
    assert processed.tolist() != plain.tolist()


def test_generate_says_when_the_folder_names_no_end_of_sequence_token(runner, onnx_folder, tmp_path):
    """With no eos id in generation_config.json or config.json, nothing stops the continuation early, as in
    transformers: a note says so, and it runs to --max-new-tokens. genai_config.json's eos is not taken in their
    place: where the model names none, the export writes the pad id there for onnxruntime-genai (which needs one),
    and the ONNX folder stopped at the first pad token where the Thinker folder ran on (found by a QA run)."""
    import shutil

    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    prompt = ["--prompt", "the cat sat", "--max-new-tokens", "4"]
    named = runner.invoke(main, ["generate", str(folder), *prompt])
    assert named.exit_code == 0 and "names no end-of-sequence token" not in named.stderr, named.output
    from transformers import AutoTokenizer

    from export.runtime import OnnxDecoder

    ids = AutoTokenizer.from_pretrained(folder)("the cat sat", return_tensors="np").input_ids
    first = int(OnnxDecoder(folder).generate(ids, max_new_tokens=1, eos_token_id=[])[0, -1])
    genai = json.loads((folder / "genai_config.json").read_text())
    genai["model"]["eos_token_id"] = genai["model"]["pad_token_id"] = first  # as a model without eos exports
    (folder / "genai_config.json").write_text(json.dumps(genai))
    for name in ("generation_config.json", "config.json"):
        config = json.loads((folder / name).read_text())
        config.pop("eos_token_id", None)
        (folder / name).write_text(json.dumps(config))
    unnamed = runner.invoke(main, ["generate", str(folder), *prompt])
    assert unnamed.exit_code == 0, unnamed.output
    assert "names no end-of-sequence token" in unnamed.stderr and "--max-new-tokens 4" in unnamed.stderr
    assert "4 tokens in" in unnamed.stderr, unnamed.stderr
    # an empty list stops nowhere too, and says so (a mutation run: the note was kept for an absent key)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": []}))
    empty = runner.invoke(main, ["generate", str(folder), *prompt])
    assert empty.exit_code == 0 and "names no end-of-sequence token" in empty.stderr, empty.output
    assert "4 tokens in" in empty.stderr, empty.stderr


@pytest.mark.parametrize("kind", ["thinker", "onnx"])
def test_generate_names_a_stop_token_file_that_is_no_id(kind, runner, thinker_folder, onnx_folder, tmp_path):
    """A generation_config.json whose eos_token_id is a string gave a Thinker folder a transformers traceback
    (GenerationConfig's own check), and an ONNX folder a line that did not say which file (a QA run): one line
    naming the file and the key, for both."""
    import shutil

    folder = shutil.copytree(thinker_folder("qwen3") if kind == "thinker" else onnx_folder("qwen3"), tmp_path / kind)
    for key, value in (("eos_token_id", "x"), ("pad_token_id", [0, 1])):
        config = json.loads((folder / "generation_config.json").read_text()) | {key: value}
        (folder / "generation_config.json").write_text(json.dumps(config))
        result = runner.invoke(main, ["generate", str(folder), "--prompt", "the cat", "-n", "2"])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: {folder / 'generation_config.json'}: {key}={value!r}; expected"), lines
        config[key] = 2  # a sound id again, for the next key
        (folder / "generation_config.json").write_text(json.dumps(config))


def test_export_logits_last_then_generate(runner, thinker_folder, tmp_path):
    """--logits last from the command line: the report and the graph say so, --verify passes, and `thinker generate`
    on it writes what transformers writes."""
    import onnx

    source = thinker_folder("qwen3")
    output = tmp_path / "onnx"
    result = runner.invoke(main, ["export", str(source), str(output), "--logits", "last"])
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())
    assert report["logits"] == "last" and report["verify"]["passed"] is True
    assert "note: logits are [batch, 1, vocab]" in result.output and "from 0.12.2 on" in result.output
    logits = onnx.load(output / "model.onnx", load_external_data=False).graph.output[0]
    assert [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim][1] == 1
    prompt = ["--prompt", "the cat sat on the mat", "--max-new-tokens", "6"]
    onnx_run = runner.invoke(main, ["generate", str(output), *prompt])
    torch_run = runner.invoke(main, ["generate", str(source), *prompt])
    assert onnx_run.exit_code == 0, onnx_run.output
    assert onnx_run.stdout.strip() and onnx_run.stdout == torch_run.stdout
    bad = runner.invoke(main, ["export", str(source), str(tmp_path / "bad"), "--logits", "first"])
    assert bad.exit_code == 2 and "'first' is not one of 'all', 'last'" in bad.output


def test_export_converts_a_source_on_the_way(runner, tmp_path):
    """A transformers Qwen3 folder (not a Thinker folder) is converted by thinker-convert, then exported."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    result = runner.invoke(main, ["export", str(tmp_path / "qwen3"), str(tmp_path / "onnx")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "onnx" / "export_report.json").read_text())
    assert report["converted"] is True and report["verify"]["passed"] is True
    # the source as given, not the staging folder it was converted into (gone once the export is in place)
    metadata = {
        p.key: p.value for p in onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).metadata_props
    }
    assert metadata["thinker.source"] == str(tmp_path / "qwen3")


def test_existing_output_is_refused_without_force(runner, thinker_folder, tmp_path):
    output = tmp_path / "onnx"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    result = runner.invoke(main, ["export", str(thinker_folder("qwen2")), str(output), "--no-verify"])
    assert result.exit_code == 1  # not an earlier output: --force would not take it, so it is not offered
    assert "not an earlier output of thinker" in result.stderr and "--force deletes" in result.stderr, result.stderr
    assert [p.name for p in output.iterdir()] == ["keep.txt"]

    # --force replaces earlier outputs only (tests/test_source_safety.py): with a thinker card beside it, this is one
    earlier_output(output)
    result = runner.invoke(main, ["export", str(thinker_folder("qwen2")), str(output), "--no-verify"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"error: {output} already exists; pass --force to replace it"]
    result = runner.invoke(main, ["export", str(thinker_folder("qwen2")), str(output), "--no-verify", "--force"])
    assert result.exit_code == 0, result.output
    assert (output / "model.onnx").is_file() and not (output / "keep.txt").exists()


def test_errors_are_one_line_unless_debug(runner, tmp_path):
    missing = tmp_path / "nothing-here"
    result = runner.invoke(main, ["export", str(missing), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
    assert "Traceback" not in result.output

    debug = runner.invoke(main, ["export", str(missing), str(tmp_path / "out"), "--debug"])
    assert debug.exit_code == 1 and debug.exception is not None  # the exception itself, for its traceback


def test_export_given_a_file_of_a_thinker_folder_asks_for_the_folder(runner, thinker_folder, tmp_path):
    """Its weights file was taken for a source to convert, and the converter's refusal sent the user back to
    `thinker export` (a QA run)."""
    folder = thinker_folder("qwen2")
    for name in ("model.safetensors", "config.json"):
        result = runner.invoke(main, ["export", str(folder / name), str(tmp_path / "out"), "--no-verify"])
        assert result.exit_code == 1
        expected = f"error: {folder / name}: a file of the Thinker folder {folder}; give the folder itself as MODEL_DIR"
        assert result.stderr.strip().splitlines() == [expected]
        assert not (tmp_path / "out").exists()


def test_generate_refuses_a_folder_without_a_model(runner, thinker_folder, tmp_path):
    (tmp_path / "tokenizer-only").mkdir()
    thinker_tokenizer = thinker_folder("qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tokenizer-only" / name).write_bytes((thinker_tokenizer / name).read_bytes())
    result = runner.invoke(main, ["generate", str(tmp_path / "tokenizer-only"), "--prompt", "the cat"])
    assert result.exit_code == 1
    assert "neither an ONNX folder" in result.stderr


# A chat template in the tiny tokenizer's own words: a user turn "the MESSAGE is", then the assistant's turn "a".
CHAT_TEMPLATE = (
    "{% for m in messages %}the {{ m['content'] }} is {% endfor %}{% if add_generation_prompt %}a{% endif %}"
)


def test_generate_chat_puts_the_prompt_in_the_chat_template(runner, thinker_folder, tmp_path):
    """--chat: the prompt as one user message of the folder's chat template, the assistant's turn opened; the same
    text from onnxruntime and transformers; a folder without a template is refused by name."""
    import shutil

    from transformers import AutoTokenizer

    from export.cli import _chat_ids

    source = tmp_path / "thinker"
    shutil.copytree(thinker_folder("qwen3"), source)
    output = tmp_path / "onnx"
    assert runner.invoke(main, ["export", str(source), str(output), "--no-verify"]).exit_code == 0
    refused = runner.invoke(main, ["generate", str(output), "-p", "cat sat", "--chat"])
    assert refused.exit_code == 1 and "its tokenizer has no chat template" in refused.stderr
    for folder in (source, output):
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(output)
    expected = tokenizer("the cat sat is a", return_tensors="np")["input_ids"]
    assert _chat_ids(output, tokenizer, "cat sat").tolist() == expected.tolist()
    prompt = ["-p", "cat sat", "--chat", "-n", "6"]
    onnx_run, torch_run = (runner.invoke(main, ["generate", str(f), *prompt]) for f in (output, source))
    assert onnx_run.exit_code == 0 and torch_run.exit_code == 0, onnx_run.output + torch_run.output
    assert onnx_run.stdout.strip() and onnx_run.stdout == torch_run.stdout


def test_generate_chat_takes_a_named_template(runner, thinker_folder, tmp_path):
    """--chat-template NAME: the tokenizer's template of that name (additional_chat_templates/NAME.jinja), --chat
    implied; a tokenizer whose templates are all named, none the default, got a traceback from transformers ("multiple
    chat templates with no default specified"): now one line saying how to pick one, as for a name it lacks."""
    import shutil

    from transformers import AutoTokenizer

    from export.cli import _chat_ids

    source = tmp_path / "thinker"
    shutil.copytree(thinker_folder("qwen3"), source)
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text(CHAT_TEMPLATE)
    (source / "additional_chat_templates" / "rag.jinja").write_text(CHAT_TEMPLATE.replace("the ", "a "))
    output = tmp_path / "onnx"
    assert runner.invoke(main, ["export", str(source), str(output), "--no-verify"]).exit_code == 0
    assert (output / "additional_chat_templates" / "tool_use.jinja").read_text() == CHAT_TEMPLATE

    def generate(folder, *options):
        return runner.invoke(main, ["generate", str(folder), "-p", "cat sat", "-n", "6", *options])

    unnamed = generate(output, "--chat")
    assert unnamed.exit_code == 1, unnamed.output
    assert unnamed.stderr.strip() == (
        f"error: {output}: its tokenizer's chat templates are all named (rag, tool_use), none the default; pick one "
        "with --chat-template NAME"
    )
    named = generate(output, "--chat-template", "tool_use")
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # the same words as the default: the same tokens
    assert named.exit_code == 0 and named.stdout.strip() and named.stdout == generate(source, "--chat").stdout
    tokenizer = AutoTokenizer.from_pretrained(output)  # each name its own template's words
    for name, words in (("rag", "a cat sat is a"), ("tool_use", "the cat sat is a")):
        expected = tokenizer(words, return_tensors="np")["input_ids"].tolist()
        assert _chat_ids(output, tokenizer, "cat sat", name).tolist() == expected
    missing = generate(output, "--chat-template", "nope")
    assert missing.exit_code == 1
    assert "its tokenizer has no chat template named 'nope' (its named ones: rag, tool_use)" in missing.stderr


def test_help_teaches(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("convert", "export", "generate", "verify"):
        assert command in result.stdout
    export_help = runner.invoke(main, ["export", "--help"]).stdout
    for option in ("--dtype", "--verify / --no-verify", "--force", "--threads", "--debug", "past_key_values"):
        assert option in export_help
    assert "[default: fused]" in " ".join(export_help.split())  # one default graph, for every model
    # Examples on the first screen; the graph's interface, which a caller wiring it reads once, after the options.
    assert export_help.index("Examples:") < export_help.index("Options:") < export_help.index("past_key_values")
    assert "thinker export ./qwen3-0.6b-thinker ./qwen3-int4 --quantize int4" in export_help


def test_export_model_from_python_takes_a_torch_dtype_and_refuses_what_the_cli_would(thinker_folder, tmp_path):
    """``export_model`` is the CLI's function: a torch.dtype names the dtype as transformers' ``dtype=`` does; a
    quantization named by a string, or 0 threads, is refused by name rather than failing deep inside."""
    from export.exporter import export_model

    report = export_model(thinker_folder("qwen3"), tmp_path / "half", dtype=torch.float16, verify=False, progress=False)
    assert report["dtype"] == "float16"
    for wrong, message in (({"quantize": "int4"}, "pass a QuantizeSpec"), ({"threads": 0}, "threads=0")):
        with pytest.raises(ThinkerError, match=message):
            export_model(thinker_folder("qwen3"), tmp_path / "never", verify=False, progress=False, **wrong)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--min-top1", "nan"),
        ("--max-perplexity-increase", "nan"),
        ("--max-perplexity-increase", "inf"),
        ("--accuracy-guard", "nan"),
    ],
)
def test_quality_limits_are_finite_numbers(option, value, runner, thinker_folder, tmp_path):
    """click's FloatRange takes nan, with which every comparison is false: the quality gate never failed, and
    export_report.json held NaN, which strict JSON refuses (a QA run)."""
    args = ["export", str(thinker_folder("qwen3")), str(tmp_path / "out"), "--quantize", "int4", option, value]
    result = runner.invoke(main, args)
    assert result.exit_code == 2 and f"Invalid value for '{option}': '{value}' is not a finite number." in (
        result.stderr
    ), result.output
    assert not (tmp_path / "out").exists()


def test_quality_limits_given_by_name_need_the_cost_measured(runner, thinker_folder, tmp_path):
    """The quantization cost runs a paragraph through the folder's tokenizer. Without one it is not measured: with
    the default limits the export says so and passes; with --min-top1 given, the limit cannot be held, so it fails."""
    import shutil

    folder = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    for path in folder.glob("*"):
        if path.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            path.unlink()
    quantized = ["--quantize", "int8", "--block-size", "16"]
    default = runner.invoke(main, ["export", str(folder), str(tmp_path / "default"), *quantized])
    assert default.exit_code == 0 and "quantization cost not measured" in default.stderr, default.output
    limited = runner.invoke(main, ["export", str(folder), str(tmp_path / "limited"), *quantized, "--min-top1", "0"])
    assert limited.exit_code == 1 and "which cannot be measured here: no usable tokenizer" in limited.stderr, (
        limited.output
    )
    assert not (tmp_path / "limited").exists()


def test_quality_limits_without_a_tokenizer_are_refused_before_the_export(
    runner, thinker_folder, tmp_path, monkeypatch
):
    """Refused first, not after the whole export and its verify ran (helper-242); the verify's own refusal stays
    behind it for a cost skipped otherwise."""
    import shutil

    import export.exporter

    folder = shutil.copytree(thinker_folder("qwen3"), tmp_path / "thinker")
    for path in folder.glob("tokenizer*"):
        path.unlink()

    def no_graph(*args, **kwargs):
        raise AssertionError("the graph was built")

    monkeypatch.setattr(export.exporter, "build_onnx", no_graph)
    monkeypatch.setattr(export.exporter, "scaled_for_rounding", no_graph)
    args = ["export", str(folder), str(tmp_path / "out"), "--quantize", "int4", "--max-perplexity-increase", "1"]
    result = runner.invoke(main, args)
    assert result.exit_code == 1 and "limit the quantization cost, which cannot be measured here" in result.stderr, (
        result.output
    )
    assert not (tmp_path / "out").exists()


def test_each_option_reaches_what_it_controls(runner, thinker_folder, tmp_path):
    """An option read and not passed on leaves a sound export of another kind, which its own checks pass, since they
    hold the export to what it was told (a mutation run: --graph, --dtype and --accuracy-guard each dropped at the
    command line, the head's bits, the embedding and the mixed head's rows in the spec, all exit 0)."""
    from export.quantize import QuantizeSpec

    folder = thinker_folder("qwen3")
    plain = tmp_path / "plain"
    result = runner.invoke(
        main, ["export", str(folder), str(plain), "--graph", "plain", "--dtype", "float16", "--no-verify"]
    )
    assert result.exit_code == 0, result.output
    model = onnx.load(plain / "model.onnx", load_external_data=False)
    assert not [node.op_type for node in model.graph.node if node.domain == "com.microsoft"]  # standard ops alone
    kinds = {tensor.data_type for tensor in model.graph.initializer if len(tensor.dims) == 2}
    assert kinds == {onnx.TensorProto.FLOAT16}, kinds

    guarded = tmp_path / "guarded"
    options = ["--quantize", "int4", "--algo", "rtn-asym", "--accuracy-guard", "1.0", "--no-verify"]
    result = runner.invoke(main, ["export", str(folder), str(guarded), *options])
    assert result.exit_code == 0, result.output
    report = json.loads((guarded / "export_report.json").read_text())
    assert report["accuracy_guard"]["min_agreement"] == 1.0
    # the algorithm asked for, and said as it is (rtn-asym read as rtn, or called symmetric, passed: a mutation run)
    assert (report["quantize"]["algo"], report["quantize"]["symmetric"]) == ("rtn-asym", False)
    body = [node for node in onnx.load(guarded / "model.onnx").graph.node if node.op_type == "MatMulNBits"]
    body = [node for node in body if "lm_head" not in node.name]
    assert body and all(len(node.input) > 3 and node.input[3] for node in body)  # each with its zero points

    head = QuantizeSpec.parse("int4", head="int8", embedding="float")
    assert (head.bits, head.head_bits, head.head_int8_rows, head.float_embedding) == (4, 8, 0, True)
    mixed = QuantizeSpec.parse("int4", head_int8_rows=32, block_size=64)
    assert (mixed.head_bits, mixed.head_int8_rows, mixed.float_embedding, mixed.block_size) == (None, 32, False, 64)
