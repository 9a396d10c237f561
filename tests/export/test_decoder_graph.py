"""The exported graph: the IO contract, external data, the checker, empty past, left padding, sparse MoE."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from export_helpers import make_config, save_thinker
from safetensors.torch import load_file, save_file

from export.decoder_graph import picked_experts_max_tokens
from export.exporter import export_model
from export.graph_builder import ALIGNMENT
from export.graph_walk import all_nodes
from export.runtime import OnnxDecoder, position_ids_from_mask
from export.verify import compare_decoders
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import parity_batch


def test_io_contract(onnx_folder):
    cfg = make_config("qwen3")
    for dtype, elem in (("float32", onnx.TensorProto.FLOAT), ("float16", onnx.TensorProto.FLOAT16)):
        graph = onnx.load(onnx_folder("qwen3", dtype) / "model.onnx", load_external_data=False).graph
        inputs = {i.name: i.type.tensor_type for i in graph.input}
        outputs = {o.name: o.type.tensor_type for o in graph.output}

        def dims(t):
            return [d.dim_param or d.dim_value for d in t.shape.dim]

        layers = range(cfg.num_hidden_layers)
        assert list(inputs) == ["input_ids", "attention_mask", "position_ids"] + [
            f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")
        ]
        assert list(outputs) == ["logits"] + [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]
        assert dims(inputs["input_ids"]) == ["batch_size", "sequence_length"]
        assert dims(inputs["attention_mask"]) == ["batch_size", "total_sequence_length"]
        assert dims(inputs["position_ids"]) == ["batch_size", "sequence_length"]
        assert all(
            inputs[n].elem_type == onnx.TensorProto.INT64 for n in ("input_ids", "attention_mask", "position_ids")
        )
        kv = inputs["past_key_values.0.key"]
        assert kv.elem_type == elem
        assert dims(kv) == ["batch_size", cfg.num_key_value_heads, "past_sequence_length", cfg.head_dim]
        assert dims(outputs["present.2.value"]) == ["batch_size", 2, "total_sequence_length", cfg.head_dim]
        assert outputs["present.2.value"].elem_type == elem
        assert outputs["logits"].elem_type == onnx.TensorProto.FLOAT
        assert dims(outputs["logits"]) == ["batch_size", "sequence_length", cfg.vocab_size]


def test_weights_live_in_external_data_and_the_checker_passes(thinker_folder, onnx_folder):
    folder = onnx_folder("qwen3_moe")
    path = folder / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)  # on the path: follows the external data, no 2 GB limit

    model = onnx.load(path, load_external_data=False)
    weights = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert {t.name for t in weights} >= {"model.embed_tokens.weight", "model.layers.0.mlp.experts.gate_up_proj"}
    assert all(int(np.prod(t.dims)) <= 1 or t.name.startswith("/const/") for t in inline)  # shapes and scalars only
    for tensor in weights:
        info = {e.key: e.value for e in tensor.external_data}
        assert info["location"] == "model.onnx.data"
        assert int(info["offset"]) % ALIGNMENT == 0
    assert path.stat().st_size < 200_000  # the proto holds no weight bytes, whatever the model size
    report = json.loads((folder / "export_report.json").read_text())
    assert report["sizes"]["model.onnx.data"] == (folder / "model.onnx.data").stat().st_size
    saved = load_file(thinker_folder("qwen3_moe") / "model.safetensors")
    assert report["parameters"] == sum(t.numel() for t in saved.values())


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_empty_past_prefill(family, thinker_folder, onnx_folder):
    """past_seq = 0 in a plain session run: presents hold exactly the prompt, logits match PyTorch."""
    from thinker import ThinkerForCausalLM

    cfg = make_config(family)
    session = ort.InferenceSession(str(onnx_folder(family) / "model.onnx"), providers=["CPUExecutionProvider"])
    input_ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)
    feeds = {
        "input_ids": input_ids,
        "attention_mask": np.ones_like(input_ids),
        "position_ids": np.arange(5, dtype=np.int64)[None],
    }
    empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    feeds.update({i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values.")})
    logits, *presents = session.run(None, feeds)

    assert all(p.shape == (1, cfg.num_key_value_heads, 5, cfg.head_dim) for p in presents)
    model = ThinkerForCausalLM.from_pretrained(thinker_folder(family)).eval()
    with torch.no_grad():
        reference = model(torch.from_numpy(input_ids)).logits.numpy()
    np.testing.assert_allclose(logits, reference, atol=1e-4)


def test_left_padded_rows_equal_rows_alone(onnx_folder):
    """Each row of a left-padded batch gives the logits it gives alone (MoE: routing is per token)."""
    decoder = OnnxDecoder(onnx_folder("qwen3_moe"), provider="cpu")
    input_ids, attention_mask = parity_batch(96)
    batch_logits, state = decoder.prefill(input_ids, attention_mask)
    batch_step = decoder.decode_one_token(np.array([11, 12]), state)
    for row, token in enumerate([11, 12]):
        kept = attention_mask[row].astype(bool)
        alone, alone_state = decoder.prefill(input_ids[row : row + 1, kept], attention_mask[row : row + 1, kept])
        alone_step = decoder.decode_one_token(np.array([token]), alone_state)
        np.testing.assert_allclose(batch_logits[row, kept], alone[0], atol=1e-5)
        np.testing.assert_allclose(batch_step[row], alone_step[0], atol=1e-5)


def test_cached_decoding_equals_full_forward(onnx_folder):
    decoder = OnnxDecoder(onnx_folder("qwen2"), provider="cpu")
    tokens = np.array([[3, 14, 15, 92, 65, 35, 89, 79]], dtype=np.int64)
    full, _ = decoder.prefill(tokens, np.ones_like(tokens))
    logits, state = decoder.prefill(tokens[:, :3], np.ones((1, 3), np.int64))
    for t in range(3, tokens.shape[1]):
        step = decoder.decode_one_token(tokens[:, t], state)
        np.testing.assert_allclose(step[0], full[0, t], atol=1e-5)
    np.testing.assert_allclose(logits[0], full[0, :3], atol=1e-5)


def test_moe_runs_only_the_routed_experts(tmp_path, monkeypatch):
    """An expert full of NaN poisons exactly the tokens routed to it, in PyTorch (which visits routed experts only)
    and in onnxruntime alike; a dense pass over every expert would poison every token (0 x NaN = NaN)."""
    from thinker import ThinkerForCausalLM

    monkeypatch.setattr("export.weights.value_problem", lambda tensor, dtype: None)  # the NaN is the probe here
    folder = save_thinker(tmp_path / "moe", "qwen3_moe", tokenizer=False, num_hidden_layers=1, mlp_only_layers=[])
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.mlp.experts.down_proj"][3] = float("nan")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    export_model(folder, tmp_path / "onnx", verify=False, graph="plain")  # the fused MoE op: test_onnx_fused.py

    tokens = np.arange(40, dtype=np.int64)[:, None]  # 40 one-token rows: every row is independent
    decoder = OnnxDecoder(tmp_path / "onnx", provider="cpu")
    logits, _ = decoder.prefill(tokens, np.ones_like(tokens))  # 40 tokens in a step: the expert Loop
    # ... and a few at a time: each step's picked experts gathered at once
    few = picked_experts_max_tokens(ThinkerForCausalLM.config_class.from_pretrained(folder))
    assert 1 <= few < len(tokens)
    steps = [decoder.prefill(tokens[i : i + few], np.ones_like(tokens[i : i + few]))[0] for i in range(0, 40, few)]
    np.testing.assert_allclose(np.concatenate(steps), logits, atol=1e-5)
    with torch.no_grad():
        reference = ThinkerForCausalLM.from_pretrained(folder).eval()(torch.from_numpy(tokens)).logits.numpy()
    poisoned = np.isnan(reference[:, 0]).any(-1)
    assert 0 < poisoned.sum() < len(tokens)  # expert 3 is picked by some tokens, not all
    np.testing.assert_array_equal(np.isnan(logits[:, 0]).any(-1), poisoned)
    np.testing.assert_allclose(logits[~poisoned], reference[~poisoned], atol=1e-5)


def test_moe_graph_has_no_dense_expert_pass(onnx_folder):
    """The stacked (E, ...) expert weights are only ever gathered, never multiplied whole: per sparse layer an If
    between the picked experts gathered at once (a step of a few tokens) and a Loop gathering one visited expert at
    a time."""
    graph = onnx.load(onnx_folder("qwen3_moe") / "model.onnx", load_external_data=False).graph
    expert_weights = {t.name for t in graph.initializer if ".experts." in t.name}
    readers = [node for node in all_nodes(graph) if set(node.input) & expert_weights]
    assert readers and {node.op_type for node in readers} == {"Gather"}
    choices = [node for node in graph.node if node.op_type == "If"]
    assert len(choices) == 2  # layers 0 and 2 are sparse, 1 is dense
    for choice in choices:
        branches = {a.name: {n.op_type for n in all_nodes(a.g)} for a in choice.attribute}
        assert "Loop" in branches["else_branch"] and "Loop" not in branches["then_branch"], branches


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_rope_scaling_comes_from_transformers(graph, tmp_path):
    """A YaRN-scaled RoPE (scaled frequencies and attention factor) exports exactly, also as the cos/sin caches of
    the fused graph's GroupQueryAttention (head_dim 16)."""
    from thinker import ThinkerForCausalLM

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    folder = save_thinker(tmp_path / "yarn", "qwen3", tokenizer=False, rope_parameters=rope, head_dim=16)
    export_model(folder, tmp_path / "onnx", verify=False, graph=graph)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    figures = compare_decoders(model, OnnxDecoder(tmp_path / "onnx", provider="cpu"), *parity_batch(96))
    assert figures["max_abs_diff"] <= 1e-3, figures


