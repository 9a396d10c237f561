"""What a half-precision export's ``--verify`` should compare with: the graph against PyTorch in float32 and in its
own dtype (export/verify.py holds it to float32 since an H200 showed a bfloat16 Qwen3-MoE graph 0.066 from the float32
model but 0.55 from PyTorch's bfloat16 one: bench/results/gpu-half-reference.txt).

For each family and dtype: a tiny random Thinker folder (tests/export/export_helpers.py, the GPU tests' own), its
fused export, run by ``OnnxDecoder`` on the provider; ``export.verify.compare_decoders`` (prefill + 6 decode steps of
the left-padded parity batch) against PyTorch on the CPU in float32 and in the export's dtype; and PyTorch's half
model against its float32 model (prefill). Writes bench/results/half-reference-<provider>.json.

    python bench/probe_half_reference.py                                 # on a GPU (bench/gpu_kit.py run half)
    python bench/probe_half_reference.py --provider cpu --dtypes float16 # the CPU has no bfloat16 kernels
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from results_io import command_line, writable_folder, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

import torch  # noqa: E402
from export_helpers import save_thinker  # noqa: E402

from export.exporter import export_model  # noqa: E402
from export.runtime import OnnxDecoder  # noqa: E402
from export.verify import compare_decoders  # noqa: E402
from thinker import ThinkerForCausalLM  # noqa: E402
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch  # noqa: E402


def measure(folder: Path, export: Path, dtype: str, provider: str) -> dict:
    half = getattr(torch, dtype)
    decoder = OnnxDecoder(export, provider=provider)
    batch = parity_batch(96)
    row = {}
    models = {
        name: ThinkerForCausalLM.from_pretrained(folder, dtype=d).eval()
        for name, d in (("float32", torch.float32), (dtype, half))
    }
    for name, model in models.items():
        figures = compare_decoders(model, decoder, *batch)
        bound = RELATIVE_TOLERANCE[half] * max(1.0, figures["logit_scale"])
        row[f"export vs {name}"] = {"max_abs_diff": figures["max_abs_diff"], "tolerance": bound}
    ids, mask = (torch.from_numpy(a) for a in batch)
    with torch.no_grad():
        full = models["float32"](input_ids=ids, attention_mask=mask).logits
        rounded = models[dtype](input_ids=ids, attention_mask=mask).logits.float()
    row[f"torch {dtype} vs float32 (prefill)"] = float((full - rounded)[mask.bool()].abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--families", default="qwen3,qwen3_moe,qwen2")
    parser.add_argument("--out", type=writable_folder, default=REPO / "bench" / "results")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = save_thinker(Path(tmp) / family, family)
            for dtype in args.dtypes.split(","):
                export = Path(tmp) / f"{family}-{dtype}"
                export_model(folder, export, dtype=dtype, verify=False)
                results[f"{family} {dtype}"] = row = measure(folder, export, dtype, args.provider)
                print(f"{family} {dtype}: " + json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(
        (args.out / f"half-reference-{args.provider}.json"),
        json.dumps({"command": command_line(), "results": results}, indent=2) + "\n",
    )


if __name__ == "__main__":
    main()
