"""The reference implementations run, and the Thinker can represent each of them.

Weights are mapped by hand here (a plain rename, plus the q/k row permutation for μOmni's interleaved RoPE and
the expert merge for Qwen3-Omni), independently of the converter's tables, so these tests say whether the
Thinker's architecture switches suffice; the converter's own parity tests live in ``tests/converter/``.
"""

from __future__ import annotations

import pytest
import torch
from references import llms_from_scratch_qwen3 as scratch
from references import qwen3_omni, uomni

from thinker import ThinkerConfig, ThinkerForCausalLM

ATOL = 1e-5


def tokens(vocab_size: int, batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def thinker_from(config: ThinkerConfig, state: dict[str, torch.Tensor]) -> ThinkerForCausalLM:
    model = ThinkerForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)  # every Thinker parameter produced, nothing extra
    return model


@torch.no_grad()
def thinker_logits(model: ThinkerForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


# ----------------------------------------------------------------------------------------------------------------
# μOmni ThinkerLM (seeds 000/001)


def uomni_to_thinker(model: uomni.ThinkerLM, permute_rope: bool = True) -> tuple[ThinkerConfig, dict]:
    cfg = model.cfg
    config = ThinkerConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.ctx_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=1e-6,
        lm_head_bias=True,
    )
    perm = uomni.interleaved_to_half_permutation(cfg.head_dim)

    def rope_rows(weight: torch.Tensor) -> torch.Tensor:
        if not permute_rope:
            return weight
        heads = weight.shape[0] // cfg.head_dim
        return weight.view(heads, cfg.head_dim, -1)[:, perm].reshape(weight.shape)

    src = model.state_dict()
    out = {
        "model.embed_tokens.weight": src["tok_emb.weight"],
        "model.norm.weight": src["norm.scale"],
        "lm_head.weight": src["head.weight"],
        "lm_head.bias": src["head.bias"],
    }
    for i in range(cfg.n_layers):
        s, t = f"blocks.{i}.", f"model.layers.{i}."
        if cfg.use_gqa:
            q, k, v = (src[s + f"attn.{n}.weight"] for n in "qkv")
        else:
            q, k, v = src[s + "attn.qkv.weight"].chunk(3, dim=0)
        out |= {
            t + "input_layernorm.weight": src[s + "norm1.scale"],
            t + "post_attention_layernorm.weight": src[s + "norm2.scale"],
            t + "self_attn.q_proj.weight": rope_rows(q),
            t + "self_attn.k_proj.weight": rope_rows(k),
            t + "self_attn.v_proj.weight": v,
            t + "self_attn.o_proj.weight": src[s + "attn.o.weight"],
        }
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[t + f"mlp.{name}.weight"] = src[s + f"mlp.{name}.weight"]
    return config, out


