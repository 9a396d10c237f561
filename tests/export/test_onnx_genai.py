"""onnxruntime-genai runs the exported folders as written (genai_config.json untouched) and its greedy tokens
equal transformers' greedy tokens. It runs in its own virtual environment (see the ``genai_python`` fixture),
because its CPU onnxruntime must not share one with onnxruntime-gpu.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; plain and fused graphs): 12 of 12 greedy tokens at batch 1, and a
batch of two prompts of equal length. Rows of unequal length, which onnxruntime-genai pads on the right: each row its
own tokens (the short row's trailing pads leave the linear-attention states untouched), Qwen3.5 by default as with
--positions text: its onnxruntime-genai graph takes (B, T) positions under genai's generic decoder type, whose
position code keeps the pads masked (genai's Qwen3.5 types, which feed (3, B, T) positions, unmask them from the
first decode step: docs/hybrid-export.md 5.2). Dense models get each row right (test_onnx_fused.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from export_helpers import HYBRID_FAMILIES

SCRIPT = Path(__file__).with_name("genai_greedy.py")
CASES = [
    ("qwen2", "float32"),
    ("qwen3", "float32"),
    ("qwen3_moe", "float32"),
    ("gpt2", "float32"),
    ("qwen3", "float16"),
]
PROMPT = [5, 9, 17, 33, 4, 21]
NEW_TOKENS = 10


def transformers_greedy(folder: Path, dtype: torch.dtype) -> list[int]:
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0].tolist()


def test_genai_greedy_equals_transformers(genai_python, thinker_folder, onnx_folder):
    cases = [{"folder": str(onnx_folder(f, d)), "prompt": PROMPT, "max_new_tokens": NEW_TOKENS} for f, d in CASES]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sequences = json.loads(done.stdout)

    for family, dtype in CASES:  # every session on all cores: 0 is onnxruntime's "one thread per physical core"
        config = json.loads((onnx_folder(family, dtype) / "genai_config.json").read_text())
        assert config["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 0
    for (family, dtype), sequence in zip(CASES, sequences, strict=True):
        expected = transformers_greedy(thinker_folder(family), getattr(torch, dtype))
        # Both stop at the model's eos (id 2) when it comes up, but genai's sequence leaves it out where
        # transformers' keeps it (its last token then): a genai run that stops early, or runs on past it, differs.
        assert sequence == without_final_eos(expected), f"{family} {dtype}: genai {sequence} != transformers {expected}"


def without_final_eos(sequence: list[int], eos: int = 2) -> list[int]:
    """transformers' greedy sequence without the eos it stopped at, where it stopped at one (the prompt holds none)."""
    return sequence[:-1] if eos in sequence[len(PROMPT) :] else sequence


FIRST_TURN, SECOND_TURN, BETWEEN = [11, 12, 13, 14, 15, 16, 17, 18], [7, 30, 12], 4  # no eos (2) comes up


def test_a_second_turn_under_genai_needs_a_rewind(
    genai_python, thinker_folder, onnx_folder, thinker_variant, onnx_variant
):
    """What README says of a second turn under onnxruntime-genai 0.18: appended after generated tokens, it meets a
    state without the last generated token (genai has not run it, and does not then), so its tokens go wrong or genai
    fails on the KV shapes, as on the builder's graphs (measured beside ours on a tiny Qwen3). ``rewind_to`` where the
    generated tokens begin and appending them in front of the turn gives transformers' tokens over the whole
    conversation; a hybrid model, whose recurrent state genai rewinds only to a length it took a snapshot at
    (``snapshot_state()``) or to 0, does the same after a snapshot, or takes the whole conversation again.
    This pins both: should a later onnxruntime-genai run the token, the first assertion fails and README changes."""
    folders = {
        "qwen2 plain": (onnx_folder("qwen2"), thinker_folder("qwen2"), ("generated",)),
        "qwen3 plain": (onnx_folder("qwen3"), thinker_folder("qwen3"), ("generated",)),
        "qwen3 fused": (onnx_variant("qwen3", head_dim=None), thinker_variant("qwen3"), ("generated",)),
        "qwen3_5 fused": (onnx_variant("qwen3_5", head_dim=None), thinker_variant("qwen3_5"), ("snapshot", "start")),
    }
    turns = {"turns": [FIRST_TURN, SECOND_TURN], "between": BETWEEN, "max_new_tokens": 5}
    cases = [
        {"folder": str(onnx), "rewind": rewind} | turns
        for onnx, _, ways_round in folders.values()
        for rewind in ("", *ways_round)
    ]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = iter(json.loads(done.stdout))
    from thinker import ThinkerForCausalLM

    for name, (_, folder, ways_round) in folders.items():
        model = ThinkerForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            first = model.generate(
                torch.tensor([FIRST_TURN]), max_new_tokens=BETWEEN, do_sample=False, eos_token_id=None
            )
            second = torch.cat([first, torch.tensor([SECOND_TURN])], dim=1)
            expected = model.generate(second, max_new_tokens=5, do_sample=False, eos_token_id=None)[0].tolist()
        assert 2 not in expected[len(FIRST_TURN) :], f"{name}: eos comes up, where genai would stop; pick other turns"
        appended = next(results)
        assert appended != expected, f"{name}: onnxruntime-genai now runs the last generated token; update README"
        for way_round in ways_round:
            rewound = next(results)
            assert rewound == expected, f"{name}, {way_round}: genai {rewound} != transformers {expected}"


