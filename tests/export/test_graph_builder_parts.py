"""Parts of the graph builders (export/decoder_graph.py, fused_graph.py, hybrid_attention_graph.py) and of the
check's helpers (export/half_spread.py, deep_cache.py) that only some configs reach, each held to what it promises:
multimodal RoPE in Qwen2-VL's contiguous sections, the half-precision graphs' zero-centred norms."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from export_helpers import save_thinker

from export.exporter import export_model
from export.graph_walk import all_nodes
from export.names import MODEL_FILE
from export.runtime import DecoderState, OnnxDecoder

# --- multimodal RoPE in contiguous sections (Qwen2-VL's layout, ``mrope_interleaved: false``) -----------------------
# head_dim 16: 8 rotary frequencies, [4, 2, 2] in sections (t t t t h h w w) where the interleaved layout reads
# t h w t h w t t: the two layouts give different logits for the same (3, B, T) positions.
SECTIONS = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2], "mrope_interleaved": False}


@pytest.fixture(scope="module")
def sectioned(tmp_path_factory):
    """(the Thinker folder, {graph: its unverified export}) of a dense Qwen3 with sectioned multimodal RoPE."""
    root = tmp_path_factory.mktemp("sectioned-mrope")
    folder = save_thinker(root / "thinker", "qwen3", tokenizer=False, head_dim=16, rope_parameters=SECTIONS)
    exports = {}
    for graph in ("plain", "fused"):
        export_model(folder, root / graph, graph=graph, verify=False, progress=False)
        exports[graph] = root / graph
    return folder, exports


def distinct_streams(batch: int = 2, length: int = 9) -> np.ndarray:
    """(3, B, T) positions whose temporal, height and width streams all differ."""
    t = np.arange(length)
    streams = [t, t * 3 % 7, t * 5 % 11 + 2]
    return np.stack([np.tile(s, (batch, 1)) for s in streams]).astype(np.int64)


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_sectioned_multimodal_rope_reads_each_frequencys_own_stream(graph, sectioned):
    """Each frequency rotates by the stream its section gives it, as the PyTorch Thinker does: the plain graph's
    stream selector and the fused graph's MRotaryEmbedding (mrope_layout 0) follow ``mrope_interleaved: false``
    (read as interleaved, the logits move by about half the logit scale)."""
    from thinker import ThinkerForCausalLM

    folder, exports = sectioned
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    ids = np.random.default_rng(0).integers(3, 96, size=(2, 9)).astype(np.int64)
    mask, positions = np.ones_like(ids), distinct_streams()
    with torch.no_grad():
        reference = model(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(positions)
        ).logits.numpy()
    decoder = OnnxDecoder(exports[graph], provider="cpu")
    ours = decoder.forward(ids, positions, DecoderState(mask, None, decoder.empty_cache(2)))
    scale = max(1.0, float(np.abs(reference).max()))
    np.testing.assert_allclose(ours, reference, atol=1e-4 * scale, rtol=0)


# --- zero-centred norms in a half-precision fused graph -------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_fused_graphs_keep_the_plain_zero_centred_norm(dtype, onnx_variant):
    """The contrib norms scale in the model dtype where Qwen3.5's RMSNorm scales by ``1 + w`` in float32 before
    rounding, so a half-precision fused graph (float16 and bfloat16 alike) writes the plain graph's norm for every
    zero-centred layer norm; a float32 one folds it into (Skip)SimplifiedLayerNormalization."""

    def contrib_norms(dtype: str) -> Counter:
        """The (Skip)SimplifiedLayerNormalization nodes by op, but the linear-attention layers' l2 norm of q and k
        (a SimplifiedLayerNormalization with no zero-centred weight, in any dtype)."""
        graph = onnx.load(onnx_variant("qwen3_5", dtype=dtype, head_dim=None) / MODEL_FILE, load_external_data=False)
        nodes = (n for n in all_nodes(graph.graph) if n.op_type.endswith("SimplifiedLayerNormalization"))
        return Counter(n.op_type for n in nodes if "/qk_l2norm/" not in n.name)

    # float32: the first layer's input norm and the 2 attention layers' q and k norms alone, the other 7 layer norms
    # and the final norm after their residual add
    assert contrib_norms("float32") == {"SimplifiedLayerNormalization": 5, "SkipSimplifiedLayerNormalization": 8}
    assert contrib_norms(dtype) == {}


# --- the half-precision shadow's cast (export/half_spread.py) -------------------------------------------------------
def test_a_forward_that_raises_in_half_precision_leaves_the_float32_model(thinker_variant, monkeypatch):
    """``running_in`` casts each unit as it runs and puts its float32 tensors back after it; a unit that raises never
    reaches its own restore, so leaving the block must: the very float32 tensors back, and the model's float32 logits
    as before (the check goes on to compare with them)."""
    from export.half_spread import running_in
    from thinker import ThinkerForCausalLM
    from thinker_common.eager import EAGER

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3"), dtype=torch.float32, **EAGER).eval()
    before = dict(model.named_parameters())
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(model.model.layers[1].mlp, "forward", fails)  # inside layer 1, after its cast
    with pytest.raises(RuntimeError, match="out of memory, say"), running_in(model, torch.float16), torch.no_grad():
        model(input_ids=ids)
    monkeypatch.undo()
    cast = [name for name, tensor in model.named_parameters() if tensor is not before[name]]
    assert cast == []
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_a_replayed_shadow_keeps_its_caches_as_they_are(thinker_variant):
    """A second pass over the same reference steps reads the spreads back (``rewind``) and runs nothing, so the
    caller's cache edit between its steps (the deep-cache pass's random slots) is already in the shadow's caches:
    it is applied on the first pass only, never written twice."""
    from export.half_spread import HalfShadow
    from thinker import ThinkerForCausalLM
    from thinker_common.eager import EAGER

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3"), dtype=torch.float32, **EAGER).eval()
    ids = torch.tensor([[3, 5, 7, 11]])
    shadow = HalfShadow(model, torch.float16)
    edited = []
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        first = shadow.spread(logits, input_ids=ids)
        shadow.edit_cache(edited.append)
        assert edited == [shadow.past, shadow.perturbed_past]
        shadow.rewind()
        again = shadow.spread(logits, input_ids=ids)
        shadow.edit_cache(edited.append)
    assert shadow.replayed and again is first
    assert len(edited) == 2  # the replay's edit left out


# --- refusals before any byte is written ---------------------------------------------------------------------------
def test_a_rotary_part_wider_than_the_head_is_refused_before_writing(tmp_path):
    """partial_rotary_factor 1.5 on head_dim 16 asks for 24 rotated channels: refused by name before the export
    writes anything (unrefused, the graph is written and onnxruntime fails its check in a Split)."""
    from thinker_common.errors import ThinkerError

    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}
    folder = save_thinker(tmp_path / "thinker", "qwen3", tokenizer=False, head_dim=16, rope_parameters=rope)
    message = "partial_rotary_factor=1.5 rotates 24 channels of a head of head_dim=16; it must be at most 1"
    with pytest.raises(ThinkerError, match=re.escape(message)):
        export_model(folder, tmp_path / "onnx", verify=False, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["thinker"]
