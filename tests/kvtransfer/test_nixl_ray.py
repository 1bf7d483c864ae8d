"""KV hand-off between separate processes (Ray actors) through NIXL, both directions.

Every worker is its own process with a real paged KV cache and the engine's block
manager; block ids are random and non-contiguous. After each scenario nothing may
stay in use on either side.
"""

from __future__ import annotations

import functools
import os
import pathlib
import time

import nixl  # noqa: F401  (required: the workers' NIXL agents; a broken install fails)
import pytest
import ray
import torch

from .helpers import full_kv
from .ray_workers import OK, KVWorker

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
HEADS, LAYERS, BS, DIM = 4, 2, 4, 8


def block_tensor(data: bytes, num_blocks: int, heads_local: int) -> torch.Tensor:
    shape = (num_blocks, LAYERS, 2, heads_local, BS, DIM)
    return torch.frombuffer(bytearray(data), dtype=torch.float16).view(shape)


@pytest.fixture(scope="module")
def ray_session():
    # Ray 2.5x/2.60: token authentication is on by default for local clusters started
    # by ray.init(); we never turn it off. Workers find the tests package via PYTHONPATH.
    # One retry: Ray gives its raylet a fixed 30 s to register, which a loaded 2-core CI
    # machine once missed (every test of this module then errored).
    for attempt in range(2):
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=False,
                runtime_env={
                    "env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
                },
            )
            break
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            ray.shutdown()
            if attempt or "timed out during startup" not in str(exc):
                raise
    yield
    ray.shutdown()


@functools.cache
def remote_worker():
    return ray.remote(num_cpus=0)(KVWorker)


def spawn(name, **kwargs):
    shape = {"num_kv_heads": HEADS, "num_layers": LAYERS, "block_size": BS, "head_dim": DIM}
    return remote_worker().remote(name, **{**shape, **kwargs})


def handshake(*actors):
    metas = ray.get([a.metadata.remote() for a in actors])
    calls = []
    for i, a in enumerate(actors):
        for j, meta in enumerate(metas):
            if i != j:
                calls.append(a.add_peer.remote(meta))
    for code, message in ray.get(calls):
        assert code == OK, message


