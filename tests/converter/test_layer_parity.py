"""Parity layer by layer (``converter/layer_parity.py`` over ``converter/streamed.py``): both models run one unit at a
time from their own files; every Thinker layer runs on the reference's input to that layer.

- an altered tensor of one layer is named by ``thinker verify --verify-by-layer``, for a dense, an MoE (per-expert
  source tensors, fused by transformers' own loading conversion) and a GGUF source (llama, and Qwen2-MoE's stacked
  experts);
- on passing models, layer mode reaches the whole-model check's verdict and figures;
- ``thinker-convert`` switches to layer mode by itself when the memory budget is too small, and a failed layer
  check installs nothing;
- references that are not transformers classes (μOmni, LLMs-from-scratch) run the same way;
- the peak resident set of a layer-mode check stays within the idle process + 4 x the largest layer (a subprocess,
  on a model of a few hundred MB whose two copies would not fit that bound).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
import torch
from click.testing import CliRunner
from convert_helpers import build_reference, save_unfused_experts, write_gguf
from hybrid_gguf import write_hybrid_gguf
from references import hybrid, uomni
from references import llms_from_scratch_qwen3 as scratch
from safetensors.torch import load_file, save_file
from transformers import (
    GPT2Config,
    LlamaConfig,
    Qwen2MoeConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextForCausalLM,
)

import thinker.modeling_thinker
from converter import engine
from converter.cli import convert_command, verify_command
from converter.convert import source_family
from converter.layer_parity import compare_by_layer, load_layered_converted
from converter.model_card import parity_section
from converter.parity import MEMORY_BUDGET_ENV, check_parity, parity_mode, whole_model_bytes
from converter.parity_report import BY_LAYER, WHOLE_MODEL, ParityFailed
from converter.streamed import StreamedModel, lazy_tensors
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import fixed_prompts
from thinker_common.sources import open_source

REPO = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
QWEN3 = Qwen3Config(**TINY, num_hidden_layers=3, head_dim=8, tie_word_embeddings=True)
QWEN3_MOE = Qwen3MoeConfig(
    **TINY, num_hidden_layers=3, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
)
QWEN2_MOE = Qwen2MoeConfig(
    **TINY,
    num_hidden_layers=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
)
GPT2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
LLAMA = LlamaConfig(**TINY, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=True)


def save_source(config, folder: Path) -> Path:
    """A tiny reference checkpoint; MoE ones in the per-expert layout of Hub checkpoints."""
    model = build_reference(config)
    if "moe" in config.model_type:
        return save_unfused_experts(model, folder)
    model.save_pretrained(folder)
    return folder


def cli(command, *arguments: str | Path):
    return CliRunner().invoke(command, [str(argument) for argument in arguments])


def alter(folder: Path, name: str, factor: float = 1.5) -> None:
    weights = load_file(folder / "model.safetensors")
    weights[name] = weights[name] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def stages(folder: Path, report_file: str = "parity.json") -> dict[str, dict]:
    """The stages of ``folder``'s report: parity.json, or a failing ``thinker verify``'s parity.failed.json."""
    report = json.loads((folder / report_file).read_text())
    assert report["mode"] == BY_LAYER
    return {stage["name"]: stage for stage in report["results"][0]["layers"]}


# --- an altered layer is named ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "altered"),
    [(QWEN3, "model.layers.1.mlp.down_proj.weight"), (QWEN3_MOE, "model.layers.1.mlp.experts.gate_up_proj")],
    ids=["dense", "moe"],
)
def test_verify_by_layer_names_the_altered_layer(config, altered, tmp_path):
    source, converted = save_source(config, tmp_path / "source"), tmp_path / "out"
    # the conversion's own check runs layer by layer when asked (the flag dropped passed every check, a mutation run)
    assert cli(convert_command, source, converted, "--verify-by-layer").exit_code == 0
    assert json.loads((converted / "parity.json").read_text())["mode"] == "layer-by-layer"

    passed = cli(verify_command, source, converted, "--verify-by-layer")
    assert passed.exit_code == 0, passed.output
    assert "parity (layer-by-layer)" in passed.stdout
    assert [name for name in stages(converted)] == ["embeddings", "layer 0", "layer 1", "layer 2", HEAD_STAGE]
    assert all(stage["passed"] and stage["max_abs_diff"] == 0 for stage in stages(converted).values())

    alter(converted, altered)
    failed = cli(verify_command, source, converted, "--verify-by-layer")
    assert failed.exit_code == 1
    assert "FAIL (first divergence: layer 1)" in failed.stdout
    assert "does not match its reference" in failed.stderr
    recorded = stages(converted, "parity.failed.json")
    assert recorded["layer 0"]["passed"] and recorded["layer 0"]["max_abs_diff"] == 0
    assert not recorded["layer 1"]["passed"]
    assert recorded["layer 1"]["max_abs_diff"] > recorded["layer 1"]["tolerance"] > 0
    assert recorded["layer 1"]["mean_abs_diff"] > 0
    # Layer 2 runs on the reference's input, so its own figure is clean although the Thinker's stream is not.
    assert recorded["layer 2"]["passed"] and recorded["layer 2"]["stream_max_abs_diff"] > 0


HEAD_STAGE = "final norm and head"


@pytest.mark.parametrize(
    ("config", "architecture", "altered"),
    [
        (LLAMA, "llama", "model.layers.1.self_attn.q_proj.weight"),
        (QWEN2_MOE, "qwen2moe", "model.layers.1.mlp.experts.gate_up_proj"),
        (QWEN2_MOE, "qwen2moe", "model.layers.1.mlp.shared_expert_gate.weight"),
    ],
    ids=["llama-q", "qwen2moe-experts", "qwen2moe-shared-gate"],
)
def test_verify_by_layer_names_the_altered_layer_of_a_gguf_source(config, architecture, altered, tmp_path):
    """llama.cpp's permuted q/k rows, and its stacked experts (gate and up merged) and vector shared-expert gate,
    made by transformers' own GGUF tensor processing one Hugging Face tensor at a time."""
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(build_reference(config), folder / f"tiny-{architecture}.gguf", architecture)
    converted = tmp_path / "out"
    assert cli(convert_command, path, converted, "--no-verify").exit_code == 0
    passed = cli(verify_command, path, converted, "--verify-by-layer")
    assert passed.exit_code == 0, passed.output
    assert all(stage["max_abs_diff"] == 0 for stage in stages(converted).values())
    alter(converted, altered, 1.1)
    failed = cli(verify_command, path, converted, "--verify-by-layer")
    assert failed.exit_code == 1 and "first divergence: layer 1" in failed.stdout


