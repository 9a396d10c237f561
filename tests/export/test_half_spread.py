"""A half-precision graph's check excuses a position only within twice the reference's own half-precision rounding
there (export/half_spread.py): the reference run in half precision is exactly the model loaded in half precision,
whole or streamed, and leaves the float32 model as it was; the excuse covers those positions and no others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.eager import EAGER
from common.parity_inputs import parity_batch
from export.half_spread import HALF_SPREAD_MARGIN, HalfShadow, running_in
from export.runtime import position_ids_from_mask
from export.verify import Agreement, beyond, judged_diff
from thinker.modeling_thinker import CACHE_ARG


def prefill(model) -> torch.Tensor:
    ids, mask = parity_batch(model.config.vocab_size)
    inputs = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "position_ids": torch.from_numpy(position_ids_from_mask(mask)),
    }
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5", "qwen4_exp"])
def test_running_in_half_is_the_model_loaded_in_half(family, thinker_variant):
    """Gated DeltaNet's conv weights, the experts' 3-D tensors, Qwen3.8's hyper-connection mixer: every unit cast as
    it runs, the same logits bit for bit as from_pretrained(dtype=float16), and the float32 tensors back after."""
    from converter.layer_parity import load_layered_converted
    from thinker import ThinkerForCausalLM

    folder = thinker_variant(family)
    model = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32, **EAGER).eval()
    before = {name: tensor for name, tensor in model.named_parameters()}
    loaded_in_half = prefill(ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float16, **EAGER).eval())
    with running_in(model, torch.float16):
        cast = prefill(model)
    assert cast.dtype == torch.float16
    torch.testing.assert_close(cast, loaded_in_half, rtol=0, atol=0)
    assert all(tensor is before[name] for name, tensor in model.named_parameters())  # the same float32 tensors
    assert not torch.equal(prefill(model).half(), cast)  # and the float32 model runs in float32 again

    streamed = load_layered_converted(folder, torch.float32)
    try:
        with streamed.streaming(), running_in(streamed.model, torch.float16):
            torch.testing.assert_close(prefill(streamed.model), loaded_in_half, rtol=0, atol=0)
        assert all(parameter.is_meta for parameter in streamed.model.parameters())  # every unit dropped again
    finally:
        streamed.close()


def test_half_shadow_follows_the_reference_through_its_cache(thinker_variant):
    """The shadow's spread at a decode step is its own cached half-precision run against the float32 step's."""
    from thinker import ThinkerForCausalLM

    folder = thinker_variant("qwen3")
    model = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32, **EAGER).eval()
    half = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float16, **EAGER).eval()
    ids = torch.tensor([[3, 5, 7, 11]])
    shadow = HalfShadow(model, torch.float16)
    with torch.no_grad():
        out = model(input_ids=ids[:, :3], use_cache=True)
        shadow.spread(out.logits, input_ids=ids[:, :3])
        step = model(input_ids=ids[:, 3:], use_cache=True, **{CACHE_ARG: getattr(out, CACHE_ARG)})
        spread = shadow.spread(step.logits, input_ids=ids[:, 3:])
        whole = half(input_ids=ids).logits[:, -1:]
    expected = (whole.float() - step.logits.float()).abs().amax(-1).numpy()
    np.testing.assert_allclose(spread, expected, rtol=0, atol=2e-3 * float(step.logits.abs().max()))


def test_agreement_excuses_a_difference_only_within_its_own_positions_spread():
    reference = np.zeros((3, 4), dtype=np.float32)
    candidate = reference.copy()
    candidate[:, 0] = [3.0, 3.0, 0.5]  # each row's difference
    agreement = Agreement()
    agreement.add(reference, candidate, spread=np.array([3.0 / HALF_SPREAD_MARGIN, 1.0, 0.0]))
    figures = agreement.figures()
    assert figures["max_abs_diff"] == 3.0
    assert figures["max_abs_diff_beyond_spread"] == 3.0  # the second row's 3.0 is more than twice its spread of 1
    assert judged_diff(figures) == 3.0 and "leaving out positions" in beyond(figures, 1.0)

    excused = Agreement()
    excused.add(reference, candidate, spread=np.array([1.5, 1.5, 0.0]))
    assert excused.figures()["max_abs_diff_beyond_spread"] == 0.5  # both 3.0 within twice 1.5: the 0.5 is held

    float32 = Agreement()
    float32.add(reference, candidate)
    assert "max_abs_diff_beyond_spread" not in float32.figures() and judged_diff(float32.figures()) == 3.0


def test_a_shared_shadow_reads_back_what_it_measured(thinker_variant, onnx_variant):
    """model.onnx and model.genai.onnx are compared with the same reference steps: the second comparison reads the
    half-precision spreads back (the half run costs most of a CPU check), the figures those of a shadow of its own."""
    from export.runtime import OnnxDecoder
    from export.verify import compare_decoders, half_shadow
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", dtype="float16") / "model.onnx", provider="cpu")
    batch = parity_batch(model.config.vocab_size)
    shared = half_shadow(model.eval(), torch.float16)
    first = compare_decoders(model, decoder, *batch, shadow=shared)
    measured = len(shared.spreads)
    again = compare_decoders(model, decoder, *batch, shadow=shared)
    assert len(shared.spreads) == measured == 1 + first["decode_steps"]  # nothing run twice
    assert again == first == compare_decoders(model, decoder, *batch, shadow=half_shadow(model, torch.float16))
    assert first["half_precision_spread"] > 0 and half_shadow(model, torch.float32) is None
