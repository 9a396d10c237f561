"""onnxruntime on CUDA: float16 parity, the KV cache kept on the device by IO binding, bfloat16 verification; for the
hybrid models also the linear-attention states kept on the device and onnxruntime-genai's CUDA build. Skipped where
there is no GPU; failed where one is visible but a CUDA session does not run (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from export_helpers import HYBRID_FAMILIES, record_parity

import export.providers
from export.exporter import export_model
from export.runtime import OnnxDecoder
from export.verify import compare_decoders
from thinker_common.parity_inputs import parity_batch

pytestmark = pytest.mark.gpu  # run, skipped (no GPU) or failed (a GPU CUDA cannot use): tests/conftest.py


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "gpt2"])
def test_cuda_float16_parity(family, thinker_folder, onnx_folder, record_property):
    """The float16 graph on CUDA against the PyTorch model in float32: top-1 agreement, logits close."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_folder(family)).eval()
    decoder = OnnxDecoder(onnx_folder(family, "float16"), provider="cuda")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)
    record_parity(record_property, figures)
    assert figures["top1_agreement"] >= 0.9, figures
    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures


def test_io_binding_keeps_the_cache_on_the_device(onnx_folder):
    cuda = OnnxDecoder(onnx_folder("qwen3"), provider="cuda")
    cpu = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    input_ids, attention_mask = parity_batch(96)
    _, cuda_state = cuda.prefill(input_ids, attention_mask)
    cpu_logits, cpu_state = cpu.prefill(input_ids, attention_mask)
    token = cpu_logits[:, -1].argmax(-1)
    for _ in range(3):
        assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in cuda_state.cache.values())
        cuda_logits, cpu_logits = cuda.decode_one_token(token, cuda_state), cpu.decode_one_token(token, cpu_state)
        # float32 on both (OnnxDecoder turns CUDA's TF32 off: export/providers.py CUDA_PROVIDER)
        np.testing.assert_allclose(cuda_logits, cpu_logits, rtol=0, atol=1e-4 * max(1.0, np.abs(cpu_logits).max()))
        token = cpu_logits.argmax(-1)
    assert cuda_state.cache["past_key_values.0.key"].shape()[2] == input_ids.shape[1] + 3


def test_cuda_bfloat16_export_verifies(thinker_folder, tmp_path, record_property):
    report = export_model(thinker_folder("qwen3_moe"), tmp_path / "bf16", dtype="bfloat16", verify=True)
    record_parity(record_property, report["verify"])
    assert report["verify"]["provider"] == "cuda"
    assert report["verify"]["passed"] is True, report["verify"]


def test_cuda_generate_runs_greedy(onnx_folder):
    prompt = np.array([[5, 9, 17, 33]], dtype=np.int64)
    cuda = OnnxDecoder(onnx_folder("qwen3", "float16"), provider="cuda").generate(prompt, max_new_tokens=8)
    cpu = OnnxDecoder(onnx_folder("qwen3", "float32"), provider="cpu").generate(prompt, max_new_tokens=8)
    assert cuda.shape == (1, 12)
    assert cuda[0, 4] == cpu[0, 4]  # the first new token; half precision may part ways later, on a near-tie


def test_cuda_generate_runs_the_genai_graph(onnx_variant):
    """`thinker generate --provider cuda` runs model.genai.onnx (``generation_graph``: no padding bias) and says so;
    on its one unpadded prompt that graph gives model.onnx's logits at the last position (the one it puts through
    the head) on CUDA within float16's tolerance, and the same first token."""
    from click.testing import CliRunner

    from export.names import GENAI_MODEL_FILE
    from thinker_common.cli import main
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE

    folder = onnx_variant("qwen3", "float16")
    result = CliRunner().invoke(
        main, ["generate", str(folder), "--prompt", "the cat sat", "-n", "4", "--provider", "cuda"]
    )
    assert result.exit_code == 0, result.output
    assert f"onnxruntime (cuda, {GENAI_MODEL_FILE})" in result.stderr
    prompt = np.array([[5, 9, 17, 33, 4, 21]], dtype=np.int64)
    genai, padded = OnnxDecoder(folder / GENAI_MODEL_FILE, provider="cuda"), OnnxDecoder(folder, provider="cuda")
    actual, expected = (d.prefill(prompt, np.ones_like(prompt))[0][:, -1].astype(np.float32) for d in (genai, padded))
    scale = float(np.abs(expected).max())
    assert np.abs(actual - expected).max() <= RELATIVE_TOLERANCE[torch.float16] * max(1.0, scale)
    assert actual.argmax(-1) == expected.argmax(-1)