def test_uomni_rope_is_a_complex_rotation():
    """Seed 001's real/imaginary formula is multiplication of each (even, odd) pair by e^{i·pos·θ_k}. Its angles are
    float32 (as the seed computes them), so the float64 product is met to float32's tolerance: at float64's, an
    unseeded draw failed by 1.2e-7 in one CI run."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    rotation = torch.polar(torch.ones(5, 4, dtype=torch.float64), pos[:, None] * freqs[None, :])
    expected = torch.view_as_real(torch.view_as_complex(x.view(2, 3, 5, 4, 2)) * rotation).view_as(x)
    float32 = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's defaults for float32
    torch.testing.assert_close(uomni.apply_interleaved_rope(x, pos, 10000.0), expected, **float32)


@pytest.mark.parametrize("gqa", [False, True], ids=["fused-qkv", "gqa"])
def test_uomni_thinker_reproduces_reference(gqa: bool):
    reference = uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config(gqa=gqa))).eval()
    ids = tokens(reference.cfg.vocab_size)
    with torch.no_grad():
        expected = reference(ids)
    config, state = uomni_to_thinker(reference)
    torch.testing.assert_close(thinker_logits(thinker_from(config, state), ids), expected, atol=ATOL, rtol=0)


def test_uomni_rope_permutation_is_needed():
    """Negative control: without the q/k row permutation the half-split RoPE computes something else."""
    reference = uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config())).eval()
    ids = tokens(reference.cfg.vocab_size)
    with torch.no_grad():
        expected = reference(ids)
    config, state = uomni_to_thinker(reference, permute_rope=False)
    assert (thinker_logits(thinker_from(config, state), ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("gqa", [False, True], ids=["fused-qkv", "gqa"])
def test_uomni_checkpoint_round_trip(tmp_path, gqa: bool):
    reference = uomni.randomize_(uomni.ThinkerLM(uomni.tiny_config(gqa=gqa))).eval()
    folder = uomni.save_checkpoint(reference, tmp_path / "uomni")
    assert sorted(p.name for p in folder.iterdir()) == [uomni.CONFIG_NAME, uomni.WEIGHTS_NAME]
    state = torch.load(folder / uomni.WEIGHTS_NAME, weights_only=True)
    assert ("blocks.0.attn.q.weight" in state) is gqa and ("blocks.0.attn.qkv.weight" in state) is not gqa
    ids = tokens(reference.cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(uomni.load_checkpoint(folder)(ids), reference(ids), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# LLMs-from-scratch Qwen3 (seed 004)


def scratch_to_thinker(model: scratch.Qwen3Model) -> tuple[ThinkerConfig, dict]:
    cfg = model.cfg
    config = ThinkerConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["emb_dim"],
        intermediate_size=cfg["hidden_dim"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg["n_kv_groups"],
        head_dim=cfg["head_dim"],
        qk_norm=cfg["qk_norm"],
        max_position_embeddings=cfg["context_length"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_base"]},
        rms_norm_eps=1e-6,
    )
    renames = {
        "att.W_query.weight": "self_attn.q_proj.weight",
        "att.W_key.weight": "self_attn.k_proj.weight",
        "att.W_value.weight": "self_attn.v_proj.weight",
        "att.out_proj.weight": "self_attn.o_proj.weight",
        "att.q_norm.scale": "self_attn.q_norm.weight",
        "att.k_norm.scale": "self_attn.k_norm.weight",
        "norm1.scale": "input_layernorm.weight",
        "norm2.scale": "post_attention_layernorm.weight",
        "ff.fc1.weight": "mlp.gate_proj.weight",
        "ff.fc2.weight": "mlp.up_proj.weight",
        "ff.fc3.weight": "mlp.down_proj.weight",
    }
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("trf_blocks."):
            _, i, rest = name.split(".", 2)
            out[f"model.layers.{i}.{renames[rest]}"] = tensor
        else:
            top = {"tok_emb.weight": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight"}
            out[top.get(name, "lm_head.weight" if name == "out_head.weight" else name)] = tensor
    return config, out


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-qk-norm"])
def test_scratch_qwen3_thinker_reproduces_reference(qk_norm: bool):
    reference = scratch.randomize_(scratch.Qwen3Model(scratch.tiny_config(qk_norm=qk_norm))).eval()
    ids = tokens(reference.cfg["vocab_size"])
    with torch.no_grad():
        expected = reference(ids)
    config, state = scratch_to_thinker(reference)
    torch.testing.assert_close(thinker_logits(thinker_from(config, state), ids), expected, atol=ATOL, rtol=0)


def test_scratch_qwen3_checkpoint_round_trip(tmp_path):
    reference = scratch.randomize_(scratch.Qwen3Model(scratch.tiny_config())).eval()
    folder = scratch.save_checkpoint(reference, tmp_path / "scratch")
    saved = scratch.config_from_json(__import__("json").loads((folder / scratch.CONFIG_NAME).read_text()))
    assert saved == reference.cfg and tuple(saved) == scratch.CONFIG_KEYS
    state = torch.load(folder / scratch.WEIGHTS_NAME, weights_only=True)
    assert "cos" not in state and "trf_blocks.1.att.k_norm.scale" in state
    ids = tokens(reference.cfg["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(scratch.load_checkpoint(folder)(ids), reference(ids), atol=0, rtol=0)


def test_scratch_qwen3_bfloat16_keeps_norms_in_float32():
    model = scratch.Qwen3Model(scratch.tiny_config(dtype=torch.bfloat16))
    dtypes = {name: p.dtype for name, p in model.state_dict().items()}
    assert dtypes["trf_blocks.0.att.W_query.weight"] == torch.bfloat16
    assert dtypes["trf_blocks.0.norm1.scale"] == dtypes["final_norm.scale"] == torch.float32
    assert model(tokens(101)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------------
# Qwen3-Omni-MoE thinker (seed 002)


def omni_to_thinker(folder) -> tuple[ThinkerConfig, dict]:
    """From the on-disk checkpoint: the text config out of the nested config, thinker.model.* / thinker.lm_head
    renamed, per-expert tensors merged into the fused 3-D layout, the other towers dropped."""
    import json

    from safetensors.torch import load_file

    text = json.loads((folder / "config.json").read_text())["thinker_config"]["text_config"]
    rope = text["rope_parameters"]
    config = ThinkerConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        qk_norm=True,
        attention_bias=text["attention_bias"],
        hidden_act=text["hidden_act"],
        max_position_embeddings=text["max_position_embeddings"],
        rope_parameters={"rope_type": rope["rope_type"], "rope_theta": rope["rope_theta"]},
        rms_norm_eps=text["rms_norm_eps"],
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        norm_topk_prob=text["norm_topk_prob"],
        decoder_sparse_step=text["decoder_sparse_step"],
        mlp_only_layers=text["mlp_only_layers"],
    )
    source = load_file(folder / "model.safetensors")
    dropped = {n for n in source if n.startswith(qwen3_omni.DROPPED_PREFIXES)}
    assert dropped and not any(n.startswith("thinker.model.") and "experts" not in n for n in dropped)
    out, experts = {}, {}
    for name, tensor in source.items():
        if name in dropped:
            continue
        if ".mlp.experts." in name:  # thinker.model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            layer, expert, proj = name.split(".")[3], int(name.split(".")[6]), name.split(".")[7]
            experts.setdefault((layer, proj), {})[expert] = tensor
            continue
        out[name.removeprefix("thinker.")] = tensor
    for layer in sorted({layer for layer, _ in experts}):
        gate, up, down = (experts[(layer, p)] for p in ("gate_proj", "up_proj", "down_proj"))
        order = sorted(gate)
        # Thinker (and transformers' runtime layout): gate_up_proj (E, 2·I, C) with gate rows first; down (E, C, I).
        fused = [torch.cat([gate[e], up[e]], dim=0) for e in order]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(fused)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([down[e] for e in order])
    return config, out


@pytest.fixture(scope="module")
def omni_folder(tmp_path_factory):
    return qwen3_omni.save(tmp_path_factory.mktemp("qwen3_omni") / "tiny")


def test_omni_checkpoint_has_every_part(omni_folder):
    from safetensors import safe_open

    with safe_open(omni_folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    for prefix in (*qwen3_omni.DROPPED_PREFIXES, "thinker.model.layers.", "thinker.lm_head."):
        assert any(n.startswith(prefix) for n in names), prefix
    assert "thinker.model.layers.1.mlp.experts.3.gate_proj.weight" in names  # per-expert, as on the Hub
    assert "thinker.model.layers.0.mlp.gate_proj.weight" in names  # layer 0 dense (decoder_sparse_step=2)


def test_omni_mrope_on_text_is_plain_rope():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    from thinker.modeling_thinker import ThinkerRotaryEmbedding

    text_config = qwen3_omni.tiny_config().thinker_config.text_config
    positions = torch.arange(37)[None].expand(2, -1)
    x = torch.zeros(1, dtype=torch.float32)
    mrope_cos, mrope_sin = Qwen3OmniMoeThinkerTextRotaryEmbedding(text_config)(x, positions[None].expand(3, -1, -1))
    config = ThinkerConfig(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cos, sin = ThinkerRotaryEmbedding(config)(x, positions)
    torch.testing.assert_close(mrope_cos, cos, atol=0, rtol=0)
    torch.testing.assert_close(mrope_sin, sin, atol=0, rtol=0)


@pytest.mark.parametrize("with_mask", [False, True], ids=["positions-counted", "positions-from-get_rope_index"])
def test_omni_thinker_reproduces_reference(omni_folder, with_mask: bool):
    reference = qwen3_omni.load_reference_thinker(omni_folder)
    ids = tokens(qwen3_omni.TEXT_CONFIG["vocab_size"], length=13)
    expected = qwen3_omni.thinker_logits(reference, ids, torch.ones_like(ids) if with_mask else None)
    config, state = omni_to_thinker(omni_folder)
    assert config.mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    torch.testing.assert_close(thinker_logits(thinker_from(config, state), ids), expected, atol=ATOL, rtol=0)