@pytest.mark.parametrize("architecture", ["llama", "qwen35"])
def test_the_layer_references_blocks_are_not_the_converters(architecture, tmp_path, run_convert, monkeypatch):
    """The layer-by-layer reference dequantizes a GGUF file's blocks with the functions transformers' own loading
    runs (gguf's for llama, its own for Qwen3.5), not with the converter's ``dequantized``: sharing it, a slip there
    (every tensor's last block dropped) passed the check by layer, 1.25 of the logit scale off (a mutation run). With
    a slip planted in the converter's reading (every value 1 % large, as from a block scale misread), the check
    fails."""
    import converter.families.gguf
    import thinker_common.gguf_reader as gguf_reader

    (tmp_path / "gguf").mkdir()
    if architecture == "llama":
        path = write_gguf(build_reference(LLAMA), tmp_path / "gguf" / "q8.gguf", "llama", quantization="Q8_0")
    else:
        model = hybrid.reference(Qwen3_5ForCausalLM, hybrid.qwen3_5_config())
        path = write_hybrid_gguf(model, tmp_path / "gguf" / "q8.gguf", quantization="Q8_0")
    assert run_convert(path, "exact", verify_by_layer=True).parity.passed
    read = gguf_reader.dequantized

    def scale_misread(data, kind):  # alike on whatever piece of a tensor it is called; the file's blocks are Q8_0
        return read(data, kind) * (1.01 if kind == gguf.GGMLQuantizationType.Q8_0 else 1.0)

    monkeypatch.setattr(gguf_reader, "dequantized", scale_misread)
    # and where the reference once took it by name, so that a reference sharing the reading again fails this test
    monkeypatch.setattr(converter.families.gguf, "dequantized", scale_misread, raising=False)
    with pytest.raises(ThinkerError, match="does not match its reference"):
        run_convert(path, "slipped", verify_by_layer=True)