def test_cuda_plain_moe_decode_path_equals_its_expert_loop(onnx_variant):
    """The plain graph's two MoE paths on CUDA, float16: one-token steps gather their picked experts at once (a
    Gather of the expert stack and a batched MatMul), a 24-token step visits them in the Loop; each token's logits
    agree within float16's tolerance (the paths sum the experts in different orders)."""
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE

    decoder = OnnxDecoder(onnx_variant("qwen3_moe", "float16", graph="plain"), provider="cuda")
    tokens = np.arange(24, dtype=np.int64)[:, None]  # 24 one-token rows
    loop = decoder.prefill(tokens, np.ones_like(tokens))[0].astype(np.float32)
    picked = np.concatenate([decoder.prefill(row[None], np.ones_like(row[None]))[0] for row in tokens])
    tolerance = RELATIVE_TOLERANCE[torch.float16] * max(1.0, float(np.abs(loop).max()))
    np.testing.assert_allclose(picked.astype(np.float32), loop, rtol=0, atol=tolerance)


# --- hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) ----------------------------------------------------------------
@pytest.mark.parametrize("graph", ["plain", "fused"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_cuda_float16_hybrid_parity(family, graph, thinker_variant, onnx_variant, record_property):
    """The float16 hybrid graph on CUDA (recurrence and recurrent state float32) against the float16 PyTorch model
    on CPU: the export's float16 tolerance, and every state an OrtValue on the device from step to step."""
    from thinker import ThinkerForCausalLM
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE

    model = ThinkerForCausalLM.from_pretrained(thinker_variant(family), dtype=torch.float16).eval()
    decoder = OnnxDecoder(onnx_variant(family, "float16", graph=graph, head_dim=None), provider="cuda")
    figures = compare_decoders(model, decoder, *parity_batch(96), steps=6)
    record_parity(record_property, figures)
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float16] * max(1.0, figures["logit_scale"]), figures
    assert figures["top1_agreement"] >= 0.9, figures
    _, state = decoder.prefill(*parity_batch(96))
    assert {n.rsplit(".", 1)[1] for n in state.cache} == {"key", "value", "conv_state", "recurrent_state"}
    assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in state.cache.values())


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_cuda_float16_hybrid_long_prompt_parity(graph, thinker_variant, onnx_variant, record_property):
    """A 70-token row beside a 13-token one padded by 57 on CUDA: the plain graph's delta rule takes such a prompt
    in chunks (an If and a Scan over chunks, export/chunked_delta_rule.py), the fused graph as ever; both within the
    float16 tolerance of the float16 PyTorch model, prefill and 6 decode steps."""
    from thinker import ThinkerForCausalLM
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE

    rng = np.random.default_rng(0)
    input_ids, attention_mask = np.zeros((2, 70), np.int64), np.zeros((2, 70), np.int64)
    for row, length in enumerate((70, 13)):
        input_ids[row, 70 - length :] = rng.integers(3, 96, size=length)
        attention_mask[row, 70 - length :] = 1
    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3_5"), dtype=torch.float16).eval()
    decoder = OnnxDecoder(onnx_variant("qwen3_5", "float16", graph=graph, head_dim=None), provider="cuda")
    figures = compare_decoders(model, decoder, input_ids, attention_mask, steps=6)
    record_parity(record_property, figures)
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float16] * max(1.0, figures["logit_scale"]), figures
    assert figures["top1_agreement"] >= 0.9, figures


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_cuda_qwen4_exp_parity_and_states_on_the_device(
    graph, thinker_variant, onnx_variant, record_property, monkeypatch
):
    """Qwen3.8 (hyper-connections, PLE, the indexer) in float32 on CUDA against the PyTorch Thinker, on prompts its
    indexers prune: every state, the int64 n-gram contexts and index positions included, an OrtValue on the device.
    Float32's tolerance holds with TF32 off, as OnnxDecoder runs CUDA; the figures with onnxruntime's default (TF32
    on, which flips near-ties among the indexer's scores: 0.50 on an H200) are recorded beside them."""
    from thinker import ThinkerForCausalLM
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE, indexer_batch

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen4_exp"), dtype=torch.float32).eval()
    folder = onnx_variant("qwen4_exp", graph=graph, head_dim=None)
    decoder = OnnxDecoder(folder, provider="cuda")
    batch = indexer_batch(model.config)
    figures = compare_decoders(model, decoder, *batch, steps=6)
    record_parity(record_property, figures)
    monkeypatch.setattr(export.providers, "CUDA_PROVIDER", (export.providers.CUDA, {"use_tf32": "1"}))
    with_tf32 = compare_decoders(model, OnnxDecoder(folder, provider="cuda"), *batch, steps=6)
    record_property("tf32_max_abs_diff", f"{with_tf32['max_abs_diff']:.6g}")
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"]), figures
    _, state = decoder.prefill(*batch)
    kinds = {n.rsplit(".", 1)[1] for n in state.cache}
    assert {"ngram_context", "ple_conv_state", "index_keys", "index_positions"} <= kinds, kinds
    assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in state.cache.values())


