"""``decode.speculative``: what bring-up checks of a draft model's directory, what ``baton
status`` shows, and that a multi-rank decode pool is refused only with speculation on
(the key-by-key refusals are in test_config.py, the engine mapping in
test_engine_settings.py)."""

from __future__ import annotations

import json

import pytest

from cluster.config import SpeculativeSection, parse_config
from cluster.model_source import resolve_draft_model_dir


def _draft_dir(tmp_path, vocab_size=512, weights=True):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    if weights:
        (draft / "model.safetensors").write_bytes(b"")
    return draft


def test_a_draft_directory_resolves_to_an_absolute_path(tmp_path, monkeypatch):
    draft = _draft_dir(tmp_path)
    monkeypatch.chdir(tmp_path)  # a relative path in the config: workers may start elsewhere
    assert resolve_draft_model_dir("draft", vocab_size=512) == draft.resolve()


@pytest.mark.parametrize(
    ("setup", "vocab_size", "message"),
    [
        ("missing", 512, "is not a directory"),
        ("no_config", 512, "has no config.json"),
        ("no_weights", 512, "has no .*safetensors weights"),
        ("ok", 1000, r"the draft's vocab_size \(512\) is not the served model's \(1000\)"),
    ],
)
def test_a_bad_draft_directory_is_refused_naming_the_key(tmp_path, setup, vocab_size, message):
    if setup == "missing":
        path = tmp_path / "nowhere"
    elif setup == "no_config":
        path = tmp_path / "empty"
        path.mkdir()
    else:
        path = _draft_dir(tmp_path, weights=setup != "no_weights")
    with pytest.raises(ValueError, match=f"^decode.speculative.draft_model: .*{message}"):
        resolve_draft_model_dir(str(path), vocab_size)


def test_the_status_summary_names_the_method_and_k():
    assert SpeculativeSection().summary() == ""
    assert SpeculativeSection(method="ngram", num_tokens=3).summary() == "ngram, 3 tokens"
    draft = SpeculativeSection(method="draft", draft_model="/models/tiny-draft")
    assert draft.summary() == "draft tiny-draft, 4 tokens"


def test_a_multi_rank_decode_pool_is_fine_without_speculation():
    config = parse_config({"decode": {"tensor_parallel": 2, "speculative": {"num_tokens": 2}}})
    assert config.decode.tensor_parallel == 2 and config.decode.speculative.method is None