# --- layer mode agrees with the whole-model check ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", [QWEN3, QWEN3_MOE, QWEN2_MOE, GPT2, LLAMA], ids=lambda c: c.model_type)
def test_layer_mode_agrees_with_whole_model_mode(config, dtype, tmp_path, run_convert):
    source = save_source(config, tmp_path / "source")
    result = run_convert(source, dtype=dtype)
    whole = result.parity
    by_layer = check_parity(source, result.output, source_family(source), BY_LAYER)
    assert whole.mode == WHOLE_MODEL and by_layer.mode == BY_LAYER
    assert whole.passed and by_layer.passed, by_layer.table()
    assert (by_layer.reference, by_layer.converted) == (whole.reference, whole.converted)
    assert [r.dtype for r in by_layer.results] == [r.dtype for r in whole.results]
    for layered, complete in zip(by_layer.results, whole.results, strict=True):
        assert layered.logit_scale == pytest.approx(complete.logit_scale, rel=1e-6)
        assert layered.tolerance == pytest.approx(complete.tolerance, rel=1e-6)
        assert layered.top1_agreement == complete.top1_agreement == 1.0
        assert layered.max_abs_diff <= complete.tolerance and complete.max_abs_diff <= complete.tolerance
        assert len(layered.layers) == config.num_hidden_layers + 2  # embeddings, every layer, final norm and head
        assert layered.greedy_identical is None and complete.greedy_identical == complete.greedy_prompts
    # the model card and parity.json say what each mode ran: layer by layer, no continuation ("—" in the table)
    card, layered_card = parity_section(whole, ""), parity_section(by_layer, "")
    assert "and greedy continuations" in card and "every greedy continuation (8 tokens) identical" in card
    assert "no greedy continuations, layer by layer" in layered_card and "each stage within" in layered_card
    rule = "max |Δlogit| ≤ 0.0001 × max(1, the logit scale)" if dtype == "float32" else "top-1 agreement ≥ 90%"
    assert rule in card and rule in layered_card
    assert json.loads(whole.to_json())["greedy_tokens"] == 8 and json.loads(by_layer.to_json())["greedy_tokens"] is None


# --- hybrid linear attention: the 2-D padding mask and the recurrent state come from each model's own forward ------

HYBRID = {
    "qwen3_5": (Qwen3_5ForCausalLM, hybrid.qwen3_5_config),
    "qwen3_5-vl": (Qwen3_5ForConditionalGeneration, hybrid.qwen3_5_vl_config),
    "qwen3_next": (Qwen3NextForCausalLM, hybrid.qwen3_next_config),
}


