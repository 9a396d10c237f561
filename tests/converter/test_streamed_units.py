"""The streamed model (``converter/streamed.py``) on its own: what the layer-by-layer check stands on.

- a streamed model computes, bit for bit, what ``from_pretrained`` computes in its dtype, and what the widened model
  computes where units are widened to a compute dtype; a tied head included, and with more than ten layers (layer
  1's name is a prefix of layer 10's);
- while a unit runs, only its own weights (and a tied head's embedding) are in memory, and none after the block,
  even where the pass fails or a unit is loaded twice;
- a checkpoint without a tensor, or with one of another shape, is refused by name;
- every parameter belongs to one unit; the largest unit counts a tied head's embedding;
- the cached call continues a prompt as a whole pass over it would; the router loss is switched off;
- ``lazy_tensors(rounded_to=...)`` rounds; the plain loader loads in the dtype the model was built in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_helpers import build_reference
from safetensors.torch import save_file
from seeded_weights import rewritten_copy
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from converter.layer_parity import load_layered_reference
from converter.streamed import LazyTensor, StreamedModel, empty_model, lazy_tensors
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import fixed_prompts, gate_prompts, left_padded, long_prompts
from thinker_common.sources import open_source

VOCAB = 512  # the embedding (tied to the head) is the largest unit: 512 x 32
LAYERS = 12  # "model.layers.1" is a prefix of "model.layers.10"
QWEN3 = Qwen3Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=LAYERS,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)
ALTERED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("streamed") / "qwen3"
    build_reference(QWEN3).save_pretrained(folder)
    return folder


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return left_padded(fixed_prompts(VOCAB))


def loaded(streamed: StreamedModel) -> list[str]:
    """The parameters in memory now (not on the meta device)."""
    parameters = streamed.model.named_parameters(remove_duplicate=False)
    return sorted(name for name, parameter in parameters if not parameter.is_meta)


def reference_logits(folder: Path, dtype: torch.dtype, compute: torch.dtype) -> torch.Tensor:
    """``from_pretrained`` in ``dtype``, run in ``compute`` (its rounded weights widened), eager as the check runs."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    if compute != dtype:  # the weights only: the RoPE table stays float32, as it is built
        for parameter in model.parameters():
            parameter.data = parameter.data.to(compute)
    ids, mask, positions = batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


# --- the numbers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "compute"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)],
    ids=["float32", "bfloat16", "bfloat16-widened"],
)
def test_a_streamed_model_computes_what_from_pretrained_computes(source, dtype, compute):
    streamed = load_layered_reference(source, dtype)
    streamed.compute_dtype = compute
    with streamed.streaming():
        logits = streamed(*batch())
    expected = reference_logits(source, dtype, compute or dtype)
    assert logits.dtype == (compute or dtype)
    assert torch.equal(logits, expected), (logits - expected).abs().max()


def test_a_widened_tied_head_runs_in_the_compute_dtype_and_stays_tied(source):
    streamed = load_layered_reference(source, torch.bfloat16)
    streamed.compute_dtype = torch.float32
    seen = {}

    def observe(unit, args, kwargs, output):
        if unit.name == "lm_head":
            head, embedding = streamed.get_tensor("lm_head.weight"), streamed.get_tensor("model.embed_tokens.weight")
            seen.update(head=head.dtype, embedding=embedding.dtype, same=head is embedding)

    with streamed.streaming(observe):
        streamed(*batch())
    assert seen == {"head": torch.float32, "embedding": torch.float32, "same": True}


def test_the_cached_call_continues_a_prompt_as_a_whole_pass_over_it_would(source):
    streamed = load_layered_reference(source, torch.float32)
    ids, mask, positions = batch()
    with streamed.streaming():
        whole = streamed(ids, mask, positions)
        _, cache = streamed.run_cached(ids[:, :-1], mask[:, :-1], positions[:, :-1])
        step, _ = streamed.run_cached(ids[:, -1:], mask, positions[:, -1:], cache)
    assert torch.allclose(step[:, -1], whole[:, -1], atol=1e-5, rtol=1e-5), (step[:, -1] - whole[:, -1]).abs().max()


