"""The KV tiers below a worker's pool (docs/kv-tiers.md) in a served cluster: real Ray
actors, real gRPC, the real host tier (G2) and the real disk tier (G3) in a directory.

One cluster serves the module: one decode worker (aggregated) whose pool is small (32
blocks of 8 tokens), with a host tier of 24 blocks and a disk tier. Prompts are token ids,
so the test computes their block hashes and finds their files on disk. What must hold:

- a prompt whose prefix the pool evicted is onboarded from G2, and one whose prefix both
  the pool and G2 evicted from G3: prompt tokens reported cached, output token for token
  what the single-process engine (no tiers) computes, greedy and seeded, and the metrics
  and ``baton status`` count the hits on the tier that served them;
- (slow, clusters of its own) the same on a prefill worker that then hands the KV over
  to a decode worker; and after the whole cluster is stopped (SIGTERM) and started again
  on the same directory, those prompts and the last one served before the stop (still in
  the pool then: written down at the stop) come from disk with the same tokens;
- (slow) a worker killed with SIGKILL is restarted under its name, opens the same
  directory, and serves a prefix its predecessor wrote from disk, with the first run's
  tokens; block files damaged meanwhile (a flipped byte, a truncation, a deletion) are
  misses, counted as errors, with correct tokens, and the worker keeps serving;
- (slow, a cluster of its own) two decode workers killed and restarted announce what
  their disks hold, and ``kv_aware`` routes each prompt to the worker whose disk has it.

A full disk (writes fail with ENOSPC) is covered below the cluster, since a small
filesystem needs mount privileges that CI's container lacks (tests/workers/kv_tiers/
test_disk_tier_failures.py, test_manager.py and test_disk_full_engine.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from cluster import cli
from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, request, wait_blocks_released
from tests.e2e.test_metrics import Scrape
from tests.e2e.test_parallel_cluster import _rank_pids, _wait_serving
from workers.engine.kv_tiers import block_file
from workers.engine.kv_tiers.dir_lock import LOCK_NAME
from workers.protocol.block_hashes import hash_prompt_blocks

BLOCK = 8
POOL_BLOCKS = 32
HOST_BLOCKS = 24
PROMPT_LEN = 41  # 5 full blocks onboardable: the last token is always computed
PROMPT_BLOCKS = (PROMPT_LEN - 1) // BLOCK
MAX_TOKENS = 8
WORKER = "decode-0"
SEEDED = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
WAIT_S = 60.0
MAX_FILLERS = 60  # each caches 6 blocks: far more than the pool and host tier hold


def block_bytes(model_dir: Path) -> int:
    """One block of the tiny model's cache: every layer, K and V, float32."""
    from workers.models.arch_config import ArchConfig

    arch = ArchConfig.from_model_dir(model_dir)
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * BLOCK * arch.head_dim * 4


def prompt(key: str) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]


