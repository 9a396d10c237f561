"""Every tokenizer file travels: source -> ``thinker-convert`` -> Thinker folder -> ``thinker export`` -> ONNX folder.

The converter and the exporter read one list of tokenizer files (``thinker_common/side_files.py``); before it was
one list, the export dropped SentencePiece (``tokenizer.model``, ``spiece.model``), WordPiece (``vocab.txt``)
and tiktoken (``*.tiktoken``) vocabularies. The SentencePiece model here is a real one, a ``ModelProto`` written
with the protobuf schema transformers reads SentencePiece files with (the ``sentencepiece`` package itself is not
installed).
"""

from __future__ import annotations

import base64
from pathlib import Path

import torch
from export_helpers import make_tokenizer

WORDS = "the a cat dog sat on mat and ran to house".split()


def sentencepiece_model() -> bytes:
    from transformers.convert_slow_tokenizer import import_protobuf

    model = import_protobuf().ModelProto()
    model.trainer_spec.model_type = 1  # UNIGRAM
    model.normalizer_spec.name = "identity"
    piece_type = type(model).SentencePiece
    for text, kind in (("<unk>", piece_type.UNKNOWN), ("<s>", piece_type.CONTROL), ("</s>", piece_type.CONTROL)):
        model.pieces.add(piece=text, score=0.0, type=kind)
    for rank, word in enumerate(WORDS):
        model.pieces.add(piece="\u2581" + word, score=-1.0 - rank / 100, type=piece_type.NORMAL)
    return model.SerializeToString()


def tokenizer_files() -> dict[str, bytes]:
    """What a source folder may carry besides tokenizer.json: SentencePiece, WordPiece and tiktoken vocabularies."""
    return {
        "tokenizer.model": sentencepiece_model(),
        "spiece.model": sentencepiece_model(),
        "vocab.txt": "\n".join(["[PAD]", "[UNK]", *WORDS]).encode() + b"\n",
        "cl100k_base.tiktoken": b"".join(
            base64.b64encode(w.encode()) + f" {i}\n".encode() for i, w in enumerate(WORDS)
        ),
    }


def tiny_source(folder: Path) -> Path:
    """A seeded tiny Qwen3 checkpoint's weights and config in ``folder``, no tokenizer yet."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def test_export_keeps_every_tokenizer_file(tmp_path: Path):
    from transformers.convert_slow_tokenizer import import_protobuf

    from converter.convert import convert
    from export.exporter import export_model

    source = tiny_source(tmp_path / "source")
    make_tokenizer().save_pretrained(source)  # tokenizer.json, tokenizer_config.json (what `generate` loads)
    extras = tokenizer_files()
    for name, data in extras.items():
        (source / name).write_bytes(data)
    expected = {"tokenizer.json", "tokenizer_config.json", *extras}

    thinker = convert(source, tmp_path / "thinker", verify=False, progress=False).output
    export_model(thinker, tmp_path / "onnx", verify=False)

    for folder in (thinker, tmp_path / "onnx"):
        present = {path.name for path in folder.iterdir()}
        assert expected <= present, f"{folder.name} lacks {sorted(expected - present)}"
        for name in expected:
            assert (folder / name).read_bytes() == (source / name).read_bytes(), f"{folder.name}/{name}"
    parsed = import_protobuf().ModelProto.FromString((tmp_path / "onnx" / "tokenizer.model").read_bytes())
    assert [piece.piece for piece in parsed.pieces][3:] == ["\u2581" + word for word in WORDS]


def test_a_tiktoken_vocabulary_alone_is_a_tokenizer():
    """A folder whose one vocabulary is a ``*.tiktoken`` file has a tokenizer: its conversion must not be told "the
    source has no tokenizer", nor its model card say it takes token ids; a chat template and a tokenizer_config.json
    without a vocabulary are none."""
    from thinker_common.side_files import has_vocabulary

    assert has_vocabulary(["tokenizer_config.json", "cl100k_base.tiktoken"])
    assert not has_vocabulary(["tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"])


def test_named_chat_templates_travel_and_are_found_by_name(tmp_path: Path):
    """A tokenizer's named chat templates ("tool_use") lie in ``additional_chat_templates/``, where transformers
    writes and reads them: without the folder, ``apply_chat_template(chat_template="tool_use")`` took the name for a
    template and returned the text "tool_use" (a QA run). The converted and the exported folders answer as the
    source does, and a template cut short there is refused by its path."""
    import pytest
    from transformers import AutoTokenizer

    from converter.convert import convert
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    source = tiny_source(tmp_path / "source")
    tokenizer = make_tokenizer()
    tokenizer.chat_template = {
        "default": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "tool_use": "TOOL {% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    tokenizer.save_pretrained(source)
    assert (source / "additional_chat_templates" / "tool_use.jinja").is_file()  # where transformers puts it
    messages = [{"role": "user", "content": "the cat"}]

    def answers(folder: Path) -> tuple[str, str]:
        loaded = AutoTokenizer.from_pretrained(folder)
        return tuple(
            loaded.apply_chat_template(messages, chat_template=n, tokenize=False) for n in ("default", "tool_use")
        )

    assert answers(source) == ("the cat", "TOOL the cat")
    thinker = convert(source, tmp_path / "thinker", verify=False, progress=False).output
    export_model(thinker, tmp_path / "onnx", verify=False)
    for folder in (thinker, tmp_path / "onnx"):
        assert answers(folder) == answers(source), folder.name

    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ThinkerError, match=r"additional_chat_templates/tool_use\.jinja: not a readable tokenizer"):
        convert(source, tmp_path / "again", verify=False, progress=False)
    assert not (tmp_path / "again").exists()
