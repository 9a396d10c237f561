"""Parity of the Qwen3-Omni-MoE thinker, taken out of a tiny full Qwen3-Omni checkpoint (thinker, audio and vision
towers, talker, code2wav) built and saved with transformers' own classes (``tests/references/qwen3_omni.py``).

The conversion goes through the real command line with the converter's parity gate on (its reference is
transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``), then the converted folder is compared directly with
the reference thinker on text input, with positions counted by the text model and with the multimodal positions
of ``get_rope_index`` (atol 1e-5 in float32).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from references import qwen3_omni
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from converter.cli import convert_command
from thinker import ThinkerConfig, ThinkerForCausalLM

ATOL = 1e-5
MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
IDS = torch.tensor([[5, 17, 3, 29, 11, 2, 40, 8, 0, 63, 127, 1, 9], [7, 1, 33, 12, 96, 4, 26, 19, 44, 2, 70, 3, 5]])


@pytest.fixture(scope="module")
def omni_source(tmp_path_factory) -> Path:
    return qwen3_omni.save(tmp_path_factory.mktemp("qwen3_omni") / "source")


def cli_convert(source: Path, output: Path, *options: str):
    return CliRunner().invoke(convert_command, [str(source), str(output), *options], catch_exceptions=False)


def tensor_names(folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            names += list(handle.keys())
    return names


def test_qwen3_omni_thinker_converts_with_parity(omni_source, tmp_path):
    result = cli_convert(omni_source, tmp_path / "out", "--verify")
    assert result.exit_code == 0, result.output
    assert "(qwen3_omni)" in result.output and "pass" in result.output
    parity = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert parity["passed"] and parity["reference"] == "Qwen3OmniMoeThinkerForConditionalGeneration"

    config = ThinkerConfig.from_pretrained(tmp_path / "out")
    assert config.mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    assert config.qk_norm and config.norm_topk_prob and config.head_dim == 16
    # the interleaved mRoPE kept (tests/converter/test_hybrid_families.py gives it 3-D positions)
    assert config.rope_parameters == MROPE
    assert config.audio_embed_size is None and config.talker_head_size is None
    # the card says how an image reaches the decoder: its DeepStack features too (without them its logits differ)
    assert config.deepstack_layers == 1
    assert "`visual_pos_masks=` and `deepstack_visual_embeds=`" in (tmp_path / "out" / "README.md").read_text()

    names = tensor_names(tmp_path / "out")
    assert not [n for n in names if "audio" in n or "visual" in n or "talker" in n or "code2wav" in n]
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "lm_head.weight" in names

    converted = ThinkerForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    reference = qwen3_omni.load_reference_thinker(omni_source)
    with torch.no_grad():
        actual = converted(input_ids=IDS).logits
    for mask in (None, torch.ones_like(IDS)):
        expected = qwen3_omni.thinker_logits(reference, IDS, mask)
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("loaded_from", ["full checkpoint", "its own build"])
def test_the_thinker_saved_alone_converts_to_the_same_thinker(loaded_from, omni_source, tmp_path):
    """``Qwen3OmniMoeThinkerForConditionalGeneration.save_pretrained`` (model_type qwen3_omni_moe_thinker: its
    towers beside the decoder, no talker; the tensors ``thinker.``-prefixed when the thinker was loaded from a full
    checkpoint, transformers reversing its renaming on save, and not when built alone) converts with parity, whole
    and layer by layer, to the very tensors the full checkpoint converts to."""
    from converter.cli import verify_command

    alone = tmp_path / "thinker"
    if loaded_from == "full checkpoint":
        qwen3_omni.load_reference_thinker(omni_source).save_pretrained(alone)
    else:
        qwen3_omni.build().thinker.save_pretrained(alone)  # build() is seeded: the weights omni_source holds
    assert json.loads((alone / "config.json").read_text())["model_type"] == "qwen3_omni_moe_thinker"
    prefix = "thinker." if loaded_from == "full checkpoint" else ""
    assert any(name.startswith(f"{prefix}audio_tower.") for name in tensor_names(alone))

    result = cli_convert(alone, tmp_path / "out", "--verify")
    assert result.exit_code == 0, result.output
    assert "(qwen3_omni_thinker)" in result.output and "pass" in result.output
    assert json.loads((tmp_path / "out" / "parity.json").read_text())["passed"]
    by_layer = CliRunner().invoke(verify_command, [str(alone), str(tmp_path / "out"), "--verify-by-layer"])
    assert by_layer.exit_code == 0 and "parity (layer-by-layer)" in by_layer.output, by_layer.output

    assert cli_convert(omni_source, tmp_path / "full", "--no-verify").exit_code == 0
    ours, full = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "full" / "model.safetensors")
    assert ours.keys() == full.keys() and all(torch.equal(ours[name], full[name]) for name in ours)
    assert (
        ThinkerConfig.from_pretrained(tmp_path / "out").to_dict()
        == ThinkerConfig.from_pretrained(tmp_path / "full").to_dict()
    )


def test_qwen3_omni_with_a_sparse_first_layer_passes_its_gate(tmp_path):
    """As released (decoder_sparse_step 1: every layer MoE), layer 0's experts are probed in the thinker's decoder,
    not in the audio encoder's layer 0, which came first by name and has none (the gate failed "layer 0: every
    expert" on an exact conversion)."""
    source = qwen3_omni.save(tmp_path / "source", decoder_sparse_step=1)
    result = cli_convert(source, tmp_path / "out", "--verify")
    assert result.exit_code == 0, result.output
    parity = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert parity["passed"] and parity["mode"] == "whole-model", parity
    probed = {stage["name"]: stage["max_abs_diff"] for stage in parity["results"][0]["unreached"]}
    assert probed["layer 0: every expert"] == 0, probed