GENAI_SCRIPT = Path(__file__).with_name("genai_greedy.py")


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_genai_cuda_greedy_equals_transformers_on_hybrid_models(
    family, genai_cuda_python, thinker_variant, onnx_variant
):
    """onnxruntime-genai's CUDA build on the float32 fused graph (shared state buffers): 12 of 12 greedy tokens of
    transformers', batch 1."""
    from thinker import ThinkerForCausalLM

    prompt, new_tokens = [5, 9, 17, 33, 4, 21, 8, 7], 12
    folder = onnx_variant(family, graph="fused", head_dim=None)
    case = {"folder": str(folder), "prompt": prompt, "max_new_tokens": new_tokens, "provider": "cuda"}
    done = subprocess.run(
        [str(genai_cuda_python), str(GENAI_SCRIPT)],
        input=json.dumps([case]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model = ThinkerForCausalLM.from_pretrained(thinker_variant(family)).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    assert json.loads(done.stdout)[0] == expected[0].tolist()


@pytest.mark.parametrize(
    ("bits", "in_blocks"), [(4, True), (8, False), (8, True)], ids=["int4", "int8-rows", "int8-blocks"]
)
def test_cuda_quantized_experts_equal_the_cpu(
    bits, in_blocks, onnx_variant, thinker_variant, tmp_path, monkeypatch, record_property
):
    """A float16 fused export with quantized routed experts (QMoE, export/quantize.py ``quantize_experts``) on CUDA
    against the same graph on the CPU computing in float: the float16 tolerance, the same greedy tokens. int4 in
    blocks of 32, int8 a scale per row (what float16 exports write), and int8 in blocks (what float32 exports at
    accuracy level 4 write). CUDA's QMoE takes widths that are whole multiples of 64 and blocks of 32, 64 or 128
    (an H100, onnxruntime-gpu 1.31.1: "requires hidden_size to be a multiple of 64", "group_size=16 is not
    supported"), hence the model's widths; and never reads ``accuracy_level`` (its activations stay float16), so
    the CPU's reference is level 0, with 8-bit blocks in float (``experts_in_float``), whose CPU kernel rounds
    activations to int8 at any level (against level 4 the H100 measured 0.74 at int4, what level 4 alone moves
    the CPU's logits on this random model)."""
    from export.quantize import QuantizeSpec, WeightQuantizer
    from export.quantized_verify import experts_in_float
    from thinker_common.parity_inputs import RELATIVE_TOLERANCE

    spec = QuantizeSpec(bits=bits, block_size=32, accuracy_level=0)
    widths = {"hidden_size": 64, "moe_intermediate_size": 64}
    if bits == 8 and in_blocks:
        monkeypatch.setattr(WeightQuantizer, "experts_in_blocks", lambda self, *widths: True)
        folder = tmp_path / "int8-blocks"
        source = thinker_variant("qwen3_moe", head_dim=16, **widths)  # onnx_variant's fused head_dim
        export_model(source, folder, dtype="float16", graph="fused", quantize=spec, verify=False)
    else:
        folder = onnx_variant("qwen3_moe", "float16", graph="fused", quantize=spec, **widths)
    with experts_in_float():
        cpu = OnnxDecoder(folder, provider="cpu")
    cuda = OnnxDecoder(folder, provider="cuda")
    batch = parity_batch(96)
    expected, actual = cpu.prefill(*batch)[0], cuda.prefill(*batch)[0]
    kept = batch[1].astype(bool)
    difference = float(np.abs(actual[kept].astype(np.float32) - expected[kept].astype(np.float32)).max())
    scale = float(np.abs(expected[kept].astype(np.float32)).max())
    record_property("max_abs_diff", difference)
    record_property("logit_scale", scale)
    assert difference <= RELATIVE_TOLERANCE[torch.float16] * max(1.0, scale), (difference, scale)
    assert (actual[kept].argmax(-1) == expected[kept].argmax(-1)).mean() >= 0.9
