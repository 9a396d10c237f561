"""ThinkerConfig's defaults and refusals, and the small shared modules beside it (``thinker_common.config_values``,
``dtypes``, ``eager``, ``card_format``, ``thinker/foreign.py``): each rule at the value where a slip would change what
a user gets (a derived size, a refused config, a dtype written, a message naming the key), each found unchecked by a
mutation run."""

from __future__ import annotations

import re

import pytest
from huggingface_hub.errors import StrictDataclassError

from thinker import ThinkerConfig
from thinker.configuration_thinker import mrope_interleaved

# A small PLE-capable layout: PLE sits on linear-attention layers (numbered from 1), and needs an eos id.
HYBRID = {
    "num_hidden_layers": 3,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "eos_token_id": 2,
}
# Indexed (QSA) attention on every layer: head_dim 8, all of it rotary.
QSA = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "layer_types": ["indexed_attention"] * 2,
    "indexer_n_heads": 2,
    "indexer_head_dim": 8,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
# Multimodal RoPE whose [t, h, w] sections give the 32 frequencies of the default config's 64-wide heads.
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}


# --- ThinkerConfig: the fields derived in __post_init__ ---------------------------------------------------------------


def test_head_dim_defaults_to_hidden_size_over_the_query_heads_also_with_gqa():
    config = ThinkerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert (config.head_dim, config.num_key_value_heads, config.num_key_value_groups) == (16, 2, 2)
    assert ThinkerConfig(hidden_size=64, num_attention_heads=4, head_dim=32).head_dim == 32  # Qwen3 sets its own


@pytest.mark.parametrize("bias", [True, False])
def test_the_output_projections_bias_follows_attention_bias_unless_given(bias):
    assert ThinkerConfig(attention_bias=bias).attention_output_bias is bias
    assert ThinkerConfig(attention_bias=True, attention_output_bias=False).attention_output_bias is False  # Qwen2


def test_moe_intermediate_size_defaults_to_intermediate_size():
    assert ThinkerConfig(intermediate_size=96, num_experts=4).moe_intermediate_size == 96
    assert ThinkerConfig(intermediate_size=96, num_experts=4, moe_intermediate_size=24).moe_intermediate_size == 24


def test_ple_layer_ids_are_sorted_and_deduplicated_and_fix_the_hash_vocabulary():
    config = ThinkerConfig(**HYBRID, ple_layer_ids=[3, 1, 3], vocab_size=300)
    assert config.ple_layer_ids == [1, 3]
    assert config.ngram_hash_vocab_size == 300  # fixed as the config is made: a later resize keeps the hash
    assert config.number_of_conv_states == 3  # a PLE layer's conv window and n-gram context ride in the cache
    plain = ThinkerConfig(**HYBRID)
    assert (plain.ple_layer_ids, plain.ngram_hash_vocab_size, plain.number_of_conv_states) == ([], None, 1)


def test_learned_positions_carry_no_rope_parameters():
    config = ThinkerConfig(position_embedding_type="learned")
    assert config.rope_parameters is None and config.to_dict()["rope_parameters"] is None
    rope = ThinkerConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert rope.rope_parameters["rope_theta"] == 5e5


