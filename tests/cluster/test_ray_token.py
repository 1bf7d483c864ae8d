"""A Ray instance `baton serve` starts itself requires a token (cluster/serve.py,
docs/security.md); a Ray it joins, or an explicit mode, is left as it is."""

from __future__ import annotations

from pathlib import Path

from cluster.serve import ray_token_authentication


def test_token_authentication_when_starting_ray_ourselves(tmp_path: Path, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as at `baton serve`'s start
    own = {"RAY_ADDRESS": "local", "RAY_TMPDIR": str(tmp_path)}
    assert ray_token_authentication(own)
    assert own["RAY_AUTH_MODE"] == "token" and len(own["RAY_AUTH_TOKEN"]) == 64
    fresh = {"RAY_TMPDIR": str(tmp_path)}  # no address, no running instance recorded
    assert ray_token_authentication(fresh) and fresh["RAY_AUTH_TOKEN"] != own["RAY_AUTH_TOKEN"]
    kept = {"RAY_ADDRESS": "local", "RAY_AUTH_TOKEN": "given-token-0123456789"}
    assert ray_token_authentication(kept) and kept["RAY_AUTH_TOKEN"] == "given-token-0123456789"
    for untouched in (
        {"RAY_ADDRESS": "10.0.0.1:6379"},  # joining a cluster: its token, if any
        {"RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"},  # said explicitly
    ):
        before = dict(untouched)
        assert not ray_token_authentication(untouched) and untouched == before
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    joining = {"RAY_TMPDIR": str(tmp_path)}  # `auto` will join the running instance
    assert not ray_token_authentication(joining) and "RAY_AUTH_MODE" not in joining


def test_nothing_once_ray_is_imported(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", object())  # too late: Ray read the mode
    env = {"RAY_ADDRESS": "local"}
    assert not ray_token_authentication(env) and env == {"RAY_ADDRESS": "local"}