def test_qwen3_omni_hub_config_spelling(omni_source, tmp_path):
    """The Hub's config.json spells RoPE the transformers-4 way (``rope_theta`` + ``rope_scaling`` with the mrope
    keys); it translates to the same interleaved mRoPE."""
    source = tmp_path / "source"
    source.mkdir()
    # A copy, not a symlink: a link leading out of the source folder is refused (tests/test_source_safety.py).
    shutil.copy(omni_source / "model.safetensors", source / "model.safetensors")
    config = json.loads((omni_source / "config.json").read_text())
    text = config["thinker_config"]["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True}
    (source / "config.json").write_text(json.dumps(config))

    result = cli_convert(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 0, result.output
    assert ThinkerConfig.from_pretrained(tmp_path / "out").rope_parameters == MROPE


def test_qwen3_omni_refuses_unknown_tensors(omni_source, tmp_path):
    """Only the listed sub-models are dropped: a tensor outside them and outside the table is an error naming it."""
    source = tmp_path / "source"
    source.mkdir()
    tensors = load_file(omni_source / "model.safetensors")
    tensors["thinker.model.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    (source / "config.json").write_text((omni_source / "config.json").read_text())

    result = cli_convert(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and "thinker.model.extra_proj.weight" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", [("thinker_config",), ("thinker_config", "text_config")], ids=".".join)
def test_qwen3_omni_without_its_decoder_config_is_refused_by_key(missing, omni_source, tmp_path):
    source = shutil.copytree(omni_source, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    *outer, last = missing
    section = config
    for key in outer:
        section = section[key]
    del section[last]
    (source / "config.json").write_text(json.dumps(config))
    result = cli_convert(source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 1 and f"has no {'.'.join(missing)}, which holds" in result.output, result.output
    assert not (tmp_path / "out").exists()


# Plans the folder argv[1] in a process whose address space is capped a little above what its imports took: a
# config that makes transformers build a list per layer runs out of it at once (MemoryError) instead of taking the
# machine's memory. Prints the refusal.
PLAN_WITH_CAPPED_MEMORY = """
import json, resource, sys
from pathlib import Path
from converter.engine import plan_conversion
from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource

folder = Path(sys.argv[1])
source = SafetensorsSource(folder)
config = json.loads((folder / "config.json").read_text())
with open("/proc/self/statm") as statm:
    used = int(statm.read().split()[0]) * resource.getpagesize()
_, hard = resource.getrlimit(resource.RLIMIT_AS)
cap = used + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
try:
    plan_conversion(source, config)
except ThinkerError as err:
    print(err)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="caps the child's memory by its /proc size")
def test_a_billion_layers_in_the_nested_decoder_config_is_refused_at_once(omni_source, tmp_path):
    """Qwen3-Omni keeps its decoder's counts under thinker_config.text_config: a billion layers there is refused by
    key against the checkpoint's tensor count, in one line, before transformers' config class builds a list per
    layer from it (which takes all memory, then hangs). Planned in a child process with its memory capped and its
    time bounded, so that a regression fails here rather than taking the machine."""
    source = shutil.copytree(omni_source, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    config["thinker_config"]["text_config"]["num_hidden_layers"] = 10**9
    (source / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-c", PLAN_WITH_CAPPED_MEMORY, str(source)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.strip().splitlines()
    assert "num_hidden_layers=1000000000" in line and "holds only" in line, line
    assert "does not describe these qwen3_omni weights" in line, line
