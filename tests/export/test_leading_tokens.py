"""export/leading_tokens.py: the ids transformers' tokenizer puts in front of a prompt, which the export names for
onnxruntime-genai (whose 0.18 tokenizer leaves them out: tests/export/test_onnx_genai.py runs it)."""

from __future__ import annotations

import pytest
from export_helpers import make_tokenizer, save_bos_tokenizer
from tokenizers import processors

from export.leading_tokens import leading_special_ids
from export.model_card import GENAI_APPEND


@pytest.mark.parametrize(
    ("template", "expected"),
    [("<s> $A", [1]), ("<s> $A </s>", [1]), ("$A </s>", []), ("<s> <s> $A", [1, 1])],
    ids=["bos", "bos-and-eos", "eos", "two"],
)
def test_what_a_tokenizer_puts_in_front(template, expected, tmp_path):
    """Only what comes before the text's own ids: an EOS after them is not the prompt's start (a review found a BOS
    and EOS template given no prefix, so genai's prompt went without its BOS)."""
    tokenizer = save_bos_tokenizer(tmp_path)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer.save_pretrained(tmp_path)
    assert leading_special_ids(tmp_path) == expected


def test_a_tokenizer_without_one_gives_none(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)  # has a bos_token, puts it nowhere (as Qwen's)
    assert leading_special_ids(tmp_path) == []
    assert leading_special_ids(tmp_path / "no such folder") == []


def test_the_card_puts_it_back_only_where_there_is_one(thinker_variant, tmp_path):
    import json

    from click.testing import CliRunner

    from export.model_card import write_onnx_card
    from thinker_common.cli import main

    out = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(thinker_variant("qwen3")), str(out), "--no-verify"])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert GENAI_APPEND in card and "leaves it out" not in card and "(a BOS)" not in result.output
    # a prefix of two tokens is compared whole: compared as ids[:1], which never equals two ids, a prompt that
    # already began [1, 7] got them twice (a mutation run)
    report = json.loads((out / "export_report.json").read_text()) | {"genai_prompt_prefix": [1, 7]}
    write_onnx_card(out, thinker_variant("qwen3"), report, "tiny-onnx")
    card = (out / "README.md").read_text()
    assert "if ids[:2] != [1, 7]:" in card and "ids = [1, 7] + ids" in card and GENAI_APPEND not in card, card