# --- ThinkerConfig: what validate_architecture refuses, by the key's name ---------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"position_embedding_type": "alibi"},
            r"position_embedding_type='alibi'; expected one of \('rope', 'learned'\)",
        ),
        ({"norm_type": "batchnorm"}, r"norm_type='batchnorm'; expected one of \('rmsnorm', 'layernorm'\)"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"num_experts": -1}, r"num_experts=-1 must be 0 \(every layer dense\) or more"),
        ({"num_experts": 4, "num_experts_per_tok": 0}, r"num_experts_per_tok=0 must lie in 1\.\.4"),
        ({"deepstack_layers": 5}, r"deepstack_layers=5 must lie in \[0, num_hidden_layers=4\]"),
        ({"deepstack_layers": -1}, r"deepstack_layers=-1 must lie in \[0, num_hidden_layers=4\]"),
        (
            {"rope_parameters": {**MROPE, "mrope_interleaved": "yes"}},
            r"rope_parameters\['mrope_interleaved'\]='yes'; expected true or false",
        ),
        (
            {"rope_parameters": {**MROPE, "interleaved": 1}},
            r"rope_parameters\['interleaved'\]=1; expected true or false",
        ),
        ({"hc_count": 2, "hc_lowrank": 4, "norm_type": "layernorm"}, "they need norm_type='rmsnorm'"),
        ({**HYBRID, "ple_layer_ids": [1], "norm_type": "layernorm"}, "they need norm_type='rmsnorm'"),
        (
            {**HYBRID, "ple_layer_ids": [0]},
            r"ple_layer_ids \[0\]: PLE layers are linear-attention layers, numbered from 1",
        ),
        ({**QSA, "indexer_head_dim": 7}, r"the indexer's heads \(7\) are narrower than the rotary part .* \(8\)"),
    ],
)
def test_config_refuses_by_name(fields, message):
    with pytest.raises(StrictDataclassError, match=message):
        ThinkerConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"vocab_size": "64"}, "expected int, got str"),
        ({"num_hidden_layers": True}, "expected int, got bool"),
        ({"qk_norm": 1}, "expected bool, got int"),
        ({"rms_norm_eps": "1e-6"}, "expected float, got str"),
        ({"layer_types": "full_attention"}, "expected a list, got str"),
        ({"num_key_value_heads": 2.0}, "expected int"),
    ],
)
def test_config_fields_are_type_checked_as_transformers_configs_are(fields, expected):
    """huggingface_hub's ``@strict`` checks each field against its annotation, as it does Qwen3Config's; annotations
    that were strings (``from __future__ import annotations``) went unchecked, so a switch given as text passed for
    true and a layer count as text failed later with a message that named another key (a QA run)."""
    (name,) = fields
    with pytest.raises(StrictDataclassError, match=rf"(?s)field '{name}'.*{expected}"):
        ThinkerConfig(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_experts": 4, "num_experts_per_tok": 4},  # every expert for every token: Mixtral-style dense routing
        {"linear_num_value_heads": 3},  # read by linear-attention layers only, and this model has none
        {"deepstack_layers": 4},  # DeepStack into every layer
        {**QSA, "indexer_head_dim": 8},  # the indexer's heads exactly as wide as the rotary part
        # an odd rotary part (20 x 0.25 = 5 channels) has 3 frequencies: transformers' RoPE takes every even channel
        {"head_dim": 20, "rope_parameters": {**MROPE, "mrope_section": [1, 1, 1], "partial_rotary_factor": 0.25}},
    ],
)
def test_config_accepts_the_edge_values(fields):
    config = ThinkerConfig(**fields)
    assert {key: getattr(config, key) for key in fields} == fields


# --- ThinkerConfig: what is derived on every read --------------------------------------------------------------------


def test_ngram_contexts_end_at_the_first_eos_id():
    assert ThinkerConfig(**{**HYBRID, "eos_token_id": [5, 2]}, ple_layer_ids=[1]).ngram_eos_token_id == 5
    assert ThinkerConfig(eos_token_id=7).ngram_eos_token_id == 7
    assert ThinkerConfig(eos_token_id=[]).ngram_eos_token_id is None


def test_every_step_th_layer_is_sparse_counting_from_one():
    config = ThinkerConfig(num_hidden_layers=4, num_experts=4, decoder_sparse_step=2)
    assert config.mlp_layer_types == ["dense", "sparse", "dense", "sparse"]  # Qwen2-MoE: (i + 1) % step == 0
    config.mlp_only_layers = [3]
    assert config.mlp_layer_types == ["dense", "sparse", "dense", "dense"]