class Tiers:
    """The served cluster and what the tests read of it."""

    def __init__(self, served, disk_root: Path, worker: str):
        self.served = served
        self.worker = worker  # the worker that computes prompts: its tiers are watched
        self.stub = served.stub()
        self.disk_root = disk_root
        (self.url,) = served.metrics_urls()
        self.fillers = 0

    def generate(self, tokens: list[int], sampling: pb.SamplingParams | None = None):
        kw = {"sampling": sampling} if sampling is not None else {}
        req = request(tokens, max_tokens=MAX_TOKENS, **kw)
        req.output.return_timing = True
        return collect(self.stub, req, timeout=120)

    def fill(self) -> list[int]:
        """One request of a prompt never seen before: its blocks push older ones down."""
        self.fillers += 1
        assert self.fillers <= MAX_FILLERS * 4, "the tiers never took the blocks"
        tokens = prompt(f"filler {self.fillers}")
        self.generate(tokens)
        return tokens

    def block_files(self, tokens: list[int], worker: str | None = None) -> list[Path | None]:
        """Each onboardable block's file in the worker's disk tier directory, or None."""
        found = []
        directory = self.disk_root / (worker or self.worker)
        for h in hash_prompt_blocks(tokens, BLOCK)[:PROMPT_BLOCKS]:
            paths = list(directory.glob(f"*/{block_file.file_name(h)}"))
            found.append(paths[0] if paths else None)
        return found

    def fill_until_on_disk(self, *prompts: list[int], where: dict | None = None) -> None:
        """Send new prompts until every block of ``prompts`` has its file on disk (in the
        directory of ``where[i]``, the worker that served prompt i; default ours): the pool
        evicted it into the host tier, which wrote it behind to the disk."""
        where = where or {}
        for _ in range(MAX_FILLERS):
            if all(
                p is not None
                for i, t in enumerate(prompts)
                for p in self.block_files(t, where.get(i))
            ):
                return
            self.fill()
        raise AssertionError(f"not on disk after {MAX_FILLERS} more prompts")

    def scrape(self) -> Scrape:
        return Scrape(self.url)

    def tier_metric(self, name: str, tier: str, scrape: Scrape | None = None) -> float:
        s = scrape or self.scrape()
        return s.get(f"baton_kv_tier_{name}", tier=tier, instance=self.worker)

    def tier_status(self) -> dict[str, pb.KVTierStatus]:
        status = self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        (worker,) = [w for p in status.pools for w in p.workers if w.name == self.worker]
        return {t.name: t for t in worker.kv_tiers}


@contextlib.contextmanager
def serve(
    model_dir: Path, workdir: Path, disaggregated: bool, decode_replicas: int = 1
) -> Iterator[Tiers]:
    """One decode worker (or ``decode_replicas``, routed ``kv_aware``), and with
    ``disaggregated`` one prefill worker that computes every prompt and hands its KV
    over: each with the small pool and both tiers."""
    disk_root = workdir / "disk"
    host_bytes = HOST_BLOCKS * block_bytes(model_dir)
    mode = "always" if disaggregated else "never"
    policy = "kv_aware" if decode_replicas > 1 else "round_robin"
    config = cluster_config(model_dir, policy=policy, disaggregation=mode)
    config["decode"]["replicas"] = decode_replicas
    config["model"]["max_model_len"] = 128  # 16 blocks: the pool may be small
    config["prefill"]["replicas"] = int(disaggregated)
    config["prefill"]["max_num_seqs"] = config["decode"]["max_num_seqs"] = 4
    config["kv_cache"] |= {
        "num_blocks": POOL_BLOCKS,
        "host_tier_gib": host_bytes / 2**30,
        "disk_tier_path": str(disk_root),
        "disk_tier_gib": 0.01,
    }
    served = start_cluster(config, workdir)
    try:
        yield Tiers(served, disk_root, "prefill-0" if disaggregated else WORKER)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]


@pytest.fixture(scope="module")
def tiers(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("kv-tiers"), disaggregated=False) as t:
        yield t


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The single-process engine without tiers: what computing every prompt gives."""
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)

    def run(tokens: list[int], seeded: bool = False) -> list[int]:
        sampling = {"temperature": 0.0}
        if seeded:
            sampling = {"temperature": SEEDED.temperature, "top_p": SEEDED.top_p}
            sampling["seed"] = SEEDED.seed
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return list(llm.generate([tokens], params)[0].token_ids)

    return run


def eventually(read, done, what: str):
    """``read()`` once ``done(value)`` holds: reports reach the metrics and the router
    every ~0.1 s, after the request that changed them has ended."""
    deadline = time.monotonic() + WAIT_S
    while not done(value := read()):
        assert time.monotonic() < deadline, f"{what}: {value}"
        time.sleep(0.1)
    return value


def hit_deltas(tiers: Tiers, before: Scrape, blocks: int, tier: str) -> dict[str, float]:
    """Each tier's hits since ``before``, once ``tier`` counted ``blocks`` more."""
    base = {t: tiers.tier_metric("hits_total", t, before) for t in ("host", "disk")}

    def deltas() -> dict[str, float]:
        now = tiers.scrape()
        return {t: tiers.tier_metric("hits_total", t, now) - base[t] for t in base}

    return eventually(deltas, lambda d: d[tier] >= blocks, f"hits since, {tier} to reach {blocks}")


