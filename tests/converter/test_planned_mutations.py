"""What a mutation run of the planned-but-unrun mutations found unchecked: each test fails with the mutation named
in its docstring planted (the one-line change quoted), and passes on the code as it is. They sit here together, the
converter's and the runtime's alike, building what they need with the neighbouring helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from convert_helpers import build_reference
from safetensors.torch import load_file, save_file
from test_gate_precision import DENSE, near_ties

from converter import parity
from converter.convert import convert
from converter.parity import check_parity, first_nonfinite
from converter.unreached import EMBEDDING_ROWS
from export.providers import CPU, CUDA_PROVIDER, provider_label
from export.runtime import OnnxDecoder, whole_number
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import gate_prompts

# --- converter/parity.py ---------------------------------------------------------------------------------------------


def test_a_near_tie_beside_a_fault_no_prompt_reaches_names_the_fault(tmp_path, monkeypatch):
    """float32, a greedy token parting at a near tie and an embedding row no prompt reads changed in the conversion:
    the gate names the row's stage (a fault to fix), not the near tie (which reads as harmless). Mutation:
    ``result.first_divergence = unreached or NEAR_TIE`` -> ``= NEAR_TIE``."""
    config = DENSE  # its vocabulary of 96 holds rows that no prompt reads
    assert not config.tie_word_embeddings
    build_reference(config, 0).save_pretrained(tmp_path / "source")
    converted = convert(tmp_path / "source", tmp_path / "out", verify=False, progress=False).output
    read = {
        token
        for prompt in gate_prompts(config.vocab_size, config.max_position_embeddings, parity.GREEDY_TOKENS)
        for token in prompt
    }
    unread = max(i for i in range(config.vocab_size) if i not in read)
    weights = load_file(converted / "model.safetensors")
    weights["model.embed_tokens.weight"][unread].add_(0.5)
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    near_ties(monkeypatch, slice(-1, None), 1e-6)  # row 0's last position: its first greedy token

    fp32 = check_parity(tmp_path / "source", converted).results[0]
    assert not fp32.passed and fp32.greedy_identical == fp32.greedy_prompts - 1
    assert fp32.max_abs_diff <= fp32.tolerance and fp32.decode_max_abs_diff <= fp32.decode_tolerance
    assert [stage.name for stage in fp32.unreached if not stage.passed] == [EMBEDDING_ROWS]
    assert fp32.first_divergence == EMBEDDING_ROWS


def test_the_first_non_finite_state_is_named_by_the_layer_that_output_it():
    """hidden_states[0] is the embeddings, hidden_states[i] layer i - 1's output: a reference overflowing in its
    second layer is said to do so at "layer 1's output". Mutation: ``f"layer {index - 1}'s output"`` ->
    ``f"layer {index}'s output"``."""
    real = torch.ones(1, 3, dtype=torch.bool)
    finite = torch.zeros(1, 3, 4)
    overflowing = torch.full((1, 3, 4), float("inf"))
    assert first_nonfinite((overflowing, finite, finite), real) == "the embeddings"
    assert first_nonfinite((finite, finite, overflowing, finite), real) == "layer 1's output"
    assert first_nonfinite((finite, finite), real) == "the head"


# --- export/providers.py ---------------------------------------------------------------------------------------------


def test_a_load_error_on_cuda_names_cuda():
    """A graph CUDA cannot load is said to fail on CUDA (the export-float16-or-float32 advice is the CPU's, where
    bfloat16 has no kernels). Mutation: ``provider_label`` returning the CPU's label always."""
    assert provider_label([CUDA_PROVIDER, CPU]) == "CUDA"
    assert provider_label(["CUDAExecutionProvider"]) == "CUDA"
    assert provider_label([CPU]) == "CPU (export float16 or float32 for CPU)"


# --- thinker/foreign.py ----------------------------------------------------------------------------------------------


def test_a_thinker_checkpoint_in_a_subfolder_goes_to_transformers(tmp_path, monkeypatch):
    """``from_pretrained(repo, subfolder="thinker")`` reads the subfolder's config to decide: a Thinker checkpoint
    there loads with transformers even where the repo's top level holds another family's config (it went to the
    converter's loader, which converts what is already converted). Mutation: ``"subfolder"`` dropped from
    ``HUB_ARGUMENTS``."""
    import thinker.foreign as foreign

    monkeypatch.setattr(foreign, "_loaders", [lambda source, **kwargs: ("loader", kwargs)])
    repo = tmp_path / "repo"
    (repo / "thinker").mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (repo / "thinker" / "config.json").write_text(json.dumps({"model_type": "thinker"}))

    def transformers_from_pretrained(cls, source, *args, **kwargs):
        return "transformers", kwargs

    def route(source, **kwargs):
        return foreign.from_pretrained(object, transformers_from_pretrained, lambda loaded: loaded, source, **kwargs)

    assert route(repo, subfolder="thinker") == ("transformers", {"subfolder": "thinker"})
    assert route(repo) == ("loader", {"dtype": "auto"})


# --- export/runtime.py -----------------------------------------------------------------------------------------------


def test_a_count_of_true_is_refused():
    """``max_new_tokens=True`` is no count (a flag passed where a number goes): refused by name, not taken as 1.
    Mutation: ``isinstance(value, bool) or`` dropped from ``whole_number``."""
    with pytest.raises(ThinkerError, match=r"^max_new_tokens=True; expected a whole number, 0 or more$"):
        whole_number(True, "max_new_tokens")
    assert whole_number(np.int64(3), "max_new_tokens") == 3


def test_a_state_holding_more_caches_than_the_graph_reads_is_refused(qwen3_onnx):
    """A state whose cache holds every past this graph reads and more (a deeper model's decoder started it) is
    another model's: refused by its count, not decoded with part of its cache. Mutation: ``or len(state.cache) !=
    len(self.past_names)`` dropped from ``_check_state``."""
    decoder = OnnxDecoder(qwen3_onnx / "model.onnx", provider="cpu", threads=1)
    logits, state = decoder.prefill(np.array([[1, 2, 3]]))
    held = len(state.cache)
    state.cache["past_key_values.99.key"] = next(iter(state.cache.values()))
    with pytest.raises(ThinkerError, match=f"its cache holds {held + 1} states, not {held}: a state from another"):
        decoder.decode_one_token(logits.argmax(-1), state)


# --- export/exporter.py -----------------------------------------------------------------------------------------------


def test_force_never_replaces_the_folder_holding_the_gguf_it_exports(tmp_path):
    """``thinker export FOLDER FOLDER --gguf-file NAME --force``: the source is the one GGUF file, which the
    OUTPUT-versus-source check before the work does not see (it is given no source where a GGUF file is named), so
    the exporter's own check after resolving the file must refuse an OUTPUT that holds it; the mutation dropped that
    check (E18)."""
    from cli_helpers import assert_error, earlier_output
    from test_gguf_hybrid import gguf_file

    _, made = gguf_file(tmp_path, "qwen35")
    # the GGUF kept in an earlier output of thinker, which --force may otherwise replace: only this check keeps it
    folder = earlier_output(tmp_path / "earlier", {made.name: made.read_bytes()})
    path = folder / made.name
    before = {item.name: item.read_bytes() for item in folder.iterdir()}
    args = ["export", str(folder), str(folder), "--gguf-file", path.name, "--no-verify", "--force"]
    result = CliRunner().invoke(main, args)
    assert_error(result, "OUTPUT holds the source", path.name)
    assert {item.name: item.read_bytes() for item in folder.iterdir()} == before