def test_beam_search_under_genai_is_wrong_on_hybrid_models_alone(genai_python, thinker_variant, onnx_variant):
    """What README says of beam search under onnxruntime-genai 0.18: on a dense model its beams are transformers'
    (``generate(num_beams=3)``); on a hybrid one they go wrong without an error, as genai reorders the KV cache by beam
    but not the linear-attention states (``RecurrentState::Update`` swaps past and present alone; a QA run). This pins
    both: should a later onnxruntime-genai reorder them, the hybrid assertion fails and README changes."""
    from thinker import ThinkerForCausalLM

    folders = {"qwen3": (onnx_variant("qwen3", head_dim=None), thinker_variant("qwen3"))}
    folders["qwen3_5"] = (onnx_variant("qwen3_5", head_dim=None), thinker_variant("qwen3_5"))
    prompt, new_tokens = [5, 6, 7, 8, 9, 10, 11], 10
    cases = [
        {"folder": str(onnx), "prompt": prompt, "max_new_tokens": new_tokens, "num_beams": 3}
        for onnx, _ in folders.values()
    ]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    beams = dict(zip(folders, json.loads(done.stdout), strict=True))
    expected = {}
    for name, (_, folder) in folders.items():
        model = ThinkerForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, num_beams=3, early_stopping=True, do_sample=False
            )
        expected[name] = out[0].tolist()
    assert beams["qwen3"] == expected["qwen3"], f"dense: genai {beams['qwen3']} != transformers {expected['qwen3']}"
    assert beams["qwen3_5"] != expected["qwen3_5"], "onnxruntime-genai now reorders the recurrent states: update README"
    warned = {name: "Beam search (`num_beams` above 1) goes wrong" in (onnx / "README.md").read_text()
              for name, (onnx, _) in folders.items()}  # fmt: skip
    assert warned == {"qwen3": False, "qwen3_5": True}, warned  # the export's card says so where it applies


HYBRID_PROMPTS = [[5, 9, 17, 33, 4, 21, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18]]  # no pad id (0): genai masks it
HYBRID_NEW_TOKENS = 12


def thinker_greedy(folder: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of equal-length prompts, new tokens only."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[:, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_genai_greedy_equals_transformers_on_hybrid_models(family, genai_python, thinker_variant, onnx_variant):
    folders = [onnx_variant(family, graph=graph, head_dim=None) for graph in ("plain", "fused")]
    cases = []
    for folder in folders:
        for prompt in HYBRID_PROMPTS:
            cases.append({"folder": str(folder), "prompt": prompt, "max_new_tokens": HYBRID_NEW_TOKENS})
        cases.append({"folder": str(folder), "prompts": HYBRID_PROMPTS, "max_new_tokens": HYBRID_NEW_TOKENS})
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)

    expected = thinker_greedy(thinker_variant(family), HYBRID_PROMPTS, HYBRID_NEW_TOKENS)
    for folder_index, graph in enumerate(("plain", "fused")):
        first, second, batch = results[3 * folder_index : 3 * folder_index + 3]
        for prompt, sequence, tokens in zip(HYBRID_PROMPTS, (first, second), expected, strict=True):
            new = sequence[len(prompt) :]
            assert len(new) == HYBRID_NEW_TOKENS and new == tokens, f"{family} {graph}: genai {new} != {tokens}"
        assert batch == expected, f"{family} {graph}, batch of two: genai {batch} != transformers {expected}"


