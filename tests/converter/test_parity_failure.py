"""The default conversion path (parity on, as when both models fit in memory) refuses a conversion that does not
match its reference (issue 15): a bug planted in the converter (layer 1's down projection scaled while streaming)
ends in exit 1, the parity table naming the first diverging layer, an error line naming it too, and no OUTPUT."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from transformers import GPT2Config, Qwen3Config

from thinker_common.cli import main

QWEN3 = Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
PLANTED = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "planted, named",
    [
        ("model.layers.2.mlp.down_proj.weight", "layer 2"),
        # transformers reports the last hidden state after the final norm, so a wrong norm was named "layer 2"
        # (a QA run); the last layer's own output, taken by a hook, tells them apart
        ("model.norm.weight", "the final norm or the head (every layer's output agrees)"),
    ],
)
def test_the_last_layer_and_the_final_norm_are_told_apart(planted, named, save_reference, tmp_path, monkeypatch):
    import converter.engine as engine

    _, source = save_reference(QWEN3)
    original = engine.finish_tensor

    def finish_tensor(tensor, target, *args, **kwargs):
        finished = original(tensor, target, *args, **kwargs)
        return finished * 1.5 if target == planted else finished

    monkeypatch.setattr(engine, "finish_tensor", finish_tensor)
    monkeypatch.setattr(engine, "copies_bytes", lambda *_: False)
    result = CliRunner().invoke(main, ["convert", str(source), str(tmp_path / "broken")])
    assert result.exit_code == 1 and f"FAIL (first divergence: {named})" in result.stdout, result.output


def test_the_default_path_fails_parity_and_installs_nothing(save_reference, tmp_path, monkeypatch):
    import converter.engine as engine

    _, source = save_reference(QWEN3)
    output = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(source), str(output)])  # no --verify: the default path
    assert result.exit_code == 0, result.output
    assert "pass" in result.stdout  # the check ran, and passes without the planted bug

    original = engine.finish_tensor

    def finish_tensor(tensor, target, *args, **kwargs):
        finished = original(tensor, target, *args, **kwargs)
        return finished * 1.5 if target == PLANTED else finished

    monkeypatch.setattr(engine, "finish_tensor", finish_tensor)
    monkeypatch.setattr(engine, "copies_bytes", lambda *_: False)  # renames too go through finish_tensor
    output = tmp_path / "broken"
    result = CliRunner().invoke(main, ["convert", str(source), str(output)])
    assert result.exit_code == 1, result.output
    assert "FAIL (first divergence: layer 1)" in result.stdout
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {output}: does not match its reference") and "layer 1" in line, line
    assert "nothing written" in line
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]


@pytest.mark.parametrize("options", [[], ["--verify-by-layer"]], ids=["whole-model", "layer-by-layer"])
def test_a_reference_that_fails_on_the_prompts_is_named(options, save_reference, tmp_path, monkeypatch):
    """transformers' class may accept a config it cannot run: its forward's error, inside the gate, was a traceback
    (in either mode: a review found the layer check's). Now one line naming the class and what it raised, and
    nothing is installed."""
    import transformers

    _, source = save_reference(QWEN3)

    def broken(self, *args, **kwargs):
        raise RuntimeError("The size of tensor a (16) must match the size of tensor b (8)")

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "forward", broken)
    output = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(source), str(output), *options])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "transformers' Qwen3ForCausalLM fails on the parity prompts (RuntimeError: The size of tensor a" in line
    assert "--no-verify" in line and not output.exists()


@pytest.mark.parametrize("options", [[], ["--verify-by-layer"]], ids=["whole-model", "layer-by-layer"])
@pytest.mark.parametrize("context", [8, 12])
def test_a_short_context_cuts_every_prompt(context, options, save_reference, tmp_path):
    """A sound GPT-2 with n_positions 12 failed the whole-model gate as if transformers' class could not run it,
    and with 8 the layer check showed a traceback (its decode steps past the position table): the fixed prompts
    were not cut to the context, the long ones were (a QA run). Every prompt is now cut so that it and the greedy
    tokens fit; both modes pass."""
    _, source = save_reference(GPT2Config(vocab_size=67, n_embd=32, n_layer=2, n_head=4, n_positions=context))
    result = CliRunner().invoke(main, ["convert", str(source), str(tmp_path / "out"), *options])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("options", [[], ["--verify-by-layer"]], ids=["whole-model", "layer-by-layer"])
def test_a_context_shorter_than_the_greedy_tokens_is_refused_by_name(options, save_reference, tmp_path):
    _, source = save_reference(GPT2Config(vocab_size=67, n_embd=32, n_layer=2, n_head=4, n_positions=6))
    output = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(source), str(output), *options])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "a context of 6 positions (max_position_embeddings) cannot hold the parity check's prompt" in line, line
    assert "--no-verify" in line and not output.exists()
