"""The engine: reversible operations, completeness checks before bytes, streaming, shards, dtypes, the output folder."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from cli_helpers import earlier_output
from convert_helpers import QWEN2, assert_same_logits, build_reference, edit_config
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from converter.engine import plan_conversion, stream_tensors, write_weights
from converter.ops import (
    AsRow,
    AsVector,
    Chain,
    Concatenate,
    HalfToInterleavedRope,
    Identity,
    InterleavedToHalfRope,
    Split,
    StackExperts,
    TiledToGroupedValueHeads,
    Transpose,
    UnstackExperts,
)
from converter.shards import ShardLayout
from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.sizes import parse_size
from thinker_common.sources import SafetensorsSource

# --- operations --------------------------------------------------------------------------------------------------

CONFIG = ThinkerConfig(hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=8)


@pytest.mark.parametrize(
    ("op", "shapes"),
    [
        (Identity(), [(3, 4), (5,)]),
        (Transpose(), [(6, 4)]),
        (Split(dim=0, parts=3), [(9, 4)]),
        (Split(dim=0, sizes=lambda c: [c.num_attention_heads * c.head_dim, c.head_dim, c.head_dim]), [(40, 24)]),
        (Concatenate(dim=1, parts=2), [(3, 4), (3, 4)]),
        (StackExperts(), [(4, 6)] * 5),
        (StackExperts(parts=2, dim=1), [(4, 6)] * 10),
        (UnstackExperts(parts=2, dim=1), [(5, 8, 6)]),
        (InterleavedToHalfRope("num_attention_heads"), [(24, 24), (24,)]),
        (HalfToInterleavedRope("num_key_value_heads"), [(8, 24)]),
        (AsRow(), [(24,)]),
        (AsVector(), [(1, 24)]),
        (Chain(Transpose(), Split(dim=0, parts=3)), [(24, 72)]),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, list) else "",
)
def test_every_operation_is_undone_by_its_inverse(op, shapes):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    restored = op.inverse()(op(tensors, CONFIG), CONFIG)
    assert len(restored) == len(tensors)
    for before, after in zip(tensors, restored, strict=True):
        torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_stacked_experts_are_gate_then_up_per_expert():
    gates = [torch.full((2, 3), float(e)) for e in range(4)]
    ups = [torch.full((2, 3), 10.0 + e) for e in range(4)]
    (fused,) = StackExperts(parts=2, dim=1)(gates + ups, CONFIG)
    assert fused.shape == (4, 4, 3)
    assert fused[2, :2].eq(2).all() and fused[2, 2:].eq(12).all()


def test_interleaved_rope_rows_become_half_split():
    # One head of size 4: interleaved pairs (x0, x1), (x2, x3) -> halves (x0, x2 | x1, x3).
    config = ThinkerConfig(hidden_size=4, num_attention_heads=1)
    (half,) = InterleavedToHalfRope("num_attention_heads")([torch.arange(4.0)], config)
    assert half.tolist() == [0.0, 2.0, 1.0, 3.0]


@pytest.mark.parametrize("per_head", [1, 2], ids=["a-row-per-head", "rows-per-head"])
def test_value_heads_tiled_by_llama_cpp_come_back_grouped(per_head):
    """llama.cpp tiles a Gated DeltaNet layer's value heads (v0k0 v0k1 v1k0 v1k1 v2k0 v2k1: tiled position j·K + g
    holds v{j}k{g}) where transformers groups them by key head (v0k0 v1k0 v2k0 v0k1 ...: grouped position g·r + j).
    With 2 key heads and 3 value heads each the map is not its own inverse, as it is with 2 and 2 (the GGUF tests'
    ratio), so only this ratio tells the map from its inverse; the inverse gives the tiled order back."""
    config = ThinkerConfig(
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_value_head_dim=per_head,
    )
    grouped_of_tiled = [0, 3, 1, 4, 2, 5]  # v0k0 v0k1 v1k0 v1k1 v2k0 v2k1, numbered in grouped order
    tiled = torch.tensor([float(head * per_head + row) for head in grouped_of_tiled for row in range(per_head)])
    op = TiledToGroupedValueHeads(elements=per_head > 1)
    (grouped,) = op([tiled], config)
    assert grouped.tolist() == [float(i) for i in range(6 * per_head)]
    (back,) = op.inverse()([grouped], config)
    assert back.tolist() == tiled.tolist()


INVERTIBLE_SOURCES = {
    "qwen2": Qwen2Config(**QWEN2),
    "qwen3": Qwen3Config(**QWEN2, head_dim=12),
    "qwen2_moe": Qwen2MoeConfig(
        **QWEN2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8
    ),
    "qwen3_moe": Qwen3MoeConfig(
        **QWEN2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0]
    ),
    "llama": LlamaConfig(**QWEN2, attention_bias=True),
    "gpt2": GPT2Config(vocab_size=64, n_embd=24, n_layer=2, n_head=3, n_positions=32),
}


@pytest.mark.parametrize("family", sorted(INVERTIBLE_SOURCES))
def test_inverted_table_restores_the_source_tensors(family, tmp_path):
    """Every family's table read backwards gives back the source checkpoint exactly (for writing folders out)."""
    build_reference(INVERTIBLE_SOURCES[family]).save_pretrained(tmp_path)
    source = SafetensorsSource(tmp_path)
    plan = plan_conversion(source, source.config())
    assert plan.family.name == family
    for step in plan.steps:
        originals = [source.load(name) for name in step.sources]
        restored = step.op.inverse()(step.op(originals, plan.config), plan.config)
        for before, after in zip(originals, restored, strict=True):
            assert torch.equal(before, after)
    inverted = plan.family.inverted_tensors()
    assert [entry.sources for entry in inverted] == [entry.targets for entry in plan.family.tensors]


