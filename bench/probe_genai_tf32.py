"""Whether onnxruntime-genai hands onnxruntime's CUDA option ``use_tf32`` on (docs/gpu-session.md, the plan's item 5).

onnxruntime's CUDA provider runs float32 MatMul in TF32 unless ``use_tf32`` is 0, which ``OnnxDecoder`` sets
(export/providers.py ``CUDA_PROVIDER``); an onnxruntime-genai user sets it with
``config.set_provider_option("cuda", "use_tf32", "0")``, if genai passes it through. This runs one float32 export
(Qwen3-0.6B's shapes, the first ``--layers`` layers, random weights) on a prompt under onnxruntime-genai, with the
provider's default and with the option at 0, and compares each run's last-position logits with onnxruntime's CPU
provider on the same graph: a run in float32 lands at float32's rounding, one in TF32 some hundred times further.

    python3 bench/gpu_kit.py run tf32                  # on the lent GPU (docs/gpu-session.md), or by hand:
    python bench/probe_genai_tf32.py --out bench/results --provider cuda

On a machine without CUDA, ``--provider cpu`` runs the same steps on the CPU (both runs at float32's rounding: a
check of the probe itself). Writes ``genai-tf32-PROVIDER.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import command_line, positive_int, writable_folder, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

# Run in onnxruntime-genai's environment: the prompt through one og.Generator per setting, the last logits out.
GENAI_RUN = """
import json, sys
import numpy as np
import onnxruntime_genai as og

folder, provider, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
found = {}
for setting in ("default", "0"):
    config = og.Config(folder)
    config.clear_providers()
    if provider == "cuda":
        config.append_provider("cuda")
        if setting != "default":
            config.set_provider_option("cuda", "use_tf32", setting)
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([ids], dtype=np.int32))
    found[setting] = np.asarray(generator.get_output("logits"), dtype=np.float32)[0, -1].tolist()
print(json.dumps(found))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=writable_folder, required=True, help="folder for genai-tf32-PROVIDER.json")
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="onnxruntime-genai's provider")
    parser.add_argument("--layers", type=positive_int, default=4, help="Qwen3-0.6B's first layers (default 4)")
    parser.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens (default 64)")
    args = parser.parse_args()

    import models
    import numpy as np
    from peer_envs import package_versions, python_of

    from export.exporter import export_model
    from export.runtime import OnnxDecoder

    thinker = models.qwen3_shaped(args.layers).thinker
    ids = np.random.default_rng(0).integers(3, 1000, size=(1, args.prompt)).tolist()[0]
    with tempfile.TemporaryDirectory(prefix="thinker-tf32-") as scratch:
        folder = Path(scratch) / "onnx"
        export_model(thinker, folder, dtype="float32", graph="fused", verify=False, progress=False)
        cpu = OnnxDecoder(folder, provider="cpu", all_positions=True).prefill(np.array([ids]), None)[0][0, -1]
        done = subprocess.run(
            [str(python_of("genai")), "-c", GENAI_RUN, str(folder), args.provider, json.dumps(ids)],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise SystemExit(f"error: onnxruntime-genai's run failed: {done.stderr.strip()[-2000:]}")
    scale = max(1.0, float(np.abs(cpu).max()))
    runs = {
        setting: {
            "max_abs_diff": float(np.abs(np.array(logits) - cpu).max()),
            "relative": float(np.abs(np.array(logits) - cpu).max()) / scale,
        }
        for setting, logits in json.loads(done.stdout).items()
    }
    result = {
        "command": command_line(),
        "provider": args.provider,
        "model": f"qwen3-0.6b shapes, first {args.layers} layers, random weights, float32, fused graph",
        "prompt_tokens": args.prompt,
        "logit_scale": scale,
        "against": "onnxruntime's CPU provider, the same graph, last position",
        "use_tf32": runs,
        "versions": package_versions("genai"),
    }
    write_result(args.out / f"genai-tf32-{args.provider}.json", json.dumps(result, indent=2) + "\n")
    for setting, figures in runs.items():
        relative = f"{figures['relative']:.2g} of the logit scale {scale:.3g}"
        print(f"use_tf32 {setting}: max |Δlogit| {figures['max_abs_diff']:.3g} ({relative})")


if __name__ == "__main__":
    main()