@pytest.mark.slow
def test_a_prefill_worker_onboards_from_host_and_disk_then_hands_off(
    tiny_model_dir, tmp_path, engine
):
    """The same with disaggregation: the prefill worker onboards, the decode worker gets
    the prompt's KV over NIXL. Then the whole cluster is stopped (SIGTERM) and started
    again on the same directory: the new prefill worker serves yesterday's prefixes from
    disk, the one still in its pool at the stop included (written down as the worker
    stopped). (Clusters of its own, stopped before the module's starts.)"""
    with serve(tiny_model_dir, tmp_path, disaggregated=True) as tiers:
        served = assert_onboarded_from_host_then_disk(tiers, engine)
        # The last prompt before the stop: still in the pool, so not on disk yet; the
        # graceful stop writes it down (KVTierManager.close).
        last = prompt("last before the stop")
        served["last"] = (last, None, tiers.generate(last)[:2])
        assert served["last"][2][0] == engine(last)
        assert tiers.block_files(last) == [None] * PROMPT_BLOCKS
    with serve(tiny_model_dir, tmp_path, disaggregated=True) as tiers:
        status = eventually(tiers.tier_status, lambda s: "disk" in s, "the new worker's tiers")
        assert status["disk"].blocks >= 2 * PROMPT_BLOCKS and status["host"].blocks == 0
        before = tiers.scrape()
        for tokens, sampling, want in served.values():
            again = tiers.generate(tokens, sampling)
            assert again[:2] == want
            assert again[2].usage.cached_prompt_tokens == PROMPT_BLOCKS * BLOCK
        blocks = len(served) * PROMPT_BLOCKS
        assert hit_deltas(tiers, before, blocks, "disk") == {"host": 0, "disk": blocks}
        wait_blocks_released(tiers.stub)


@pytest.mark.slow
def test_restarted_workers_announce_their_disk_and_kv_aware_routes_to_it(
    tiny_model_dir, tmp_path, engine
):
    """Two decode workers, ``kv_aware``; both killed and restarted. Each new worker's
    first report tells the router what its disk holds (a snapshot on the new event
    channel), so a prompt only one worker's disk holds goes to that worker and is
    onboarded there. Sent two of one worker's, then two of the other's: round robin
    would send two of the four elsewhere, whatever its cursor."""
    with serve(tiny_model_dir, tmp_path, disaggregated=False, decode_replicas=2) as tiers:
        first: dict[str, tuple[list[int], str, list[int]]] = {}
        for i in range(8):
            tokens = prompt(f"routed {i}")
            out, _, final = tiers.generate(tokens)
            first[f"routed {i}"] = (tokens, final.timing.decode_worker, out)
        held = {w: [k for k, v in first.items() if v[1] == w][:2] for w in (WORKER, "decode-1")}
        assert all(len(keys) == 2 for keys in held.values()), first
        chosen = [k for keys in held.values() for k in keys]
        tiers.fill_until_on_disk(
            *(first[k][0] for k in chosen), where=dict(enumerate(first[k][1] for k in chosen))
        )
        pids = _rank_pids(tiers.served, "WorkerActor")
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _wait_serving(tiers.stub, "decode", {WORKER: 1, "decode-1": 1})
        for key in chosen:
            tokens, worker, out = first[key]
            again, _, final = tiers.generate(tokens)
            assert final.timing.decode_worker == worker, key
            assert again == out == engine(tokens), key
            assert final.usage.cached_prompt_tokens == PROMPT_BLOCKS * BLOCK, key
        wait_blocks_released(tiers.stub)


