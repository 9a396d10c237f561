"""The presets of configs/: they load, carry their source, have the released shapes, and resolve through the
installed package ``thinker_configs`` rather than through the source tree."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from thinker import ThinkerConfig, ThinkerForCausalLM, presets
from thinker.presets import list_presets, load_preset

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RELEASES = (
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "qwen3-30b-a3b",
    "qwen3-omni-30b-a3b-thinker",
    "smollm2-135m",
    "qwen3.5-0.8b",
    "qwen3.6-35b-a3b",
    "qwen3-next-80b-a3b-instruct",
)


def test_every_json_is_listed():
    assert list_presets() == sorted(path.stem for path in CONFIGS.glob("*.json"))
    assert {"thinker_tiny", *RELEASES} <= set(list_presets())


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIGS.glob("*.json")))
def test_preset_loads_and_cites_its_source(name):
    raw = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    assert raw["model_type"] == "thinker"
    assert raw["_source"]
    if name in RELEASES:
        assert raw["_source"].startswith("https://huggingface.co/") and "config.json" in raw["_source"]
    config = load_preset(name)
    assert isinstance(config, ThinkerConfig)
    assert not any(key.startswith("_") and key in config.to_dict() for key in raw)  # documentation keys dropped
    for key, value in raw.items():  # every other key is taken as written
        if not key.startswith("_") and key != "model_type":
            assert getattr(config, key) == value, key
    config.validate_architecture()


def parameter_count(config: ThinkerConfig) -> int:
    """Counted on the meta device: no memory, whatever the size."""
    with torch.device("meta"):
        model = ThinkerForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


# The published sizes of the releases (total parameters, embeddings included).
@pytest.mark.parametrize(
    ("name", "billions"),
    [("qwen2.5-0.5b", 0.49), ("qwen3-0.6b", 0.60), ("qwen3-30b-a3b", 30.5), ("smollm2-135m", 0.135)],
)
def test_release_parameter_counts(name, billions):
    assert parameter_count(load_preset(name)) / 1e9 == pytest.approx(billions, rel=0.01)


# The hybrid releases publish their sizes rounded (0.8B, 35B, 80B): a count within half the last published digit is
# that size. Text decoders only: the vision towers and MTP heads of the releases are not the Thinker's.
@pytest.mark.parametrize(
    ("name", "billions", "half_digit"),
    [("qwen3.5-0.8b", 0.8, 0.05), ("qwen3.6-35b-a3b", 35, 0.5), ("qwen3-next-80b-a3b-instruct", 80, 0.5)],
)
def test_hybrid_release_parameter_counts(name, billions, half_digit):
    assert abs(parameter_count(load_preset(name)) / 1e9 - billions) <= half_digit


@pytest.mark.parametrize(
    ("name", "layers", "value_heads", "sparse"),
    [("qwen3.5-0.8b", 24, 16, 0), ("qwen3.6-35b-a3b", 40, 32, 40), ("qwen3-next-80b-a3b-instruct", 48, 32, 48)],
)
def test_hybrid_release_shapes(name, layers, value_heads, sparse):
    """Three Gated DeltaNet layers, then one gated full-attention layer, over and over (full_attention_interval 4);
    zero-centred norms, q/k norm, partial rotary 0.25 of head_dim 256."""
    config = load_preset(name)
    assert config.layer_types == ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    assert config.attention_output_gate and config.norm_zero_centered and config.qk_norm and config.head_dim == 256
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, value_heads)
    assert config.mlp_layer_types.count("sparse") == sparse
    if config.num_experts:
        assert config.shared_expert_intermediate_size == config.moe_intermediate_size == 512 and config.norm_topk_prob


def test_qwen3_omni_thinker_shapes():
    config = load_preset("qwen3-omni-30b-a3b-thinker")
    assert config.mlp_layer_types == ["sparse"] * 48
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.vocab_size == 152064 and config.qk_norm and not config.tie_word_embeddings
    # the release's interleaved multimodal RoPE, as a conversion of it writes: (3, B, T) positions are taken
    rope = config.rope_parameters
    assert (rope["mrope_section"], rope["mrope_interleaved"]) == ([24, 20, 20], True)
    # the Qwen3-30B-A3B decoder with the larger Omni vocabulary: 30.5 B + 2 x 128 x 2048
    assert parameter_count(config) / 1e9 == pytest.approx(30.5 + 2 * 128 * 2048 / 1e9, rel=0.02)


def test_tiny_preset_is_the_uomni_thinker():
    config = load_preset("thinker_tiny")
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (5000, 4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 4, 1024)
    assert config.rope_parameters["rope_theta"] == 10000 and config.max_position_embeddings == 512
    assert config.mlp_gated and config.num_experts == 0


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="qwen3-0.6b") as error:
        load_preset("qwen9-1t")
    assert "qwen9-1t" in str(error.value)


def test_overrides_and_a_shallower_copy_keep_the_first_layers():
    """Benchmarks run a preset with fewer layers: the per-layer lists keep their first entries, so a hybrid
    preset's shallow copy is the first layers of the real mix, and fields given explicitly win."""
    full = load_preset("qwen3.5-0.8b")
    shallow = load_preset("qwen3.5-0.8b", num_hidden_layers=5, vocab_size=1000)
    assert shallow.num_hidden_layers == 5 and shallow.vocab_size == 1000
    assert (
        shallow.layer_types == full.layer_types[:5] == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    )
    dense = load_preset("qwen3-0.6b", num_hidden_layers=2)
    assert dense.layer_types == ["full_attention"] * 2 and dense.mlp_layer_types == ["dense"] * 2
    given = ["full_attention"] * 2
    assert load_preset("qwen3.5-0.8b", num_hidden_layers=2, layer_types=given).layer_types == given
    with pytest.raises(ValueError, match="lists layer_types for 24 layers; asked for 30"):
        load_preset("qwen3.5-0.8b", num_hidden_layers=30)