# --- completeness before bytes -----------------------------------------------------------------------------------


@pytest.fixture
def qwen2_tensors(tmp_path):
    """A small Qwen2 checkpoint as a dict, and a function that writes any variant of it and plans its conversion."""
    model = build_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False))
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}

    def plan(variant: dict[str, torch.Tensor], **config_changes):
        folder = tmp_path / "variant"
        folder.mkdir(exist_ok=True)
        save_file(variant, folder / "model.safetensors")
        model.config.save_pretrained(folder)
        edit_config(folder, **config_changes)
        source = SafetensorsSource(folder)
        return plan_conversion(source, source.config())

    return tensors, plan


def test_complete_checkpoint_plans(qwen2_tensors):
    tensors, plan = qwen2_tensors
    result = plan(tensors)
    assert set(result.shapes) == set(tensors) and result.dropped == []


def test_extra_tensor_is_named(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match=r"no qwen2 rule maps.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        plan(tensors | {"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})


def test_missing_tensors_are_named_with_a_count(qwen2_tensors):
    tensors, plan = qwen2_tensors
    dropped = {name for name in tensors if name.endswith("k_proj.bias")}
    with pytest.raises(ThinkerError, match=r"lacks tensors.*layers\.0\.self_attn\.k_proj\.bias.*\(2 in all\)"):
        plan({name: t for name, t in tensors.items() if name not in dropped})


def test_layers_beyond_the_config_are_unmapped(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match=r"no qwen2 rule maps.*model\.layers\.1\..* and \d+ more"):
        plan(tensors, num_hidden_layers=1, layer_types=None)


