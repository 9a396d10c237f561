"""Thinker against transformers' Qwen3ForCausalLM (or Qwen3_5ForCausalLM, Qwen4ExpForCausalLM): the same random
weights, fp32, the same attention backend.

Times a prefill forward pass (batch 1 x PREFILL tokens), one decode step (a token on top of the prompt's cache)
and a greedy ``generate`` of NEW tokens with the cache. ``--family qwen3`` runs a preset shaped like a real release
(default: Qwen3-0.6B); ``--family qwen3_5`` a small random Qwen3.5-shaped hybrid (linear attention in three layers
of four, output-gated full attention in the fourth, zero-centred norms, partial rotary; ``--hidden`` wide);
``--family qwen4_exp`` the same shape as Qwen3.8 (qwen4_exp): every layer MoE, four residual streams, the QSA indexer
on the attention layers (a budget of 32 tokens in blocks of 4, so that it prunes a 128-token prompt) and PLE on two
linear-attention layers.
Repetitions alternate between the two models (and swap which goes first each round), so that drift in machine load
falls on both; medians are reported, with the ratio Thinker time / reference time (the goal is at most 1.05).

    python bench/bench_model.py --threads 2 --reps 5       # from the repository root, with the package installed
    python bench/bench_model.py --layers 4 --reps 3        # a quicker, shallower run of the same shapes
    python bench/bench_model.py --family qwen3_5 --layers 8 --threads 1 --reps 9
    python bench/bench_model.py --family qwen4_exp --layers 8 --threads 1 --reps 5

Prints a table and writes JSON to bench/results/model.json (model_FAMILY.json for the hybrid families).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from results_io import command_line, machine_name, positive_int, result_file, write_result
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen4ExpForCausalLM,
    Qwen4ExpTextConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script


from thinker import ThinkerConfig, ThinkerForCausalLM  # noqa: E402
from thinker.modeling_thinker import CACHE_ARG  # noqa: E402
from thinker.presets import load_preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("qwen3", "qwen3_5", "qwen4_exp"), default="qwen3", help="the reference")
    parser.add_argument("--preset", default="qwen3-0.6b", help="a dense Qwen3-shaped preset (see thinker.presets)")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quicker runs)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the hybrid families' models")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed repetitions per model and task")
    parser.add_argument("--prefill", type=int, default=128, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated greedily")
    parser.add_argument("--attn", default="sdpa", help="attention implementation of both models")
    parser.add_argument("--output", type=result_file, default=None)
    args = parser.parse_args()
    if args.output is None:
        args.output = RESULTS / ("model.json" if args.family == "qwen3" else f"model_{args.family}.json")
    return args


def qwen3_config(config: ThinkerConfig) -> Qwen3Config:
    """The Qwen3 config of a dense, qk-normed ThinkerConfig (the field names are the same)."""
    if config.num_experts or not config.qk_norm or config.position_embedding_type != "rope":
        raise ValueError("the comparison needs a dense Qwen3-shaped preset (qk_norm, RoPE, no experts)")
    fields = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim max_position_embeddings rms_norm_eps rope_parameters hidden_act tie_word_embeddings attention_bias"
    ).split()
    return Qwen3Config(**{name: getattr(config, name) for name in fields})


def qwen3_5_configs(args: argparse.Namespace) -> tuple[Qwen3_5TextConfig, ThinkerConfig]:
    """A small Qwen3.5-shaped hybrid (the proportions of Qwen3.5's released configs, scaled to --hidden) and the
    same model as a ThinkerConfig."""
    hidden, layers = args.hidden, args.layers or 8
    reference = Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=None,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    shared = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
        "max_position_embeddings rms_norm_eps hidden_act tie_word_embeddings attention_bias layer_types "
        "linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads "
        "eos_token_id pad_token_id"
    ).split()
    thinker = ThinkerConfig(
        **{name: getattr(reference, name) for name in shared},
        rope_parameters=dict(reference.rope_parameters),
        qk_norm=True,
        attention_output_gate=True,
        norm_zero_centered=True,
    )
    return reference, thinker


def qwen4_exp_configs(args: argparse.Namespace) -> tuple[Qwen4ExpTextConfig, ThinkerConfig]:
    """A small Qwen3.8-shaped model (qwen3_5_configs' proportions, every layer MoE) with Qwen4-Exp's additions, and the
    same model as a ThinkerConfig (the converter's own translation)."""
    from converter.engine import translate_config
    from converter.families.qwen4_exp import QWEN4_EXP

    hidden, layers = args.hidden, args.layers or 8
    base, _ = qwen3_5_configs(args)
    fields = {
        key: getattr(base, key)
        for key in (
            "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
            "max_position_embeddings linear_num_key_heads linear_num_value_heads linear_key_head_dim "
            "linear_value_head_dim rope_parameters pad_token_id"
        ).split()
    }
    reference = Qwen4ExpTextConfig(
        **fields,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        hc_count=4,
        hc_lowrank=hidden // 4,
        ple_layer_ids=[1, layers - 1],
        ple_embed_dim=hidden // 2,
        heads_per_ngram=4,
        ngram_vocab_size_base=20_000,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=32,
        indexer_compress_ratio=4,
        eos_token_id=1,
    )
    return reference, translate_config(QWEN4_EXP, reference.to_dict(), torch.float32)


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    if args.family == "qwen3_5":
        reference_config, config = qwen3_5_configs(args)
    elif args.family == "qwen4_exp":
        reference_config, config = qwen4_exp_configs(args)
    else:
        config = load_preset(args.preset, **({"num_hidden_layers": args.layers} if args.layers else {}))
        config.eos_token_id = None  # every run generates exactly --new-tokens tokens
        config.pad_token_id = 0
        reference_config = qwen3_config(config)
    qwen = AutoModelForCausalLM.from_config(reference_config, attn_implementation=args.attn).eval()
    thinker = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn).eval()
    assert isinstance(qwen, (Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen4ExpForCausalLM))
    assert isinstance(thinker, ThinkerForCausalLM)
    # assign=True: the Thinker takes Qwen's tensors themselves, so both models share one copy of the weights (but
    # Qwen4-Exp's hash buffers, which the Thinker derives from its config).
    derived = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    weights = {name: tensor for name, tensor in qwen.state_dict().items() if not name.endswith(derived)}
    thinker.load_state_dict(weights, strict=True, assign=True)
    thinker.tie_weights()
    for model in (qwen, thinker):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return {args.family: qwen, "thinker": thinker}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    if hasattr(fn, "prepare"):
        fn.prepare()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(ids, use_cache=True).logits


def decode_step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One token on top of a cache of the prompt, which is cropped back after each call (constant context).

    A recurrent state cannot be cropped back, so a stateful (hybrid) model's step runs on a fresh copy of the
    prompt's cache, made before the clock starts (``timed`` calls ``prepare`` first, untimed)."""
    prompt_cache = getattr(model(ids, use_cache=True), CACHE_ARG)
    token, position = ids[:, -1:], torch.tensor([[ids.shape[1]]])
    cache = prompt_cache

    def prepare() -> None:
        nonlocal cache
        cache = copy.deepcopy(prompt_cache)

    def step() -> torch.Tensor:
        logits = model(token, position_ids=position, use_cache=True, logits_to_keep=1, **{CACHE_ARG: cache}).logits
        if not model._is_stateful:
            cache.crop(-1)
        return logits

    if model._is_stateful:
        step.prepare = prepare
    return step


def generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> Callable[[], torch.Tensor]:
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return lambda: model.generate(ids, attention_mask=mask, **kwargs)


@torch.inference_mode()
def run(args: argparse.Namespace, models: dict[str, torch.nn.Module]) -> dict:
    vocab = models["thinker"].config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prefill), generator=torch.Generator().manual_seed(0))
    tasks = {
        "prefill": {name: prefill(model, ids) for name, model in models.items()},
        "decode_step": {name: decode_step(model, ids) for name, model in models.items()},
        "generate": {name: generate(model, ids, args.new_tokens) for name, model in models.items()},
    }
    # A decode step is short, so it is sampled more often: the per-token cost with the least noise.
    reps = {"prefill": args.reps, "decode_step": 8 * args.reps, "generate": args.reps}
    # Warm-up (allocator, kernels), and the check that both do the same work and get the same answer.
    outputs = {task: {name: timed(fn)[1] for name, fn in fns.items()} for task, fns in tasks.items()}
    reference = args.family
    max_logit_diff = (outputs["prefill"]["thinker"] - outputs["prefill"][reference]).abs().max().item()
    same_tokens = torch.equal(outputs["generate"]["thinker"], outputs["generate"][reference])

    samples = {task: {name: [] for name in models} for task in tasks}
    for rep in range(max(reps.values())):
        order = list(models) if rep % 2 == 0 else list(reversed(models))
        for task, fns in tasks.items():
            for name in order if rep < reps[task] else ():
                samples[task][name].append(timed(fns[name])[0])
    return {"samples_s": samples, "max_abs_logit_diff": max_logit_diff, "same_generated_tokens": same_tokens}