def test_resolves_through_the_installed_package(tmp_path, monkeypatch):
    """As from a wheel: ``thinker_configs`` is a package of its own, found on sys.path, wherever the source is."""
    package = tmp_path / "thinker_configs"
    shutil.copytree(CONFIGS, package)
    (package / "only-in-the-wheel.json").write_text(json.dumps({"model_type": "thinker", "_source": "test"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = sys.modules.pop("thinker_configs", None)  # an editable install's, if any: shadowed for this test
    try:
        assert "only-in-the-wheel" in list_presets()
        assert load_preset("only-in-the-wheel").num_hidden_layers == ThinkerConfig().num_hidden_layers
        assert Path(sys.modules["thinker_configs"].__file__).parent == package
    finally:
        sys.modules.pop("thinker_configs", None)
        if installed is not None:
            sys.modules["thinker_configs"] = installed


def test_source_checkout_fallback(monkeypatch):
    def not_installed(package: str):
        raise ModuleNotFoundError(package)

    monkeypatch.setattr(presets.resources, "files", not_installed)
    assert list_presets() == sorted(path.stem for path in CONFIGS.glob("*.json"))


def test_the_smollm2_preset_is_the_real_file():
    """configs/smollm2-135m.json against the one released model here, the SmolLM2 GGUF the demo converts: every
    field the file carries is the preset's. Not its initializer_range (0.0417 in the release's config.json), a
    training setting no GGUF file records."""
    from converter.engine import plan_conversion
    from converter.families.gguf import smollm2_gguf_path
    from thinker_common.sources import open_source

    source = open_source(smollm2_gguf_path())
    try:
        config = plan_conversion(source, source.config()).config
    finally:
        source.close()
    preset = load_preset("smollm2-135m")
    differ = [field for field in ThinkerConfig.__annotations__ if getattr(config, field) != getattr(preset, field)]
    assert differ == ["initializer_range"]


def test_the_configs_defaults_are_the_tiny_thinker_but_for_its_head_bias():
    """ThinkerConfig's docstring promises μOmni's Thinker as its defaults: a changed default fails here, not in a
    model that silently grew another shape."""
    tiny, default = load_preset("thinker_tiny").to_dict(), ThinkerConfig().to_dict()
    differing = {key for key in tiny.keys() | default.keys() if tiny.get(key) != default.get(key)}
    assert differing == {"lm_head_bias"}
    assert tiny["lm_head_bias"] and not default["lm_head_bias"]