def test_the_observer_sees_each_units_own_output(source):
    """What an observer is handed as a unit's output is that unit's: the head's is the logits, and each layer's is
    the next layer's input (the layer check compares these)."""
    streamed = load_layered_reference(source, torch.float32)
    inputs, outputs = {}, {}

    def observe(unit, args, kwargs, output):
        inputs[unit.name] = (args[0] if args else kwargs["hidden_states"]).clone()
        outputs[unit.name] = (output[0] if isinstance(output, tuple) else output).clone()

    with streamed.streaming(observe):
        logits = streamed(*batch())
    assert torch.equal(outputs["lm_head"], logits)
    for index in range(LAYERS - 1):
        assert torch.equal(outputs[f"model.layers.{index}"], inputs[f"model.layers.{index + 1}"]), index
    assert not torch.equal(outputs["model.layers.0"], inputs["model.layers.0"])


def test_after_load_sees_the_unit_widened_to_the_compute_dtype(source):
    """``after_load`` runs once the unit is in the compute dtype, so weights it puts in take that dtype."""
    streamed = load_layered_reference(source, torch.bfloat16)
    streamed.compute_dtype = torch.float32
    seen = set()
    streamed.after_load = lambda unit: seen.update(streamed.get_tensor(name).dtype for name in unit.tensors)
    with streamed.streaming():
        streamed(*batch())
    assert seen == {torch.float32}