def test_yarn_stretches_the_exported_context(tmp_path):
    """Qwen's YaRN setting keeps max_position_embeddings at the trained length and stretches it by the factor, which
    transformers runs: the export's RoPE tables, genai_config.json's context and OnnxDecoder's limit cover factor x
    the trained positions, and decoding past max_position_embeddings matches PyTorch."""
    import json

    from thinker import ThinkerForCausalLM

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
    folder = save_thinker(tmp_path / "yarn", "qwen3", rope_parameters=rope, head_dim=16, max_position_embeddings=8)
    export_model(folder, tmp_path / "onnx", verify=True, graph="fused")
    genai = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == 32 and genai["search"]["max_length"] == 32
    # the card's onnxruntime-genai example within that context (genai refuses a max_length past it)
    assert "set_search_options(max_length=32)" in (tmp_path / "onnx" / "README.md").read_text()
    decoder = OnnxDecoder(tmp_path / "onnx", provider="cpu")
    assert decoder.context_length == 32
    ids, mask = parity_batch(96)
    assert ids.shape[1] + 6 > 8  # the prefill and decode steps run past max_position_embeddings
    figures = compare_decoders(ThinkerForCausalLM.from_pretrained(folder).eval(), decoder, ids, mask)
    assert figures["max_abs_diff"] <= 1e-4 * max(1.0, figures["logit_scale"]), figures


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_tied_head_with_bias(graph, tmp_path):
    """The tied head is a Gemm on the embedding matrix (stored once); a head bias rides along as its C input."""
    from thinker import ThinkerForCausalLM

    folder = save_thinker(tmp_path / "tied", "qwen2", tokenizer=False, tie_word_embeddings=True, lm_head_bias=True)
    export_model(folder, tmp_path / "onnx", verify=False, graph=graph)
    graph = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).graph
    assert sum(t.name == "model.embed_tokens.weight" for t in graph.initializer) == 1
    assert "lm_head.weight" not in {t.name for t in graph.initializer}
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    figures = compare_decoders(model, OnnxDecoder(tmp_path / "onnx", provider="cpu"), *parity_batch(96))
    assert figures["max_abs_diff"] <= 1e-3, figures