# Right-padded batches of unequal length (genai_greedy.py pads as onnxruntime-genai does): a 3-token row beside an
# 8-token one, both graphs.
RIGHT_PADDED_PROMPTS = [HYBRID_PROMPTS[0], HYBRID_PROMPTS[1][:3]]
# Qwen3.5 (dense and MoE) as exported by default and with --positions text, and a model without mRoPE.
RIGHT_PADDED_MODELS = (("qwen3_5", None), ("qwen3_5", "text"), ("qwen3_5_moe", None), ("qwen3_next", None))
GRAPHS = ("plain", "fused")
EOS = 2  # export_helpers.COMMON: genai stops a row there


def up_to_eos(rows: list[list[int]]) -> list[list[int]]:
    return [r[: r.index(EOS)] if EOS in r else r for r in rows]


@pytest.fixture(scope="module")
def right_padded_genai_rows(genai_python, onnx_variant) -> dict[tuple[str, str | None, str], list[list[int]]]:
    """(family, positions, graph) -> each row's new tokens from onnxruntime-genai on RIGHT_PADDED_PROMPTS: one
    process."""
    keys = [(family, positions, graph) for family, positions in RIGHT_PADDED_MODELS for graph in GRAPHS]
    cases = [
        {
            "folder": str(onnx_variant(family, graph=graph, head_dim=None, positions=positions)),
            "prompts": RIGHT_PADDED_PROMPTS,
            "max_new_tokens": HYBRID_NEW_TOKENS,
        }
        for family, positions, graph in keys
    ]
    done = subprocess.run(
        [str(genai_python), str(SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(keys, json.loads(done.stdout), strict=True))


@pytest.mark.parametrize(("family", "positions"), RIGHT_PADDED_MODELS)
def test_genai_right_padded_hybrid_batch_equals_rows_alone(family, positions, right_padded_genai_rows, thinker_variant):
    """Both graphs under onnxruntime-genai (the fused one through its shared state buffers), rows of unequal length
    padded on the right as genai pads them: each row gets transformers' greedy tokens for that row alone, up to its
    eos. The short row's trailing pads pass through the linear-attention layers and leave both states untouched
    (export/linear_attention_graph.py); before, they decayed the recurrent state and shifted the conv window, and
    the short row went wrong from its second new token. Qwen3.5 by default too: before its genai graph took (B, T)
    positions, genai's (3, B, T) position code unmasked the short row's pads from the first decode step."""
    alone = [thinker_greedy(thinker_variant(family), [p], HYBRID_NEW_TOKENS)[0] for p in RIGHT_PADDED_PROMPTS]
    for graph in GRAPHS:
        rows = right_padded_genai_rows[family, positions, graph]
        assert up_to_eos(rows) == up_to_eos(alone), f"{family} {graph}: genai {rows} != transformers row by row {alone}"


def test_the_cards_run_puts_back_the_bos_genai_leaves_out(genai_python, tmp_path):
    """A tokenizer that puts its BOS in front of every prompt (Llama's): onnxruntime-genai 0.18's og.Tokenizer leaves
    it out (a QA run), so the export names it (export_report.json, a note) and the card's Run snippet puts it back:
    run as written, it feeds genai transformers' ids. Pins genai's side too: should a later genai add the BOS, the
    first assertion fails and the README's line changes."""
    from click.testing import CliRunner
    from export_helpers import save_bos_tokenizer, save_thinker

    from thinker_common.cli import main

    folder = tmp_path / "thinker"
    tokenizer = save_bos_tokenizer(folder)
    save_thinker(folder, "qwen3", tokenizer=False, vocab_size=len(tokenizer))
    expected = tokenizer("The capital of France is")["input_ids"]
    assert expected[0] == 1
    out = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert "puts [1] in front of every prompt (a BOS)" in result.output
    assert json.loads((out / "export_report.json").read_text())["genai_prompt_prefix"] == [1]

    card = (out / "README.md").read_text()
    run = card.split("```python\n", 1)[1].split("```", 1)[0]
    probe = "\nprint('GENAI', [int(t) for t in tokenizer.encode('The capital of France is')])"
    probe += "\nprint('SEQUENCE', [int(t) for t in generator.get_sequence(0)])\n"
    done = subprocess.run(
        [str(genai_python), "-c", run + probe], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("GENAI", "SEQUENCE")))
    assert json.loads(lines["GENAI"]) == expected[1:]  # genai 0.18: no BOS
    assert json.loads(lines["SEQUENCE"])[: len(expected)] == expected  # the card's Run: transformers' prompt