def test_empty_model_builds_the_attention_asked():
    model = empty_model(AutoModelForCausalLM.from_config, QWEN3, torch.float32, attention="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert empty_model(AutoModelForCausalLM.from_config, QWEN3, torch.float32).config._attn_implementation == "eager"


# --- memory --------------------------------------------------------------------------------------------------------


def test_only_the_running_unit_is_in_memory_and_nothing_after(source):
    streamed = load_layered_reference(source, torch.float32)
    held: dict[str, list[str]] = {}

    def observe(unit, args, kwargs, output):
        held[unit.name] = loaded(streamed)

    assert loaded(streamed) == []
    with streamed.streaming(observe):
        streamed(*batch())
    assert loaded(streamed) == []
    assert list(held) == [unit.name for unit in streamed.units]
    for unit in streamed.units:
        own = sorted({*unit.tensors, *unit.ties, *unit.ties.values()} & set(own_parameters(streamed)))
        assert held[unit.name] == own, unit.name
    assert held["lm_head"] == ["lm_head.weight", "model.embed_tokens.weight"]  # the tied head: the embedding's tensor
    assert held["model.layers.10"] == sorted(n for n in own_parameters(streamed) if n.startswith("model.layers.10."))


def own_parameters(streamed: StreamedModel) -> list[str]:
    return [name for name, _ in streamed.model.named_parameters(remove_duplicate=False)]


def test_a_failed_pass_leaves_no_weights_in_memory(source):
    streamed = load_layered_reference(source, torch.float32)

    def observe(unit, args, kwargs, output):
        if unit.name == "model.layers.3":
            raise RuntimeError("an observer fails")

    with pytest.raises(RuntimeError, match="an observer fails"):
        with streamed.streaming(observe):
            streamed(*batch())
    assert loaded(streamed) == []
    # and the model runs again afterwards, every unit reloaded
    with streamed.streaming():
        assert not streamed(*batch()).is_meta


def test_a_unit_loaded_twice_is_dropped_whole(source):
    streamed = load_layered_reference(source, torch.float32)
    layer = streamed.layers[0]
    streamed.load_unit(layer)
    streamed.load_unit(layer)  # a module called twice in one forward
    assert loaded(streamed) == sorted(layer.tensors)
    streamed.drop_unit(layer)
    assert loaded(streamed) == []


# --- refusals ------------------------------------------------------------------------------------------------------


def run_refused(folder: Path) -> tuple[str, StreamedModel]:
    streamed = load_layered_reference(folder, torch.float32)
    with pytest.raises(ThinkerError) as refused:
        with streamed.streaming():
            streamed(*batch())
    return str(refused.value), streamed


def test_a_missing_tensor_is_refused_by_name(source, tmp_path):
    folder = rewritten_copy(source, tmp_path / "missing", lambda weights: weights.pop(ALTERED))
    message, streamed = run_refused(folder)
    assert message == (
        f"Qwen3ForCausalLM: no checkpoint tensor loads {ALTERED}; the checkpoint does not hold the whole model"
    )
    assert loaded(streamed) == []


def test_a_tensor_of_another_shape_is_refused_by_name(source, tmp_path):
    def cut(weights):
        weights[ALTERED] = weights[ALTERED][:, :40].contiguous()

    message, streamed = run_refused(rewritten_copy(source, tmp_path / "cut", cut))
    assert message == (
        f"Qwen3ForCausalLM: the checkpoint's tensors do not load: {ALTERED}: shape (32, 40), expected (32, 48)"
    )
    assert loaded(streamed) == []


# --- units ---------------------------------------------------------------------------------------------------------


def test_every_parameter_belongs_to_one_unit(source):
    streamed = load_layered_reference(source, torch.float32)
    owned = [name for unit in streamed.units for name in [*unit.tensors, *unit.ties]]
    every = [name for name, _ in streamed.model.named_parameters(remove_duplicate=False)]
    assert sorted(owned) == sorted(every)
    assert [unit.name for unit in streamed.layers] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert [unit.name for unit in streamed.units if not unit.is_layer] == [
        "model.embed_tokens",
        "model.norm",
        "lm_head",
    ]


def test_the_largest_unit_is_the_embedding_the_tied_head_loads_too(source):
    streamed = load_layered_reference(source, torch.bfloat16)
    head = next(unit for unit in streamed.units if unit.name == "lm_head")
    assert head.keys == ["model.embed_tokens.weight"]
    assert streamed.largest_unit_bytes() == VOCAB * 32 * 4  # stored in float32


def test_the_router_loss_is_switched_off():
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    model = empty_model(AutoModelForCausalLM.from_config, config, torch.float32)
    StreamedModel(model, {})
    assert all(
        not getattr(module.config, "output_router_logits", False)
        for module in model.modules()
        if hasattr(module, "config")
    )


# --- tensors and the plain loader ----------------------------------------------------------------------------------


def test_rounded_tensors_are_read_rounded_in_their_own_dtype(source):
    tensors = open_source(source)
    try:
        stored = tensors.load(ALTERED)
        read = lazy_tensors(tensors, rounded_to=torch.bfloat16)[ALTERED][...]
    finally:
        tensors.close()
    assert stored.dtype == read.dtype == torch.float32
    assert torch.equal(read, stored.to(torch.bfloat16).float())
    assert not torch.equal(read, stored)


def test_the_plain_loader_loads_in_the_dtype_the_model_was_built_in():
    weight = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3, bias=False)).to(torch.bfloat16)
    ones = torch.ones(1, 4, dtype=torch.bfloat16)

    def plain(stored: torch.Tensor) -> StreamedModel:
        tensors = {"0.weight": LazyTensor(lambda: stored, stored.shape, stored.dtype)}
        return StreamedModel(model, tensors, layer_classes=(), call=lambda module, ids, mask, positions: module(ids))

    streamed = plain(weight)
    with streamed.streaming():
        output = streamed(ones, None, None)
    assert output.dtype == torch.bfloat16
    assert torch.equal(output, ones @ weight.to(torch.bfloat16).T)

    cut = plain(weight[:, :3])
    with pytest.raises(ThinkerError, match=r"^Sequential: 0\.weight has shape \(3, 3\), expected \(3, 4\)$"):
        with cut.streaming():
            cut(ones, None, None)


# --- the prompts the parity gates feed (thinker_common/parity_inputs.py) ------------------------------------------


def test_the_fixed_prompts_are_a_left_padded_batch_of_unequal_rows():
    prompts = fixed_prompts(VOCAB)
    assert [len(prompt) for prompt in prompts] == [7, 4]
    ids, mask, positions = left_padded(prompts)
    assert mask.tolist() == [[1] * 7, [0, 0, 0, 1, 1, 1, 1]]
    assert positions.tolist() == [list(range(7)), [0, 0, 0, 0, 1, 2, 3]]
    assert ids[1, :3].tolist() == [0, 0, 0] and ids[1, 3:].tolist() == prompts[1]