def test_wrong_shape_is_named_with_both_shapes(qwen2_tensors):
    tensors, plan = qwen2_tensors
    bad = dict(tensors, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(47, 32)})
    with pytest.raises(ThinkerError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: \(47, 32\), expected \(48, 32\)"):
        plan(bad)


def test_config_that_does_not_describe_the_weights(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match=r"shape\(s\) disagree.*gate_proj"):
        plan(tensors, intermediate_size=40)


def test_tied_config_with_a_separate_head(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match=r"tie_word_embeddings=true.*separate lm_head\.weight with other values"):
        plan(tensors, tie_word_embeddings=True)


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16], ids=["same-dtype", "other-dtype"])
def test_tied_config_with_a_copy_of_the_embedding_as_head(qwen2_tensors, head_dtype):
    """Fine-tunes and merges save the tied head as well: one equal to the embedding is dropped, as transformers ties
    it; one value off is refused (bytes compared piece by piece, or values across dtypes)."""
    tensors, plan = qwen2_tensors
    embedding = tensors["model.embed_tokens.weight"].to(torch.bfloat16).float()  # exact in either dtype
    copy = dict(tensors, **{"model.embed_tokens.weight": embedding, "lm_head.weight": embedding.to(head_dtype).clone()})
    result = plan(copy, tie_word_embeddings=True)
    assert result.dropped == ["lm_head.weight"] and "lm_head.weight" not in result.shapes
    off = embedding.clone()
    off[-1, -1] += 1
    with pytest.raises(ThinkerError, match=r"separate lm_head\.weight with other values"):
        plan(dict(copy, **{"lm_head.weight": off.to(head_dtype)}), tie_word_embeddings=True)


def test_a_tied_head_that_differs_beyond_the_first_piece_is_refused(qwen2_tensors, monkeypatch):
    """The head is compared with the embedding ``COPY_PIECE`` bytes at a time: every piece must agree, not only the
    first. With the pieces made small the tiny table spans many; a head one value off in its last row only is
    still refused, and an equal one still dropped."""
    import converter.engine as engine

    monkeypatch.setattr(engine, "COPY_PIECE", 256)
    tensors, plan = qwen2_tensors
    embedding = tensors["model.embed_tokens.weight"]
    assert embedding.numel() * embedding.element_size() >= 8 * engine.COPY_PIECE  # many pieces
    assert plan(dict(tensors, **{"lm_head.weight": embedding.clone()}), tie_word_embeddings=True).dropped == [
        "lm_head.weight"
    ]
    off = embedding.clone()
    off[-1, -1] += 1
    with pytest.raises(ThinkerError, match=r"separate lm_head\.weight with other values"):
        plan(dict(tensors, **{"lm_head.weight": off}), tie_word_embeddings=True)


def test_untied_config_without_a_head(qwen2_tensors):
    tensors, plan = qwen2_tensors
    without_head = {name: t for name, t in tensors.items() if name != "lm_head.weight"}
    with pytest.raises(ThinkerError, match=r"tie_word_embeddings=false.*no lm_head\.weight"):
        plan(without_head)


def test_unknown_model_type(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match=r"model_type 'mamba'.*not supported; supported: gpt2, llama") as err:
        plan(tensors, model_type="mamba", architectures=["MambaForCausalLM"])
    assert "qwen35moe" not in str(err.value)  # a GGUF's architecture name, not a config.json model_type


def test_sliding_window_checkpoints_are_refused(qwen2_tensors):
    tensors, plan = qwen2_tensors
    with pytest.raises(ThinkerError, match="sliding-window attention on layers"):
        plan(tensors, use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None)


def test_a_qwen3_moe_sliding_over_every_layer_is_refused(tmp_path):
    """Qwen3-MoE's config has no layer_types: use_sliding_window slides the window over every layer of its class."""
    build_reference(INVERTIBLE_SOURCES["qwen3_moe"]).save_pretrained(tmp_path)
    edit_config(tmp_path, use_sliding_window=True, sliding_window=16)
    source = SafetensorsSource(tmp_path)
    with pytest.raises(ThinkerError, match=r"sliding-window attention on every layer \(use_sliding_window, sliding_"):
        plan_conversion(source, source.config())
    edit_config(tmp_path, use_sliding_window=False)  # sliding_window alone is a default transformers ignores then
    assert plan_conversion(source, source.config()).family.name == "qwen3_moe"


