"""What pip resolves from pyproject.toml on each platform a user installs on: exactly one onnxruntime distribution,
the CUDA one where PyPI has a wheel of it, and the license the metadata declares shipped beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
ONNXRUNTIMES = {"onnxruntime", "onnxruntime-gpu"}

# PEP 508 environments of the platforms, and the onnxruntime each must get: onnxruntime-gpu 1.31.1's wheels on PyPI
# are for Linux x86-64 and Windows x64 only (`pip download onnxruntime-gpu==1.31.1 --platform ...`), so everywhere
# else a dependency on it fails the install.
PLATFORMS = {
    "linux-x86_64": ({"sys_platform": "linux", "platform_machine": "x86_64"}, "onnxruntime-gpu"),
    "windows-amd64": ({"sys_platform": "win32", "platform_machine": "AMD64"}, "onnxruntime-gpu"),
    "linux-aarch64": ({"sys_platform": "linux", "platform_machine": "aarch64"}, "onnxruntime"),
    "macos-arm64": ({"sys_platform": "darwin", "platform_machine": "arm64"}, "onnxruntime"),
    "macos-x86_64": ({"sys_platform": "darwin", "platform_machine": "x86_64"}, "onnxruntime"),
}


def dependencies() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["dependencies"]]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_one_onnxruntime_per_platform(platform: str) -> None:
    environment, expected = PLATFORMS[platform]
    chosen = [
        requirement.name
        for requirement in dependencies()
        if requirement.name in ONNXRUNTIMES
        and (requirement.marker is None or requirement.marker.evaluate({"python_version": "3.11", **environment}))
    ]
    assert chosen == [expected]


def test_onnxruntime_ranges_agree() -> None:
    """Both distributions are held to one version range: the graphs' contrib operators set it, not the build."""
    ranges = {
        requirement.name: requirement.specifier for requirement in dependencies() if requirement.name in ONNXRUNTIMES
    }
    assert set(ranges) == ONNXRUNTIMES
    assert ranges["onnxruntime"] == ranges["onnxruntime-gpu"]


def test_the_declared_license_ships() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()