def summarise(args: argparse.Namespace, models: dict, measured: dict) -> dict:
    config, reference = models["thinker"].config, args.family
    rows = {}
    for task, by_model in measured["samples_s"].items():
        median = {name: statistics.median(times) for name, times in by_model.items()}
        rows[task] = {
            "thinker_median_s": median["thinker"],
            f"{reference}_median_s": median[reference],
            "ratio": median["thinker"] / median[reference],
        }
    for name in ("thinker", reference):
        rows["generate"][f"{name}_tokens_per_s"] = args.new_tokens / rows["generate"][f"{name}_median_s"]
    return {
        "family": reference,
        "preset": args.preset if reference == "qwen3" else f"{reference}-shaped, hidden {args.hidden}",
        "num_hidden_layers": config.num_hidden_layers,
        "parameters": sum(p.numel() for p in models["thinker"].parameters()),
        "dtype": "float32",
        "attn_implementation": args.attn,
        "prefill_tokens": args.prefill,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "threads": args.threads,
        "results": rows,
        "max_abs_logit_diff": measured["max_abs_logit_diff"],
        "same_generated_tokens": measured["same_generated_tokens"],
        "samples_s": measured["samples_s"],
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "cpu": machine_name(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average": os.getloadavg(),
        },
    }


def print_table(report: dict) -> None:
    print(
        f"\n{report['preset']} ({report['num_hidden_layers']} layers, {report['parameters'] / 1e6:.0f} M parameters), "
        f"fp32, {report['attn_implementation']}, {report['threads']} threads, "
        f"median of {report['reps']} (decode step: of {8 * report['reps']})"
    )
    reference = report["family"]
    print(f"{'task':<34}{'Thinker s':>12}{reference + ' s':>12}{'ratio':>9}")
    labels = {
        "prefill": f"prefill 1 x {report['prefill_tokens']}",
        "decode_step": f"decode 1 token, {report['prefill_tokens']} cached",
        "generate": f"greedy generate {report['new_tokens']} tokens",
    }
    for task, row in report["results"].items():
        reference_s = row[f"{reference}_median_s"]
        print(f"{labels[task]:<34}{row['thinker_median_s']:>12.4f}{reference_s:>12.4f}{row['ratio']:>9.3f}")
    print(
        f"max |Δlogit| {report['max_abs_logit_diff']:.2e}; same generated tokens: {report['same_generated_tokens']}; "
        f"load average {report['machine']['load_average'][0]:.1f}"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = build_models(args)
    report = {"command": command_line()} | summarise(args, models, run(args, models))
    print_table(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.output, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