def save_hybrid(name: str, folder: Path) -> Path:
    model_class, config = HYBRID[name]
    hybrid.reference(model_class, config()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_layer_mode_agrees_and_names_an_altered_linear_attention_layer(name, tmp_path, run_convert):
    """Layers 0 and 2 are Gated DeltaNet, 1 and 3 full attention (``references.hybrid.LAYER_TYPES``)."""
    source = save_hybrid(name, tmp_path / "source")
    result = run_convert(source)
    by_layer = check_parity(source, result.output, source_family(source), BY_LAYER)
    assert result.parity.passed and by_layer.passed, by_layer.table()
    assert by_layer.reference == result.parity.reference
    assert by_layer.results[0].max_abs_diff <= result.parity.results[0].tolerance

    alter(result.output, "model.layers.2.linear_attn.out_proj.weight", 1.1)
    failed = cli(verify_command, source, result.output, "--verify-by-layer")
    assert failed.exit_code == 1 and "first divergence: layer 2" in failed.stdout, failed.output
    recorded = stages(result.output, "parity.failed.json")
    assert recorded["layer 1"]["passed"] and recorded["layer 3"]["passed"] and not recorded["layer 2"]["passed"]


def test_layer_mode_catches_padding_leaking_into_the_recurrent_state(tmp_path, run_convert, monkeypatch):
    """A Thinker whose linear-attention layers let left padding into their state: on the reference's own hidden
    states, the first Gated DeltaNet layer already differs at real tokens."""
    source = save_hybrid("qwen3_next", tmp_path / "source")
    output = run_convert(source).output
    monkeypatch.setattr(thinker.modeling_thinker, "apply_mask_to_padding_states", lambda states, mask: states)
    report = check_parity(source, output, source_family(source), BY_LAYER)
    assert not report.passed and report.results[0].first_divergence == "layer 0"


# --- the automatic switch, and nothing installed on failure ------------------------------------------------------


def test_convert_switches_to_layer_mode_when_the_budget_is_too_small(tmp_path, monkeypatch):
    source = save_source(QWEN3, tmp_path / "source")
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "1KB")
    result = cli(convert_command, source, tmp_path / "small")
    assert result.exit_code == 0, result.output
    assert "verifying layer by layer" in result.stderr and MEMORY_BUDGET_ENV in result.stderr
    assert json.loads((tmp_path / "small" / "parity.json").read_text())["mode"] == BY_LAYER
    # a failing check says why it ran layer by layer too (it said so only on passing: a QA run)
    bad = shutil.copytree(tmp_path / "small", tmp_path / "bad")
    alter(bad, "model.layers.1.mlp.down_proj.weight", 1.1)
    failed = cli(verify_command, source, bad)
    assert failed.exit_code == 1 and "first divergence: layer 1" in failed.stdout, failed.output
    assert "verifying layer by layer" in failed.stderr and MEMORY_BUDGET_ENV in failed.stderr, failed.output

    monkeypatch.setenv(MEMORY_BUDGET_ENV, "100GB")
    result = cli(convert_command, source, tmp_path / "large")
    assert result.exit_code == 0 and "layer by layer" not in result.output
    assert json.loads((tmp_path / "large" / "parity.json").read_text())["mode"] == WHOLE_MODEL

    monkeypatch.setenv(MEMORY_BUDGET_ENV, "lots")
    refused = cli(convert_command, source, tmp_path / "refused")
    assert refused.exit_code == 1 and f"{MEMORY_BUDGET_ENV}='lots'" in refused.stderr
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "0.5")  # a byte count, refused for its own reason
    refused = cli(convert_command, source, tmp_path / "refused")
    assert refused.exit_code == 1 and f"{MEMORY_BUDGET_ENV}='0.5': size '0.5' is less than one byte" in refused.stderr
    # read whatever mode the check takes: layer by layer, asked for, never read it (a QA run); --no-verify does not
    monkeypatch.setenv(MEMORY_BUDGET_ENV, "lots")
    for command, args in [(convert_command, ("--verify-by-layer",)), (verify_command, ("--verify-by-layer",))]:
        target = tmp_path / ("refused" if command is convert_command else "small")
        refused = cli(command, source, target, *args)
        assert refused.exit_code == 1 and f"{MEMORY_BUDGET_ENV}='lots': size 'lots' is not a size" in refused.stderr
    assert cli(convert_command, source, tmp_path / "unchecked", "--no-verify").exit_code == 0


def test_budget_as_a_parameter(tmp_path, run_convert):
    source = save_source(QWEN3, tmp_path / "source")
    assert run_convert(source, "small", memory_budget=1).parity.mode == BY_LAYER
    assert run_convert(source, "large", memory_budget=10**12).parity.mode == WHOLE_MODEL


def test_the_mode_counts_the_prompts_logits():
    """At a 152k vocabulary the gate's logits outweigh a small model's weights: a budget that holds both models in
    float32 twice over but not the logits takes the layer check."""
    from thinker import ThinkerConfig

    config = ThinkerConfig(**{**TINY, "vocab_size": 151936}, num_hidden_layers=2, head_dim=8)
    parameters = 5_000_000
    assert parity_mode(parameters, config, budget=2 * 8 * parameters)[0] == BY_LAYER
    assert parity_mode(parameters, config, budget=whole_model_bytes(parameters, config))[0] == WHOLE_MODEL