# --- values and dtypes -------------------------------------------------------------------------------------------


def test_float16_overflow_is_named(qwen2_tensors, run_convert, tmp_path):
    tensors, _ = qwen2_tensors
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = 70000.0
    source = tmp_path / "overflow"
    build_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False)).config.save_pretrained(source)
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ThinkerError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight.*70000.*float16"):
        run_convert(source, dtype="float16")
    assert not (tmp_path / "out").exists()
    assert run_convert(source, dtype="bfloat16", verify=False).dtype == "bfloat16"  # bfloat16 has the range


def test_nan_weights_are_named(qwen2_tensors, run_convert, tmp_path):
    tensors, _ = qwen2_tensors
    tensors["model.norm.weight"][3] = float("nan")
    source = tmp_path / "nan"
    build_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False)).config.save_pretrained(source)
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ThinkerError, match=r"model\.norm\.weight.*NaN or Inf"):
        run_convert(source, verify=False)


def test_bfloat16_output_is_verified_in_both_dtypes(save_reference, run_convert):
    model, source = save_reference(Qwen2Config(**QWEN2))
    result = run_convert(source, dtype="bfloat16")
    assert [r.dtype for r in result.parity.results] == ["float32", "bfloat16"]
    assert result.parity.passed
    weights = load_file(result.output / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    with torch.no_grad():  # the converter's rounding, on the parameters only (not the RoPE buffers)
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    assert_same_logits(model, result.output)


def test_auto_dtype_follows_the_source_config(save_reference, run_convert):
    model, source = save_reference(Qwen2Config(**QWEN2, dtype="float16"))
    model.half().save_pretrained(source)
    result = run_convert(source, verify=False)
    assert result.dtype == "float16" and ThinkerConfig.from_pretrained(result.output).dtype == torch.float16


# --- shards and streaming ----------------------------------------------------------------------------------------


def test_sharded_source_and_sharded_output(save_reference, run_convert):
    model, source = save_reference(Qwen2Config(**QWEN2), max_shard_size="20KB")
    assert (source / "model.safetensors.index.json").is_file()
    result = run_convert(source, max_shard_size="16KB")
    index = json.loads((result.output / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((result.output / shard).stat().st_size <= 16_000 + 4096 for shard in shards[:-1])  # + header
    assert index["metadata"]["total_size"] == result.total_bytes
    assert result.parity.passed
    assert_same_logits(model, result.output)


def test_a_shard_filled_exactly_to_the_limit_is_not_split():
    """transformers' rule: a new shard starts only when the next tensor would go past max_shard_size, so two 4 KiB
    tensors fill an 8 KiB shard exactly, and one byte less splits them."""
    tensors = [("a", (1024,), torch.float32), ("b", (1024,), torch.float32)]
    assert ShardLayout(tensors, 8192).num_shards == 1
    split = ShardLayout(tensors, 8191)
    assert split.num_shards == 2 and [slot.shard for slot in split.slots.values()] == [0, 1]


@pytest.mark.parametrize("max_shard_size", ["5GB", "16KB"], ids=["one file", "shards"])
def test_written_headers_are_padded_and_one_file_has_no_index(save_reference, run_convert, max_shard_size):
    """Each header's length is a multiple of 8, so the data starts 8-byte aligned (safetensors' rule, which readers
    that map the file rely on); a single model.safetensors has no index beside it, as transformers writes it."""
    _, source = save_reference(Qwen2Config(**QWEN2))
    output = run_convert(source, verify=False, max_shard_size=max_shard_size).output
    shards = sorted(output.glob("*.safetensors"))
    assert (len(shards) == 1) == (max_shard_size == "5GB")
    assert (output / "model.safetensors.index.json").is_file() == (len(shards) > 1)
    for shard in shards:
        with shard.open("rb") as handle:
            assert int.from_bytes(handle.read(8), "little") % 8 == 0, shard.name


@pytest.mark.parametrize("kernel_copy", ["copy_file_range", "refused"])
def test_unchanged_tensors_are_copied_byte_for_byte(save_reference, run_convert, monkeypatch, kernel_copy):
    """float32 to float32 copies each tensor's bytes (by the kernel, or through a buffer where copy_file_range
    refuses the two files): the output tensors equal the source's bit for bit, across shards on both sides."""
    import errno
    import os

    calls = []

    def refused(*args):
        calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    if kernel_copy == "refused":
        monkeypatch.setattr(os, "copy_file_range", refused)
    model, source = save_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False), max_shard_size="20KB")
    result = run_convert(source, max_shard_size="16KB", verify=False)
    index = json.loads((result.output / "model.safetensors.index.json").read_text())
    converted = {}
    for shard in set(index["weight_map"].values()):
        converted |= load_file(result.output / shard)
    expected = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    assert converted.keys() == expected.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor.view(torch.int32), expected[name].contiguous().view(torch.int32)), name
    assert bool(calls) == (kernel_copy == "refused")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1024") == 1024
    assert parse_size(1024) == 1024  # Python callers pass byte counts
    assert parse_size("8G") == parse_size("8g") == 8 * 2**30 and parse_size("512M") == 512 * 2**20  # docker's letters
    for bad in ("five gigs", "-5MB", 0, -5, 1.5, True, None):  # as the CLI refuses them, from Python too
        with pytest.raises(ThinkerError, match="not a size"):
            parse_size(bad)
    with pytest.raises(ThinkerError, match="'0': a size must be above 0"):
        parse_size("0")
    for fraction in ("0.5", "0.1B", "0.9"):  # above 0, but no whole byte: as good as 0
        with pytest.raises(ThinkerError, match=f"size '{fraction}' is less than one byte"):
            parse_size(fraction)
    assert parse_size("0.5KB") == 500 and parse_size("1.5GiB") == 3 * 2**29
    # exact, however long: no float to round a byte count or overflow to infinity
    assert parse_size("9007199254740993") == 2**53 + 1 and parse_size("1" + "0" * 400) == 10**400


