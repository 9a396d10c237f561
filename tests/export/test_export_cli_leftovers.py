"""What a second mutation run of export/cli.py and export/names.py found untested (each mutation passed every other
test): the context a llama3 RoPE scaling stretches, and an ONNX folder that lost model.onnx beside its
model.embeds.onnx."""

from __future__ import annotations

import shutil

from cli_helpers import assert_error, thinker
from export_helpers import make_config

from export.genai_config import make_genai_config
from export.names import export_context

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def test_a_llama3_rope_stretches_the_exported_context_as_yarn_does():
    """llama3's scaling, like YaRN's, runs past max_position_embeddings: factor 4 x 16 trained positions is 64, in
    genai_config.json's context and longest search too (with llama3 dropped from the stretching types, 32: a
    mutation run). Llama 3.1's own numbers (factor 8 x 8192 trained, below its 131072) stretch nothing."""
    rope = LLAMA3 | {"factor": 4.0, "original_max_position_embeddings": 16}
    assert export_context(32, rope) == (64, "llama3's factor 4 x 16 trained positions")
    genai = make_genai_config(make_config("qwen3", rope_parameters=rope, max_position_embeddings=32), None)
    assert (genai["model"]["context_length"], genai["search"]["max_length"]) == (64, 64)
    llama31 = LLAMA3 | {"factor": 8.0, "original_max_position_embeddings": 8192}
    assert export_context(131072, llama31) == (131072, "max_position_embeddings")


def test_generate_names_model_embeds_onnx_among_what_an_incomplete_export_kept(onnx_folder, tmp_path):
    """An --inputs-embeds export that lost model.onnx: generate names each file it kept, model.embeds.onnx too.
    With model.embeds.onnx alone left beside a Thinker config.json, the folder is still an incomplete export, not
    taken for a Thinker folder (whose weights it lacks)."""
    folder = shutil.copytree(onnx_folder("qwen3"), tmp_path / "onnx")
    (folder / "model.onnx").unlink()
    (folder / "model.embeds.onnx").write_bytes(b"")
    kept = ", ".join(
        name
        for name in ("model.onnx.data", "model.genai.onnx", "model.embeds.onnx", "genai_config.json")
        if (folder / name).exists()
    )
    message = assert_error(thinker("generate", folder, "--prompt", "the cat"), f"{folder}: model.onnx missing beside")
    assert message == (
        f"error: {folder}: model.onnx missing beside {kept}; the ONNX folder is incomplete: copy the whole folder, or "
        "export it again"
    ), message
    for name in ("model.onnx.data", "model.genai.onnx", "genai_config.json"):
        (folder / name).unlink(missing_ok=True)
    assert_error(
        thinker("generate", folder, "--prompt", "the cat"),
        f"{folder}: model.onnx missing beside model.embeds.onnx; the ONNX folder is incomplete",
    )
