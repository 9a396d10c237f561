"""One rank of the tensor-parallel check (launched by ``tests/test_distributed.py`` under ``torchrun``).

For each saved Thinker folder given, loads it with the model's own tensor-parallel plan (``tp_plan="auto"``) on
CPU, runs one forward pass over fixed token ids and, on rank 0, saves the logits and the local (per-rank) shape of
every parameter to ``OUT_DIR/<folder name>-<experts implementation>.pt``. A folder with experts is run with each
experts implementation (Thinker's own loop, "eager", and transformers' "grouped_mm").

transformers initialises the process group itself from torchrun's RANK / LOCAL_RANK / WORLD_SIZE, with the gloo
backend because the accelerator is the CPU.

    torchrun --standalone --nproc-per-node 2 tests/tp_worker.py OUT_DIR FOLDER [FOLDER ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

import thinker  # noqa: F401  (registers the Thinker classes with the Auto factories)

INPUT_IDS = torch.arange(3, 3 + 2 * 7).reshape(2, 7)  # the same ids on every rank, as TP expects


def run(folder: Path, experts_implementation: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        distributed_config=DistributedConfig(tp_plan="auto"),
        experts_implementation=experts_implementation,
    )
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    local_shapes = {
        name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for name, p in model.named_parameters()
    }
    return {"input_ids": INPUT_IDS, "logits": logits, "local_shapes": local_shapes, "tp_size": model.tp_size}


def main(out_dir: str, *folders: str) -> None:
    for folder in map(Path, folders):
        has_experts = AutoConfig.from_pretrained(folder).num_experts > 0
        for experts_implementation in ("eager", "grouped_mm") if has_experts else ("eager",):
            result = run(folder, experts_implementation)
            if dist.get_rank() == 0:
                torch.save(result, Path(out_dir) / f"{folder.name}-{experts_implementation}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