class TrackedSource:
    """A source that records how many bytes of loaded tensors are still alive at each load: the engine's memory."""

    def __init__(self, source) -> None:
        self._source = source
        self.root = source.root
        self.live = 0
        self.peak = 0

    def __getattr__(self, name):
        return getattr(self._source, name)

    def load(self, name: str, scan=None) -> torch.Tensor:
        tensor = self._source.load(name, scan)
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        # The storage, not the tensor: views handed on (splits, transposes) keep the bytes alive.
        weakref.finalize(tensor.untyped_storage(), self._release, size)
        return tensor

    def _release(self, size: int) -> None:
        self.live -= size


def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4
    )
    build_reference(config).save_pretrained(tmp_path / "source", max_shard_size="300KB")
    source = TrackedSource(SafetensorsSource(tmp_path / "source"))
    plan = plan_conversion(source, source.config())
    largest = max(_bytes(source, name) for name in source.names())
    (tmp_path / "out").mkdir()
    write_weights(plan, source, tmp_path / "out", max_shard_size=10**6, progress=False)
    total = sum(_bytes(source, name) for name in source.names())
    assert total > 20 * largest
    assert source.peak <= 2 * largest, f"peak {source.peak} bytes of source tensors alive; largest is {largest}"
    assert source.live == 0


def _bytes(source, name) -> int:
    count = source.dtype(name).itemsize
    for size in source.shape(name):
        count *= size
    return count


def test_streaming_yields_each_parameter_once_in_source_order(save_reference):
    _, folder = save_reference(Qwen2Config(**QWEN2))
    source = SafetensorsSource(folder)
    plan = plan_conversion(source, source.config())
    names = [name for name, _ in stream_tensors(plan, source)]
    assert names == list(plan.shapes) and len(set(names)) == len(names)


