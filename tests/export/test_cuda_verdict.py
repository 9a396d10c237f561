"""GPU tests on a machine set up wrongly fail instead of skipping (issue 15): ``cuda_usable()`` is False both where
there is no GPU and where a GPU's CUDA provider does not load. The probes (device nodes, nvidia-smi,
CUDA_VISIBLE_DEVICES, the provider) are faked here, so the decision is tested on any machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from export.providers import gpu_test_verdict, visible_gpu


@pytest.fixture
def dev(tmp_path) -> Path:
    return tmp_path / "dev"


def with_nodes(dev: Path, *names: str) -> Path:
    dev.mkdir(exist_ok=True)
    for name in names:
        (dev / name).write_text("")
    return dev


def no_smi() -> None:
    return None


def test_a_device_node_is_a_visible_gpu(dev):
    devices = with_nodes(dev, "nvidiactl", "nvidia-uvm", "nvidia0")
    assert visible_gpu({}, devices, no_smi) == str(devices / "nvidia0")


def test_nvidia_smi_is_asked_when_there_is_no_device_node(dev):
    devices = with_nodes(dev, "nvidiactl")  # the control node alone is no GPU
    assert visible_gpu({}, devices, no_smi) is None
    assert visible_gpu({}, devices, lambda: "GPU 0: NVIDIA H100 80GB HBM3") == "GPU 0: NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("value", ["", "-1", " "])
def test_cuda_visible_devices_can_hide_every_gpu(value, dev):
    devices = with_nodes(dev, "nvidia0")
    assert visible_gpu({"CUDA_VISIBLE_DEVICES": value}, devices, lambda: "GPU 0: x") is None
    assert visible_gpu({"CUDA_VISIBLE_DEVICES": "0"}, devices, no_smi) == str(devices / "nvidia0")


def test_the_verdicts():
    assert gpu_test_verdict(True, None, "") == ("run", "")
    verdict, reason = gpu_test_verdict(False, None, "there is no GPU here")
    assert verdict == "skip" and "no GPU" in reason
    verdict, reason = gpu_test_verdict(False, "/dev/nvidia0", "its CUDA libraries are missing")
    assert verdict == "fail" and "/dev/nvidia0" in reason and "CUDA libraries are missing" in reason


class _Item:
    """What the hook reads of a test item."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu

    def get_closest_marker(self, name: str):
        return object() if name == "gpu" and self.gpu else None


@pytest.mark.parametrize(
    "usable, gpu, expected",
    [(True, "/dev/nvidia0", None), (False, None, "skip"), (False, "/dev/nvidia0", "fail")],
    ids=["CUDA runs", "no GPU", "a GPU CUDA cannot use"],
)
def test_the_gpu_marker_runs_skips_or_fails(usable, gpu, expected, monkeypatch):
    """tests/conftest.py's hook, with the probes faked: what a gpu-marked test does on each kind of machine."""
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    monkeypatch.setattr("export.providers.cuda_usable", lambda: usable)
    monkeypatch.setattr("export.providers.visible_gpu", lambda: gpu)
    monkeypatch.setattr("export.providers.cuda_absence", lambda: "its CUDA libraries are missing")
    conftest.pytest_runtest_setup(_Item(gpu=False))  # unmarked tests are never touched
    if expected is None:
        conftest.pytest_runtest_setup(_Item(gpu=True))
        return
    outcome = pytest.skip.Exception if expected == "skip" else pytest.fail.Exception
    with pytest.raises(outcome) as raised:
        conftest.pytest_runtest_setup(_Item(gpu=True))
    assert ("no GPU" if expected == "skip" else "/dev/nvidia0") in str(raised.value)