def test_tensor_parallel_plans_list_only_the_modules_the_config_has():
    attention = {f"layers.*.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    norms = {"layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"}
    dense = {"layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"}
    experts = {"layers.*.mlp.experts", "layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj"}
    shared = {"layers.*.mlp.shared_expert.gate_proj", "layers.*.mlp.shared_expert.up_proj"}
    shared |= {"layers.*.mlp.shared_expert.down_proj"}
    assert set(ThinkerConfig().base_model_tp_plan) == attention | dense
    assert set(ThinkerConfig(qk_norm=True).base_model_tp_plan) == attention | norms | dense
    assert set(ThinkerConfig(num_hidden_layers=2, num_experts=4).base_model_tp_plan) == attention | experts
    moe = ThinkerConfig(num_hidden_layers=2, num_experts=4, shared_expert_intermediate_size=8)
    assert set(moe.base_model_tp_plan) == attention | experts | shared
    # indexed attention is full attention with an indexer: both plans
    assert set(ThinkerConfig(**QSA).base_model_tp_plan) == attention | dense | {
        "layers.*.self_attn.indexer.index_qk_proj"
    }
    assert ThinkerConfig().base_model_ep_plan is None and moe.base_model_ep_plan is not None


def test_multimodal_rope_interleaves_unless_either_key_says_not():
    assert mrope_interleaved(None) and mrope_interleaved({"mrope_section": [2, 3, 3]})
    assert not mrope_interleaved({"interleaved": False})  # Qwen3-Omni's name for it
    assert not mrope_interleaved({"mrope_interleaved": False, "interleaved": True})  # the Thinker's own key first


# --- thinker_common.config_values: refused by key, before anything is built ------------------------------------------


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        # 0 divides by zero in the sparse-layer rule (transformers' class and the Thinker's)
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a whole number above 0"),
        ({"decoder_sparse_step": 2}, None),
        # JSON's true is no size: Python would take it for 1
        ({"hidden_size": True}, "hidden_size=True must be a whole number above 0"),
        ({"pad_token_id": True, "vocab_size": 10}, "pad_token_id=True must be a token id of the vocabulary"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, "rope_parameters.rope_theta=True must be"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": True}},
            "rope_parameters.factor=True",
        ),
        # activations with weights of their own, which no Thinker MLP has a tensor for
        ({"hidden_act": "prelu"}, "hidden_act='prelu' learns parameters (weight), which no Thinker MLP holds"),
        ({"hidden_act": "swish2"}, "hidden_act='swish2' is not an activation transformers knows; known: gelu, "),
        ({"hidden_act": "gelu_pytorch_tanh"}, None),
    ],
)
def test_config_values_refuse_by_key(config, refused):
    from thinker_common.config_values import config_problem

    problem = config_problem(config)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(refused), problem


def test_a_refused_value_names_the_file_it_came_from(tmp_path):
    from thinker_common.config_values import check_model_config
    from thinker_common.errors import ThinkerError

    where = tmp_path / "config.json"
    with pytest.raises(ThinkerError) as refused:
        check_model_config({"hidden_size": 0}, str(where))
    assert str(refused.value) == f"{where}: hidden_size=0 must be a whole number above 0; correct the value"
    check_model_config({"hidden_size": 8}, str(where))  # usable: no error


# --- thinker_common.dtypes: the codes written into safetensors headers ------------------------------------------------


@pytest.mark.parametrize(
    "code", ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"]
)
def test_each_safetensors_code_is_the_one_safetensors_writes(code):
    """The table against safetensors itself: the header of a tensor of that dtype, saved by ``safetensors.torch``."""
    import json
    import struct

    import torch
    from safetensors.torch import save

    from thinker_common.dtypes import SAFETENSORS_DTYPES, dtype_name, safetensors_code, torch_dtype

    dtype = torch_dtype(SAFETENSORS_DTYPES[code])
    data = save({"t": torch.zeros(2, dtype=dtype)})
    (length,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8 : 8 + length])["t"]["dtype"] == code
    assert safetensors_code(dtype) == code and dtype_name(dtype) == SAFETENSORS_DTYPES[code]


@pytest.mark.parametrize("name", ["Tensor", "nn", "float128", "cuda"])
def test_torch_dtype_refuses_names_that_are_no_dtype(name):
    from thinker_common.dtypes import torch_dtype

    with pytest.raises(ValueError, match=f"torch has no dtype named '{name}'"):
        torch_dtype(name)