# --- the output folder -------------------------------------------------------------------------------------------


def test_output_folder_contents_and_remote_code(save_reference, run_convert, tmp_path):
    model, source = save_reference(Qwen2Config(**QWEN2, bos_token_id=1, eos_token_id=2))
    (source / "tokenizer.json").write_text(Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str())
    (source / "tokenizer_config.json").write_text("{}")
    (source / "merges.txt").write_text("#version: 0.2\n")
    result = run_convert(source, verify=False)
    files = {path.name for path in result.output.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "merges.txt"} <= files
    assert {"modeling_thinker.py", "configuration_thinker.py"} <= files
    config = json.loads((result.output / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_thinker.ThinkerForCausalLM"
    # every head the folder's code holds, as a Qwen3 folder loads any head
    assert config["auto_map"]["AutoModelForQuestionAnswering"] == "modeling_thinker.ThinkerForQuestionAnswering"
    assert json.loads((result.output / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(tmp_path.glob(".out.*")), "the staging folder was left behind"

    # Where the thinker package cannot be imported, the folder's own code loads it (trust_remote_code).
    script = (
        "import sys, torch; sys.path = [p for p in sys.path if p not in ('', '.', sys.argv[2])]\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "print(m(torch.tensor([[1, 2, 3]])).logits[0, -1, :4].tolist())\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(result.output), repo],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    expected = AutoModelForCausalLM.from_pretrained(result.output)(torch.tensor([[1, 2, 3]])).logits[0, -1, :4]
    torch.testing.assert_close(torch.tensor(json.loads(done.stdout.strip().splitlines()[-1])), expected)


def test_existing_output_is_untouched_without_force(save_reference, run_convert, tmp_path):
    _, source = save_reference(Qwen2Config(**QWEN2))
    existing = earlier_output(tmp_path / "out", {"keep.txt": "mine"})  # which --force may replace
    with pytest.raises(ThinkerError, match="already exists; pass --force"):
        run_convert(source)
    assert sorted(p.name for p in existing.iterdir()) == ["README.md", "config.json", "keep.txt"]

    result = run_convert(source, force=True, verify=False)
    assert not (result.output / "keep.txt").exists() and (result.output / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_failed_conversion_leaves_an_existing_output_in_place(qwen2_tensors, run_convert, tmp_path):
    tensors, _ = qwen2_tensors
    tensors["model.embed_tokens.weight"][0, 0] = float("inf")
    source = tmp_path / "broken"
    build_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False)).config.save_pretrained(source)
    save_file(tensors, source / "model.safetensors")
    earlier_output(tmp_path / "out", {"keep.txt": "mine"})  # which --force may replace
    with pytest.raises(ThinkerError, match="NaN or Inf"):
        run_convert(source, force=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_output_may_not_replace_its_source(save_reference, run_convert, tmp_path):
    _, source = save_reference(Qwen2Config(**QWEN2))
    with pytest.raises(ThinkerError, match="OUTPUT is the source .* itself"):
        run_convert(source, name="source", force=True)
    assert (source / "model.safetensors").is_file()


def test_pytorch_bin_source(tmp_path, run_convert):
    # transformers 5 no longer writes .bin files; older checkpoints hold them. They are read with
    # torch.load(weights_only=True, mmap=True): nothing beyond tensors is unpickled.
    model = build_reference(Qwen2Config(**QWEN2))
    source = tmp_path / "bin"
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    result = run_convert(source)
    assert result.parity.passed
    assert_same_logits(model, result.output)


def test_sharded_bin_source_and_an_index_that_misfiles_a_tensor(tmp_path, run_convert):
    """Sharded ``.bin`` files are read through their index, and an index from another download (one tensor
    named in the wrong shard) is refused by name, not taken for a checkpoint lacking that tensor."""
    model = build_reference(Qwen2Config(**QWEN2))
    source = tmp_path / "bins"
    model.config.save_pretrained(source)
    state = model.state_dict()
    last = {name: state.pop(name) for name in ("model.norm.weight", "lm_head.weight")}
    torch.save(state, source / "pytorch_model-00001-of-00002.bin")
    torch.save(last, source / "pytorch_model-00002-of-00002.bin")
    weight_map = {name: "pytorch_model-00001-of-00002.bin" for name in state}
    norm = {"model.norm.weight": "pytorch_model-00002-of-00002.bin"}
    index = source / "pytorch_model.bin.index.json"
    index.write_text(
        json.dumps(
            {"metadata": {}, "weight_map": weight_map | norm | {"lm_head.weight": "pytorch_model-00002-of-00002.bin"}}
        )
    )
    assert_same_logits(model, run_convert(source).output)

    misfiled = weight_map | norm | {"lm_head.weight": "pytorch_model-00001-of-00002.bin"}
    index.write_text(json.dumps({"weight_map": misfiled}))
    with pytest.raises(
        ThinkerError, match="maps tensor 'lm_head.weight' to 'pytorch_model-00001-of-00002.bin', which does not hold it"
    ):
        run_convert(source, name="again")

    # an index that leaves the last shard out, that shard beside it unnamed: the index named as damaged, not the
    # config told to tie the head (which would make it a copy of the embedding: a QA run)
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ThinkerError, match="names no tensor in pytorch_model-00002-of-00002.bin, a shard of its own"):
        run_convert(source, name="again")


# --- throughput mechanics: values checked as bytes are read, one fsync per file ----------------------------------


def test_values_are_checked_piece_by_piece_as_they_are_read(tmp_path):
    """A tensor of several read pieces, with a bad value in its last element only: the pieces scanned as they
    arrive (``load(scan=...)`` and the unchanged-copy path's ``read_pieces``) still find it, and every byte read
    in pieces is the tensor's."""
    from converter.engine import COPY_PIECE
    from thinker_common.values import ValueScan

    values = torch.randn(3 * COPY_PIECE // 4 + 5)  # float32: 3 pieces and a partial one
    save_file({"w": values}, tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path)
    scan = ValueScan()
    assert torch.equal(source.load("w", scan=scan), values) and scan.problem(torch.float32) is None
    pieces = [piece.clone() for piece in source.read_pieces("w", torch.empty(COPY_PIECE, dtype=torch.uint8))]
    assert len(pieces) == 4 and torch.equal(torch.cat(pieces).view(torch.float32), values)

    values[-1] = float("nan")
    save_file({"w": values}, tmp_path / "model.safetensors")
    scan = ValueScan()
    SafetensorsSource(tmp_path).load("w", scan=scan)
    assert scan.problem(torch.float32) == "holds NaN or Inf values"
    values[-1] = 7e4
    scan = ValueScan()
    scan.update(values)
    assert scan.problem(torch.float32) is None and "beyond float16" in scan.problem(torch.float16)


def test_unchanged_tensors_are_copied_and_checked_in_pieces(qwen2_tensors, run_convert, tmp_path, monkeypatch):
    """Renamed tensors in the output dtype never exist whole in memory: their bytes go through the small reused
    buffer (and a NaN among them is still named); converted ones (a cast) are loaded whole."""
    import converter.engine as engine

    copied, loaded = [], []
    monkeypatch.setattr(SafetensorsSource, "read_pieces", _recording(SafetensorsSource.read_pieces, copied))
    monkeypatch.setattr(SafetensorsSource, "load", _recording(SafetensorsSource.load, loaded))
    tensors, _ = qwen2_tensors
    source = tmp_path / "source"
    build_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False)).config.save_pretrained(source)
    save_file(tensors, source / "model.safetensors")
    run_convert(source, "same", verify=False)
    assert sorted(copied) == sorted(tensors) and not loaded
    copied.clear()
    run_convert(source, "cast", verify=False, dtype="bfloat16")
    assert sorted(loaded) == sorted(tensors) and not copied

    tensors["model.layers.0.mlp.up_proj.weight"][-1, -1] = float("inf")
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ThinkerError, match=r"source tensor model\.layers\.0\.mlp\.up_proj\.weight .*NaN or Inf"):
        run_convert(source, "bad", verify=False)
    assert engine.COPY_PIECE < 8 << 20  # the buffer stays small whatever the tensor


def _recording(method, names: list):
    def record(self, name, *args, **kwargs):
        names.append(name)
        return method(self, name, *args, **kwargs)

    return record


def test_one_fsync_per_shard(save_reference, run_convert, monkeypatch):
    import os

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda descriptor: synced.append(descriptor) or real_fsync(descriptor))
    _, source = save_reference(Qwen2Config(**QWEN2))
    result = run_convert(source, verify=False, max_shard_size="20KB")
    shards = [name for name in result.files if name.endswith(".safetensors")]
    assert len(shards) > 3 and len(synced) == len(shards)


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_numbered_shards_without_their_index(save_reference, run_convert, kind):
    """Without its index the converter reads a whole set of shards (--no-verify), where transformers' reference
    cannot: the gate's error says so; a set that lacks a member is refused by the file's name, not as missing
    tensors."""
    model, source = save_reference(Qwen2Config(**QWEN2, tie_word_embeddings=False), max_shard_size="20KB")
    (source / "model.safetensors.index.json").unlink()
    index = "model.safetensors.index.json"
    if kind == "bin":  # transformers 5 writes safetensors only: the same shards as an older save's .bin files
        index = "pytorch_model.bin.index.json"
        for shard in source.glob("model-*.safetensors"):
            torch.save(
                load_file(shard),
                source / shard.name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin"),
            )
            shard.unlink()
    shards = sorted(path.name for path in source.iterdir() if "-of-" in path.name)
    assert len(shards) > 2
    assert_same_logits(model, run_convert(source, "unverified", verify=False).output)
    with pytest.raises(ThinkerError, match=rf"its shards \({shards[0]}, \.\.\.\) have no {index}, which transformers"):
        run_convert(source, "verified")
    (source / shards[1]).unlink()
    with pytest.raises(ThinkerError, match=rf"of a set of {len(shards)} .* but not {shards[1]}, and no {index}"):
        run_convert(source, "incomplete", verify=False)