def test_prefixes_onboarded_from_host_and_disk_give_the_computed_tokens(tiers, engine, capsys):
    assert_onboarded_from_host_then_disk(tiers, engine)
    # baton status: a table of the worker's tiers.
    assert cli.main(["status", "--target", tiers.served.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("  KV tiers:") + 1 :]
    assert table[0].split() == ["WORKER", "TIER", "BLOCKS", "BYTES", "HIT", "RATE"]
    assert [row.split()[:2] for row in table[1:3]] == [[WORKER, "host"], [WORKER, "disk"]]
    assert table[1].split()[2:5] == [str(tiers.tier_status()["host"].blocks), "/", "24"]
    wait_blocks_released(tiers.stub)  # onboarded blocks are freed like computed ones


def assert_onboarded_from_host_then_disk(tiers: Tiers, engine) -> dict[str, tuple]:
    """Returns each prompt with its sampling and its (token ids, text)."""
    full = PROMPT_BLOCKS * BLOCK
    # G2: the pool evicted the prompt, the host tier still holds it.
    g2 = prompt("from host")
    computed = tiers.generate(g2)
    served = {"g2": (g2, None, computed[:2])}
    assert computed[2].usage.cached_prompt_tokens == 0
    assert computed[0] == engine(g2)
    tiers.fill_until_on_disk(g2)  # evicted from the pool (G2 writes to G3 behind itself)
    before = tiers.scrape()
    onboarded = tiers.generate(g2)
    assert onboarded[:2] == computed[:2]
    assert onboarded[2].usage.cached_prompt_tokens == full
    assert hit_deltas(tiers, before, PROMPT_BLOCKS, "host") == {"host": PROMPT_BLOCKS, "disk": 0}

    # G3: the pool evicted the prompt and so did the host tier (it took more than its
    # capacity of other blocks since); the disk still holds it. Seeded sampling this time.
    g3 = prompt("from disk")
    computed = tiers.generate(g3, SEEDED)
    served["g3"] = (g3, SEEDED, computed[:2])
    assert computed[0] == engine(g3, seeded=True)
    tiers.fill_until_on_disk(g3)
    # Blocks on disk went through the host tier; those of prompts sent from now on went
    # after the prompt's: once HOST_BLOCKS of them are on disk, the host tier (least
    # recently used first) has evicted the prompt's.
    newer: list[list[int]] = []
    while sum(p is not None for t in newer for p in tiers.block_files(t)) < HOST_BLOCKS:
        newer.append(tiers.fill())
    before = tiers.scrape()
    onboarded = tiers.generate(g3, SEEDED)
    assert onboarded[:2] == computed[:2]
    assert onboarded[2].usage.cached_prompt_tokens == full
    assert hit_deltas(tiers, before, PROMPT_BLOCKS, "disk") == {"host": 0, "disk": PROMPT_BLOCKS}
    onboard_bytes = tiers.tier_metric("onboard_bytes_total", "disk") - tiers.tier_metric(
        "onboard_bytes_total", "disk", before
    )
    assert onboard_bytes == PROMPT_BLOCKS * block_bytes(tiers.served.model_dir)
    if tiers.worker != WORKER:  # disaggregated: onboarded there, then the KV handed over
        timing = onboarded[2].timing
        assert timing.prefill_worker == tiers.worker and timing.decode_worker == WORKER
        assert timing.kv_transfer_bytes > 0

    # baton status shows both tiers of the worker with what they served.
    status = eventually(
        tiers.tier_status, lambda s: s["disk"].hits >= PROMPT_BLOCKS, "status of the tiers"
    )
    assert list(status) == ["host", "disk"]
    assert status["host"].capacity_blocks == HOST_BLOCKS
    assert status["host"].hits >= PROMPT_BLOCKS and status["disk"].blocks >= 2 * PROMPT_BLOCKS
    return served


def damage(path: Path, kind: str) -> None:
    if kind == "flip":  # one payload byte: only the checksum can tell
        with path.open("r+b") as f:
            f.seek(block_file.HEADER_LEN + 100)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x40]))
    elif kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        path.unlink()