def test_the_commands_offer_every_float_dtype():
    from converter.cli import convert_command
    from export.cli import export_command

    for command, choices in ((convert_command, ["auto", "float32", "bfloat16", "float16"]), (export_command, None)):
        option = next(param for param in command.params if param.name == "dtype")
        assert list(option.type.choices) == (choices or ["float32", "bfloat16", "float16"])


# --- thinker_common.card_format: what marks a folder as thinker's, and unchanged since ------------------------------


def test_verify_reports_added_to_an_earlier_output_leave_it_unchanged(tmp_path):
    """parity.json / parity.failed.json are thinker verify's, whatever their time: neither their names nor their change
    times make the folder someone else's."""
    from cli_helpers import earlier_output

    from thinker_common.card_format import changes_since_written

    folder = earlier_output(tmp_path / "out", {"model.safetensors": b"weights"})
    (folder / "parity.json").write_text("{}")
    (folder / "parity.failed.json").write_text("{}")
    assert changes_since_written(folder, sorted(entry.name for entry in folder.iterdir())) is None


def test_changed_files_are_named_largest_first(tmp_path):
    from cli_helpers import earlier_output

    from thinker_common.card_format import changes_since_written

    folder = earlier_output(tmp_path / "out", {"model.safetensors": b"weights", "tokenizer.json": "{}"})
    (folder / "tokenizer.json").write_text("{}")  # rewritten: a new change time, within the same second
    (folder / "model.safetensors").write_bytes(b"fine-tuned weights, larger")
    reason = changes_since_written(folder, sorted(entry.name for entry in folder.iterdir()))
    assert reason is not None
    assert reason.startswith("model.safetensors, tokenizer.json changed after thinker wrote the folder"), reason


def test_only_a_plain_card_with_the_checks_marker_is_thinkers(tmp_path):
    from cli_helpers import earlier_output

    from thinker_common.card_format import stamped_card, written_by_thinker

    written = earlier_output(tmp_path / "written")
    assert written_by_thinker(written)
    other = tmp_path / "other"
    other.mkdir()
    (other / "README.md").write_text("# Converted with thinker\n\nSee the thinker docs.\n")  # no checks marker
    assert not written_by_thinker(other) and stamped_card(other) is None
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "README.md").symlink_to(written / "README.md")  # a card of thinker's, reached through a link
    assert not written_by_thinker(linked) and stamped_card(linked) is None


def test_a_half_written_card_is_stale_only_once_its_writer_is_gone(tmp_path):
    import os
    import subprocess
    import sys

    from thinker_common.card_format import stale_partial

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(done.stdout)
    (tmp_path / f".README.md.partial-{gone}").write_text("half")
    (tmp_path / f".parity.json.partial-{os.getpid()}").write_text("half")  # this process: still writing
    (tmp_path / f".notes.md.partial-{gone}").write_text("a user's")  # not a name thinker writes
    stale = {entry.name: stale_partial(entry) for entry in os.scandir(tmp_path)}
    assert stale == {
        f".README.md.partial-{gone}": True,
        f".parity.json.partial-{os.getpid()}": False,
        f".notes.md.partial-{gone}": False,
    }


# --- thinker/foreign.py: which from_pretrained a checkpoint goes to, and with what ----------------------------------


@pytest.fixture
def routed(tmp_path, monkeypatch):
    """``routed(source, **kwargs) -> (where, arguments)``: ``thinker.foreign.from_pretrained`` on ``source`` with a
    stand-in for transformers' own from_pretrained and for the registered loader, recording which one got the call."""
    import thinker.foreign as foreign

    def transformers_from_pretrained(cls, source, *args, **kwargs):
        return "transformers", {"args": args, **kwargs}

    def loader(source, **kwargs):
        return "loader", kwargs

    monkeypatch.setattr(foreign, "_loaders", [loader])

    def route(source, *args, from_causal_lm=lambda loaded: loaded, **kwargs):
        return foreign.from_pretrained(object, transformers_from_pretrained, from_causal_lm, source, *args, **kwargs)

    return route