@pytest.mark.parametrize(
    ("folder", "stored", "kept"),
    [
        (torch.bfloat16, {"a": torch.float32}, torch.float32),  # Qwen3.5's A_log beside bfloat16 weights
        (torch.bfloat16, {"a": torch.float16}, torch.float16),  # a GGUF file's F16 beside BF16: bfloat16 rounds it
        (torch.float16, {"a": torch.bfloat16}, torch.bfloat16),  # and float16 cannot hold bfloat16's range
        (torch.bfloat16, {"a": torch.float16, "b": torch.bfloat16}, torch.float32),  # one step from both: neither
        (torch.float32, {"a": torch.float16, "b": torch.bfloat16}, None),  # float32 holds both
        (torch.bfloat16, {"a": torch.bfloat16}, None),
    ],
)
def test_auto_keeps_every_tensor_the_folder_dtype_would_round(folder, stored, kept):
    """From a QA sweep: a GGUF file's F16 tensors went into a bfloat16 folder rounded (by up to 0.002), since the
    rule kept only tensors stored in more bytes; float16 and bfloat16 each hold values the other rounds."""
    from converter.engine import Step
    from converter.output_dtype import kept_wider

    class Stored:
        def dtype(self, name):
            return stored[name]

    step = Step(sources=tuple(stored), targets=("model.t",), op=None)
    assert kept_wider("auto", folder, [step], Stored()) == ({} if kept is None else {"model.t": kept})
    assert kept_wider("bfloat16", folder, [step], Stored()) == {}  # a dtype asked for casts all