@pytest.mark.parametrize(("context", "reserve"), [(None, 3), (64, 3), (8, 3), (30, 6)])
def test_the_gate_prompts_fit_the_context_and_keep_the_long_ones_unequal(context, reserve):
    prompts = gate_prompts(VOCAB, context, reserve)
    lengths = [len(prompt) for prompt in prompts]
    assert len(prompts) == 4
    if context is None:
        assert lengths == [7, 4, 141, 100]
    else:
        assert max(lengths) + reserve == min(context, 141 + reserve)  # the longest fills the room, never past it
    assert lengths[2] > lengths[3]  # the long rows are padded too
    # a cut prompt keeps its last ids
    room = (context or 1000) - reserve
    assert prompts[:2] == [prompt[-room:] for prompt in fixed_prompts(VOCAB)]
    assert prompts[2:] == long_prompts(VOCAB, context or 141 + reserve, reserve)


# --- FP8 checkpoints read as their float model (thinker_common/fp8_source.py) --------------------------------------


def fp8_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}} | config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_one_scale_for_a_whole_fp8_weight_multiplies_it(tmp_path):
    """A per-tensor scale (one value, for a matrix or a vector): every value times it, as a block scale is."""
    values = (torch.randn(40, 72, generator=torch.Generator().manual_seed(0)) * 100).to(torch.float8_e4m3fn)
    vector = values[0].clone()
    scale = torch.tensor([0.0625])
    tensors = {"w.weight": values, "w.weight_scale_inv": scale, "v.weight": vector, "v.weight_scale_inv": scale.clone()}
    source = open_source(fp8_folder(tmp_path / "per-tensor", tensors, {"dtype": "bfloat16"}))
    try:
        matrix, row = source.load("w.weight"), source.load("v.weight")
    finally:
        source.close()
    assert torch.equal(matrix, values.float() * 0.0625)
    assert torch.equal(row, vector.float() * 0.0625)


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "float16"}, torch.float16),
        ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),  # a multimodal release declares it there
        ({}, torch.float32),
    ],
    ids=["dtype", "torch_dtype", "text_config", "none"],
)
def test_a_dequantized_weight_takes_the_dtype_the_config_declares(tmp_path, config, dtype):
    values, scales = torch.ones(32, 32).to(torch.float8_e4m3fn), torch.ones(1, 1)
    folder = fp8_folder(tmp_path / "declared", {"w.weight": values, "w.weight_scale_inv": scales}, config)
    source = open_source(folder)
    try:
        assert source.dtype("w.weight") == dtype
    finally:
        source.close()


# --- load_thinker (converter/load.py) ------------------------------------------------------------------------------


def test_load_thinker_keeps_the_sources_dtype_and_the_one_asked_in_eval_mode(source, tmp_path):
    from converter.load import load_thinker

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(half)
    converted = load_thinker(half)
    assert not converted.training
    assert {parameter.dtype for parameter in converted.parameters()} == {torch.bfloat16}
    converted.save_pretrained(tmp_path / "thinker")
    native = load_thinker(tmp_path / "thinker", dtype="float32")
    assert not native.training
    assert {parameter.dtype for parameter in native.parameters()} == {torch.float32}


def test_a_key_the_legacy_renames_would_change_loads_under_its_own_name():
    """A key the model holds as it is (``LayerNorm.gamma``), which transformers' legacy renaming would turn into one
    it does not hold (``LayerNorm.weight``), loads under its own name, as ``from_pretrained`` loads it."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Config(PretrainedConfig):
        model_type = "streamed_gamma"

    class Gamma(PreTrainedModel):
        config_class = Config
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.LayerNorm = Scale()

        def forward(self, x):
            return self.LayerNorm(x)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.gamma

    with torch.device("meta"):
        model = Gamma(Config())
    stored = torch.arange(4.0)
    tensors = {"LayerNorm.gamma": LazyTensor(lambda: stored, stored.shape, stored.dtype)}
    streamed = StreamedModel(model, tensors, layer_classes=(), call=lambda module, ids, mask, positions: module(ids))
    assert [unit.keys for unit in streamed.units] == [["LayerNorm.gamma"]]
    with streamed.streaming():
        assert torch.equal(streamed(torch.ones(4), None, None), stored)