def wait_for(fn, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return True
        time.sleep(0.05)
    return fn()


@pytest.fixture(scope="module")
def pair(ray_session):
    prefill = spawn("prefill", seed=1)
    decode_pull = spawn("decode-pull", seed=None, direction="pull")
    decode_push = spawn("decode-push", seed=None, direction="push")
    handshake(prefill, decode_pull, decode_push)
    yield prefill, {"pull": decode_pull, "push": decode_push}
    for actor in (prefill, decode_pull, decode_push):
        ray.kill(actor)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_requests_arrive_byte_exact_and_nothing_stays_in_use(pair, direction):
    prefill, decodes = pair
    decode = decodes[direction]
    lengths = [37, 5, 64, 16, 23]
    handles = ray.get(
        [prefill.prefill.remote(f"{direction}-{i}", n) for i, n in enumerate(lengths)]
    )
    dst = ray.get(
        [decode.start_receive.remote([h], n) for h, n in zip(handles, lengths, strict=True)]
    )
    outcomes = ray.get(
        [decode.wait_receive.remote(f"{direction}-{i}") for i in range(len(lengths))]
    )
    assert [o[0] for o in outcomes] == [OK] * len(lengths), outcomes
    from kvtransfer.messages import KVHandle, decode_as

    scattered = 0
    for handle, dst_ids in zip(handles, dst, strict=True):
        src_ids = list(decode_as(handle, KVHandle).block_ids)
        scattered += src_ids != list(range(src_ids[0], src_ids[0] + len(src_ids)))
        src_bytes, dst_bytes = ray.get(
            [prefill.blocks.remote(src_ids), decode.blocks.remote(dst_ids)]
        )
        assert src_bytes == dst_bytes and any(src_bytes)
    assert scattered >= 3  # the fragmented block managers hand out random ids
    for i in range(len(lengths)):
        decode.finish.remote(f"{direction}-{i}")
    assert wait_for(lambda: ray.get(prefill.num_used_blocks.remote()) == 0)
    assert ray.get(decode.num_used_blocks.remote()) == 0
    reasons = {r for _, r in ray.get(prefill.released_reasons.remote()) if _.startswith(direction)}
    assert reasons == {"done"}
    assert ray.get(prefill.stats.remote())[1:] == [0, 0, 0]


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_abort_before_and_during_transfer_leaves_nothing_in_use(pair, direction):
    prefill, decodes = pair
    decode = decodes[direction]
    before = ray.get(prefill.prefill.remote(f"ab-{direction}", 40))
    decode.decline.remote([before], "aborted")  # aborted before decode started
    during = ray.get(prefill.prefill.remote(f"ad-{direction}", 64))
    ray.get(decode.start_receive.remote([during], 64))
    decode.abort.remote(f"ad-{direction}")
    code, message, _, _ = ray.get(decode.wait_receive.remote(f"ad-{direction}"))
    assert code in (OK, "aborted"), message  # the abort may land after the last byte
    if code == OK:
        decode.finish.remote(f"ad-{direction}")
    assert wait_for(lambda: ray.get(prefill.num_used_blocks.remote()) == 0)
    assert ray.get(decode.num_used_blocks.remote()) == 0
    assert ray.get(decode.stats.remote())[2] == 0


def test_lease_expiry_frees_the_prefill_blocks(ray_session):
    prefill = spawn("prefill-lease", seed=2, lease_seconds=1.0, transfer_timeout_s=0.5)
    ray.get(prefill.prefill.remote("unread", 30))
    assert ray.get(prefill.num_used_blocks.remote()) > 0
    assert wait_for(lambda: ray.get(prefill.num_used_blocks.remote()) == 0, timeout=5)
    assert ray.get(prefill.released_reasons.remote()) == [["unread", "expired"]]
    ray.kill(prefill)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    """Until the process has exited (ray.kill returns before it has; same host)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"the killed actor's process {pid} is still running")


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_killed_peer_gives_a_typed_error_within_the_deadline(ray_session, direction):
    prefill = spawn(f"doomed-{direction}", seed=3)
    decode = spawn(f"survivor-{direction}", seed=None, direction=direction)
    handshake(prefill, decode)
    old_meta = ray.get(prefill.metadata.remote())
    handle = ray.get(prefill.prefill.remote("orphan", 32))
    pid = ray.get(prefill.pid.remote())
    ray.kill(prefill, no_restart=True)
    _wait_gone(pid)
    ray.get(decode.start_receive.remote([handle], 32, 2.0))
    code, message, waited, _ = ray.get(decode.wait_receive.remote("orphan"))
    # UCX reports the dead endpoint at once (NIXL_ERR_REMOTE_DISCONNECT on the READ, or
    # on the push request's notification); the deadline bounds the worst case.
    assert code == "peer_lost", (code, message)
    assert waited < 2.0 + 1.0
    assert ray.get(decode.num_used_blocks.remote()) == 0
    assert ray.get(decode.add_peer.remote(old_meta))[0] == "peer_lost"  # dead incarnation
    reborn = spawn(f"doomed-{direction}", seed=3)  # same worker id, new incarnation
    handshake(reborn, decode)
    handle = ray.get(reborn.prefill.remote("again", 12))
    ray.get(decode.start_receive.remote([handle], 12))
    assert ray.get(decode.wait_receive.remote("again"))[0] == OK
    for actor in (reborn, decode):
        ray.kill(actor)


def test_mismatched_layout_is_refused(pair, ray_session):
    prefill, _ = pair
    other = spawn("other-bs", block_size=8)
    code, message = ray.get(other.add_peer.remote(ray.get(prefill.metadata.remote())))
    assert code == "layout_mismatch" and "block_size: local 8 != remote 4" in message
    code, message = ray.get(prefill.add_peer.remote(ray.get(other.metadata.remote())))
    assert code == "layout_mismatch" and "block_size" in message
    ray.kill(other)


@pytest.mark.parametrize(
    ("p", "d", "direction"),
    [
        (2, 1, "pull"),
        (1, 2, "push"),
        pytest.param(2, 1, "push", marks=pytest.mark.slow),
        pytest.param(1, 2, "pull", marks=pytest.mark.slow),
    ],
)
def test_tp2_and_tp1_reassemble_the_same_kv(ray_session, p, d, direction):
    seed = 7
    prefills = [spawn(f"tp-p{r}", seed=seed, tp_rank=r, tp_size=p, frag_seed=1) for r in range(p)]
    decodes = [
        spawn(f"tp-d{r}", seed=None, tp_rank=r, tp_size=d, direction=direction, frag_seed=2)
        for r in range(d)
    ]
    handshake(*prefills, *decodes)
    handles = ray.get([a.prefill.remote("tp", 24, d) for a in prefills])
    dst = ray.get([a.start_receive.remote(handles, 24) for a in decodes])
    outcomes = ray.get([a.wait_receive.remote("tp") for a in decodes])
    assert all(o[0] == OK for o in outcomes), outcomes
    from kvtransfer.messages import KVHandle, decode_as

    src_ids = list(decode_as(handles[0], KVHandle).block_ids)
    full = full_kv(64, LAYERS, HEADS, BS, DIM, seed=seed)  # what the prefill ranks hold
    assert all(list(decode_as(h, KVHandle).block_ids) == src_ids for h in handles)
    parts = [
        block_tensor(ray.get(a.blocks.remote(ids)), len(ids), HEADS // d)
        for a, ids in zip(decodes, dst, strict=True)
    ]
    assert torch.equal(torch.cat(parts, dim=3).view(torch.int16), full[src_ids].view(torch.int16))
    for a in decodes:
        a.finish.remote("tp")
    for a in prefills:
        assert wait_for(lambda a=a: ray.get(a.num_used_blocks.remote()) == 0)
    for a in (*prefills, *decodes):
        ray.kill(a)


def test_idle_agent_does_not_spin(pair):
    prefill, _ = pair
    # Not a timing assert: a spinning progress thread costs ~50% of a core here.
    busy = ray.get(prefill.cpu_seconds.remote(2.0)) / 2.0
    assert busy < 0.2, f"idle agent used {busy:.1%} of a core"