@pytest.mark.slow
def test_a_restarted_worker_serves_from_disk_and_damaged_blocks_are_misses(tiers, engine):
    full = PROMPT_BLOCKS * BLOCK
    kept = prompt("kept across the restart")
    first_bad = {"flip": 1, "truncate": 2, "delete": 3}  # each prompt's damaged block
    damaged = {kind: prompt(f"damaged: {kind}") for kind in first_bad}
    first = tiers.generate(kept)
    assert first[0] == engine(kept)
    want = {kind: tiers.generate(tokens)[0] for kind, tokens in damaged.items()}
    assert all(want[kind] == engine(tokens) for kind, tokens in damaged.items())
    tiers.fill_until_on_disk(kept, *damaged.values())

    (pid,) = _rank_pids(tiers.served, "WorkerActor")
    os.kill(pid, signal.SIGKILL)
    _wait_serving(tiers.stub, "decode", {WORKER: 1})  # restarted once, under its name
    # The same directory (<disk_tier_path>/<worker name>), the same fingerprint.
    assert [p.name for p in tiers.disk_root.iterdir()] == [WORKER]
    # One fingerprint's directory, and the lock the new process holds (dir_lock.py).
    names = sorted(p.name for p in (tiers.disk_root / WORKER).iterdir())
    assert len(names) == 2 and names[0] == LOCK_NAME, names
    status = eventually(tiers.tier_status, lambda s: "disk" in s, "the new worker's tiers")
    assert status["host"].blocks == 0  # a new process: only the disk kept anything
    assert status["disk"].blocks >= 4 * PROMPT_BLOCKS
    # The gauges are the new process's alone (the dead one's values left the node's).
    eventually(
        lambda: [(tiers.tier_metric("blocks", t), status[t].blocks) for t in ("host", "disk")],
        lambda pairs: all(m == b for m, b in pairs),
        "gauges against the status",
    )

    # Damaged while the worker holds those blocks on disk only (its pool and host tier
    # are empty): each is a miss, the prompt computes from there.
    for kind, tokens in damaged.items():
        path = tiers.block_files(tokens)[first_bad[kind]]
        assert path is not None
        damage(path, kind)
    before = tiers.scrape()
    again = tiers.generate(kept)
    assert again[:2] == first[:2]  # onboarded from disk, token for token
    assert again[2].usage.cached_prompt_tokens == full
    for kind, tokens in damaged.items():
        tokens_out, _, final = tiers.generate(tokens)
        assert tokens_out == want[kind], kind
        assert final.usage.cached_prompt_tokens == first_bad[kind] * BLOCK, kind
    hits = PROMPT_BLOCKS + sum(first_bad.values())
    assert hit_deltas(tiers, before, hits, "disk") == {"host": 0, "disk": hits}
    errors = eventually(
        lambda: (
            tiers.tier_metric("errors_total", "disk")
            - tiers.tier_metric("errors_total", "disk", before)
        ),
        lambda d: d >= len(damaged),
        "disk errors",
    )
    assert errors == len(damaged)
    misses = tiers.tier_metric("misses_total", "disk") - tiers.tier_metric(
        "misses_total", "disk", before
    )
    assert misses >= len(damaged)
    for kind, tokens in damaged.items():  # removed: never read again
        assert tiers.block_files(tokens)[first_bad[kind]] is None, kind
    # Each kind logged (the worker's log reaches the cluster's output through Ray).
    logged = ("a corrupt block file", "a truncated block file", "a missing block file")
    eventually(
        lambda: [m for m in logged if not any(m in line for line in tiers.served.lines)],
        lambda missing: not missing,
        "not logged",
    )

    # The worker keeps serving: the damaged prompts again, now whole from its pool.
    for kind, tokens in damaged.items():
        tokens_out, _, final = tiers.generate(tokens)
        assert tokens_out == want[kind] and final.usage.cached_prompt_tokens == full, kind
    wait_blocks_released(tiers.stub)  # no block leaked by a failed onboarding either