def test_failed_layer_check_installs_nothing(tmp_path, run_convert, monkeypatch):
    """A converter that miswrites one tensor (simulated here) is caught layer by layer, and OUTPUT never appears."""
    source = save_source(QWEN3_MOE, tmp_path / "source")
    finish = engine.finish_tensor

    def miswrite(tensor, target, sources, dtype, **options):
        tensor = finish(tensor, target, sources, dtype, **options)
        return tensor * 1.5 if target == "model.layers.2.mlp.experts.down_proj" else tensor

    monkeypatch.setattr(engine, "finish_tensor", miswrite)
    with pytest.raises(ParityFailed, match="does not match its reference") as failed:
        run_convert(source, verify_by_layer=True)
    assert failed.value.report.results[0].first_divergence == "layer 2"
    assert not (tmp_path / "out").exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".out.partial")]


def test_no_verify_and_verify_by_layer_contradict(tmp_path):
    source = save_source(QWEN3, tmp_path / "source")
    result = cli(convert_command, source, tmp_path / "out", "--no-verify", "--verify-by-layer")
    assert result.exit_code == 1 and "--no-verify" in result.stderr
    assert not (tmp_path / "out").exists()


# --- references that are not transformers classes ----------------------------------------------------------------


def plain_reference(model_class, config, folder: Path, layer_class) -> StreamedModel:
    """A reference implementation built on the meta device, its ``.pt`` state dict read one block at a time; it
    takes no attention mask, so it is fed one prompt at a time."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(config)
    source = open_source(folder)
    return StreamedModel(
        model,
        lazy_tensors(source),
        layer_classes=(layer_class,),
        call=lambda module, ids, mask, positions: module(ids),
        takes_padding=False,
        close=source.close,
    )


@pytest.mark.parametrize("family", ["uomni", "llms_from_scratch_qwen3"])
def test_references_without_a_transformers_class_run_layer_by_layer(family, tmp_path):
    if family == "uomni":
        config = uomni.tiny_config(gqa=True)
        source = uomni.save_checkpoint(uomni.randomize_(uomni.ThinkerLM(config)), tmp_path / "source")
        reference = lambda: plain_reference(uomni.ThinkerLM, config, source, uomni.Block)  # noqa: E731
    else:
        config = scratch.tiny_config()
        source = scratch.save_checkpoint(scratch.randomize_(scratch.Qwen3Model(config)), tmp_path / "source")
        reference = lambda: plain_reference(scratch.Qwen3Model, config, source, scratch.TransformerBlock)  # noqa: E731
    converted = tmp_path / "out"
    assert cli(convert_command, source, converted).exit_code == 0
    prompts = fixed_prompts(config.vocab_size if family == "uomni" else config["vocab_size"])

    result = compare_by_layer(reference(), load_layered_converted(converted, torch.float32), prompts, torch.float32)
    assert result.passed and [layer.name for layer in result.layers][1:3] == ["layer 0", "layer 1"]
    assert result.max_abs_diff <= 1e-5

    alter(converted, "model.layers.1.self_attn.v_proj.weight", 1.2)  # k and q are normalised (qk-norm)
    result = compare_by_layer(reference(), load_layered_converted(converted, torch.float32), prompts, torch.float32)
    assert not result.passed and result.first_divergence == "layer 1"


# --- memory ------------------------------------------------------------------------------------------------------

# What both memory probes run first: /proc's figures, and the two folders from the command line.
PROBE_PRELUDE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def forget_the_peak():  # the peak so far (imports, loading) is forgotten: VmHWM := VmRSS
        Path("/proc/self/clear_refs").write_text("5")
        return status("VmRSS")

    source, converted = Path(sys.argv[1]), Path(sys.argv[2])
    """
)

RSS_PROBE = PROBE_PRELUDE + textwrap.dedent(
    """
    from converter.convert import source_family
    from converter.layer_parity import check_parity_by_layer, converted_dtype, load_layered_converted

    family = source_family(source)
    largest = load_layered_converted(converted, converted_dtype(converted)).largest_unit_bytes()
    idle = forget_the_peak()
    report = check_parity_by_layer(source, converted, family)
    print(json.dumps({"idle": idle, "peak": status("VmHWM"), "largest": largest, "passed": report.passed}))
    """
)


