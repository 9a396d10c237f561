"""Shared pytest fixtures."""

import pytest

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