def folder_of(path, model_type):
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_a_foreign_checkpoint_goes_to_the_loader_with_its_dtype_by_name(routed, tmp_path):
    import torch

    qwen = folder_of(tmp_path / "qwen", "qwen3")
    assert routed(qwen) == ("loader", {"dtype": "auto"})  # the converter's "keep the source's dtype"
    assert routed(qwen, dtype=torch.bfloat16) == ("loader", {"dtype": "bfloat16"})
    assert routed(qwen, torch_dtype=torch.float16) == ("loader", {"dtype": "float16"})  # transformers' former name
    assert routed(qwen, revision="v1", subfolder="w") == (
        "loader",
        {"dtype": "auto", "revision": "v1", "subfolder": "w"},
    )


def test_a_thinker_checkpoint_or_an_explicit_config_goes_to_transformers(routed, tmp_path):
    qwen = folder_of(tmp_path / "qwen", "qwen3")
    thinker_folder = folder_of(tmp_path / "thinker", "thinker")
    config = ThinkerConfig()
    assert routed(thinker_folder) == ("transformers", {"args": ()})
    assert routed(qwen, config=config) == ("transformers", {"args": (), "config": config})
    assert routed(qwen, "positional") == ("transformers", {"args": ("positional",)})
    # a GGUF file asked for by name is never a Thinker checkpoint, even in a Thinker folder
    assert routed(thinker_folder, gguf_file="m.gguf") == ("loader", {"dtype": "auto", "gguf_file": "m.gguf"})


def test_a_task_head_refuses_a_foreign_checkpoint_by_name(routed, tmp_path):
    qwen = folder_of(tmp_path / "qwen", "qwen3")
    with pytest.raises(ValueError, match=f"{qwen} is not a Thinker checkpoint, and object loads Thinker checkpoints"):
        routed(qwen, from_causal_lm=None)


# --- sizes the config divides by or the indexer takes, refused by name (a mutation run found them unchecked) ----------


@pytest.mark.parametrize("field", ["indexer_budget", "indexer_compress_ratio", "indexer_n_heads"])
def test_negative_indexer_sizes_are_refused_by_name(field):
    """A negative size passed the check for a missing one and failed inside torch ('selected index k out of
    range', 'negative dimension')."""
    with pytest.raises(StrictDataclassError, match=f"need {field}=-[0-9]+ as positive integers"):
        ThinkerConfig(**{**QSA, field: -QSA[field]})
    for wrong in ("8", True):  # a TypeError, or a size of 1: refused by the field's type, as transformers' configs are
        with pytest.raises(
            StrictDataclassError, match=f"(?s)field '{field}'.*expected int, got {type(wrong).__name__}"
        ):
            ThinkerConfig(**{**QSA, field: wrong})


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
        # None and text are refused by the field's type first (``test_config_fields_are_type_checked...``)
        ({"num_key_value_heads": None, "num_attention_heads": None}, "field 'num_attention_heads'"),
        ({"num_attention_heads": "4"}, "field 'num_attention_heads'"),
        (
            {"num_hidden_layers": 1, "layer_types": ["linear_attention"], "linear_num_key_heads": 0},
            "linear_num_key_heads=0",
        ),
        ({"num_experts": 4, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ],
)
def test_a_zero_divisor_is_refused_by_name(fields, shown):
    """Zero raised a bare ZeroDivisionError naming no key, and None or a string a TypeError (the CLIs check these
    keys first; the Python API did not)."""
    typed = shown.startswith("field")
    expected = f"(?s){shown}.*expected int" if typed else f"{re.escape(shown)} must be a whole number, 1 or more"
    with pytest.raises((ValueError, StrictDataclassError), match=expected):
        ThinkerConfig(**fields)


def test_a_divisor_no_layer_uses_is_not_refused():
    """The sparse step without experts and the linear attention's key heads without its layers divide nothing: the
    Python API still builds such a config (the CLIs hold every size in config.json to 1 or more, config_values)."""
    config = ThinkerConfig(decoder_sparse_step=0, linear_num_key_heads=0)
    assert config.mlp_layer_types == ["dense"] * config.num_hidden_layers