def run_probe(probe: str, source: Path, converted: Path) -> dict:
    """``probe`` in a fresh process (its peak resident set its own), what it prints as JSON."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    command = [sys.executable, "-c", probe, str(source), str(converted)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_layer_mode_peak_rss_is_bounded_by_four_layers(tmp_path):
    """Four float32 layers of 64 MB (256 MB a model): both models side by side would need 8 layers' bytes; layer by
    layer the peak stays within the idle process + 4 x the largest layer, the gate's batch of 564 slots included
    (671 MiB against 653 before the check fixed glibc's malloc thresholds, converter/streamed.py; 573 with them)."""
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        tie_word_embeddings=True,
    )
    source = save_source(config, tmp_path / "source")
    assert cli(convert_command, source, tmp_path / "out", "--no-verify").exit_code == 0
    measured = run_probe(RSS_PROBE, source, tmp_path / "out")
    print(measured)
    layer = 4 * (4 * 1024 * 1024 + 3 * 1024 * 4096)
    assert measured["passed"] and measured["largest"] >= layer
    bound = measured["idle"] + 4 * measured["largest"]
    assert measured["peak"] <= bound, f"peak {measured['peak'] / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"
    assert 2 * 4 * layer > 4 * measured["largest"]  # the bound is below what two whole models would take


WHOLE_RSS_PROBE = PROBE_PRELUDE + textwrap.dedent(
    """
    from converter.convert import folder_parameters
    from converter.parity import check_parity, whole_model_bytes
    from thinker import ThinkerConfig

    config = ThinkerConfig.from_pretrained(converted)
    parameters = folder_parameters(converted)
    idle = forget_the_peak()
    report = check_parity(source, converted)
    estimate = whole_model_bytes(parameters, config)
    print(json.dumps({"idle": idle, "peak": status("VmHWM"), "estimate": estimate, "weights": 8 * parameters,
                      "passed": report.passed}))
    """
)


@pytest.mark.slow
def test_whole_model_peak_rss_is_within_what_the_mode_choice_counts(tmp_path):
    """The whole-model check is chosen when ``whole_model_bytes`` fits the budget, so its peak must stay within it.
    At a 152k vocabulary (Qwen's) the gate's batch of logits outweighs a small model: 1.4 GiB above the idle
    process, where both models in float32 were the whole count (37 MiB), before the count took the logits in and
    the check kept only the real positions' (0.71 GiB since)."""
    config = Qwen3Config(**{**TINY, "vocab_size": 151936}, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True)
    source = save_source(config, tmp_path / "source")
    assert cli(convert_command, source, tmp_path / "out", "--no-verify").exit_code == 0
    measured = run_probe(WHOLE_RSS_PROBE, source, tmp_path / "out")
    print({key: value / 2**20 if key != "passed" else value for key, value in measured.items()})
    used = measured["peak"] - measured["idle"]
    assert measured["passed"] and used > 4 * measured["weights"]  # the logits, not the weights, are the peak
    assert used <= measured["estimate"], f"peak {used / 2**20:.0f} MiB > {measured['estimate'] / 2**20:.0f} MiB"


@pytest.mark.parametrize("by_layer", [False, True], ids=["whole", "by layer"])
def test_a_model_that_overflows_the_dtype_is_said_to(by_layer, tmp_path):
    """Weights within float16's range whose activations are not (norm weights of 200, a wide MLP): transformers'
    own class computes inf from the first layer on, so nothing is compared; not "does not match its reference" at
    a layer whose every figure is NaN, but what happened and which dtype to convert to."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layernorm" in name or name == "model.norm.weight":
                parameter.fill_(200.0)
            elif "mlp" in name:
                parameter.normal_(0, 3.0)
    model.save_pretrained(tmp_path / "source")
    options = ["--dtype", "float16", *(["--verify-by-layer"] if by_layer else [])]
    result = cli(convert_command, tmp_path / "source", tmp_path / "out", *options)
    assert result.exit_code == 1, result.output
    assert "transformers' own Qwen3ForCausalLM computes inf or NaN in float16 on the parity prompts (from layer 0" in (
        result.stderr
    )
    assert "the model overflows float16; convert with --dtype bfloat16 or float32" in result.stderr
    assert not (tmp_path / "out").exists()
    assert cli(convert_command, tmp_path / "source", tmp_path / "bf16", "--dtype", "bfloat16").exit_code == 0
