"""``hf://org/name`` model paths (workers/models/hub.py): huggingface_hub's own cache lookup
finds a snapshot already downloaded (laid out here as the Hub client lays it out) and the
engine serves it; with no network and nothing cached, the error names the repository and
what to do; a malformed path is refused by name."""

from __future__ import annotations

import shutil

import pytest

from cluster.model_source import resolve_model_dir
from workers import LLM, SamplingParams
from workers.models.hub import resolve_hub_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_downloaded_snapshot_is_served(tmp_path, offline, monkeypatch):
    from cluster.tools.make_model import make_model

    model = make_model(tmp_path / "made", "llama", "tiny")
    repo = tmp_path / "cache" / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    assert resolve_hub_path("hf://acme/tiny-llama", tmp_path / "cache") == snapshot
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model_dir("hf://acme/tiny-llama") == snapshot
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = LLM("hf://acme/tiny-llama", dtype="float32").generate([[5, 6, 7]], params)
    want = LLM(str(model), dtype="float32").generate([[5, 6, 7]], params)
    assert got[0].token_ids == want[0].token_ids


def test_no_network_and_nothing_cached_names_what_to_do(tmp_path, offline, monkeypatch):
    with pytest.raises(ValueError, match="cannot reach the Hugging Face Hub") as info:
        resolve_hub_path("hf://acme/not-here", tmp_path / "cache")
    assert "hf://acme/not-here" in str(info.value) and "model.path" in str(info.value)
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^model\.path: hf://acme/not-here"):
        resolve_model_dir("hf://acme/not-here")


@pytest.mark.parametrize("path", ["hf://", "hf://just-a-name", "hf://a/b/c", "hf:///x"])
def test_a_malformed_path_is_refused(path, tmp_path):
    with pytest.raises(ValueError, match="expected hf://org/name"):
        resolve_hub_path(path, tmp_path)