def test_tensor_the_graph_does_not_read_is_an_error(tmp_path):
    folder = save_thinker(tmp_path / "extra", "qwen2", tokenizer=False)
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)  # config says attention_output_bias=False
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ThinkerError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        export_model(folder, tmp_path / "onnx", verify=False)
    assert not (tmp_path / "onnx").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["extra"]  # the staging folder is gone too


def test_unsupported_activation_is_refused_before_writing(tmp_path):
    folder = save_thinker(tmp_path / "mish", "qwen2", tokenizer=False, hidden_act="mish")
    with pytest.raises(ThinkerError, match="hidden_act='mish'"):
        export_model(folder, tmp_path / "onnx", verify=False)


def test_position_ids_drive_the_positions(onnx_folder):
    """Positions come from position_ids, not from cache slots: with learned absolute positions, a left-padded row
    numbered from its first real token differs from one numbered from slot 0."""
    session = ort.InferenceSession(str(onnx_folder("gpt2") / "model.onnx"), providers=["CPUExecutionProvider"])
    cfg = make_config("gpt2")
    mask = np.array([[0, 0, 1, 1, 1]], dtype=np.int64)
    feeds = {"input_ids": np.array([[0, 0, 7, 8, 9]]), "attention_mask": mask}
    empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    feeds.update({i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values.")})
    from_mask = session.run(["logits"], {**feeds, "position_ids": position_ids_from_mask(mask)})[0]
    from_slots = session.run(["logits"], {**feeds, "position_ids": np.arange(5)[None]})[0]
    alone = session.run(
        ["logits"],
        {
            **{k: v[:, 2:] if k == "input_ids" else v for k, v in feeds.items() if k != "attention_mask"},
            "attention_mask": np.ones((1, 3), np.int64),
            "position_ids": np.arange(3)[None],
        },
    )[0]
    np.testing.assert_allclose(from_mask[0, 2:], alone[0], atol=1e-5)
    assert not np.allclose(from_slots[0, 2:], alone[0], atol=1e-3)
