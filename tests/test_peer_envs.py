"""bench/peer_envs.py: the versions a benchmark records are the ones its environment imports."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import peer_envs  # noqa: E402


def test_recorded_versions_are_the_first_on_the_path(tmp_path, monkeypatch):
    """The GPU kit puts its packages before the image's on the path: the version recorded is the one imported. (Every
    distribution on the path, the last one winning, recorded the image's transformers 5.17 where 5.25 ran.)"""
    for folder, version in (("kit", "9.9.0"), ("image", "1.0.0")):
        info = tmp_path / folder / f"transformers-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'kit'}:{tmp_path / 'image'}")
    monkeypatch.setattr(peer_envs, "python_of", lambda name: Path(sys.executable))
    assert peer_envs.package_versions("genai")["transformers"] == "9.9.0"
