"""Layer-wise onboarding (workers/engine/kv_tiers/layer_onboard.py) on real tiers (host
memory, a disk directory) and a real engine on the tiny model: the tokens of the
synchronous path and of no tiers at all, the layers-ready counter, a read failing after
some layer groups, a step failing while it onboards, and the overlap of onboarding with
the first chunk's compute."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.workers.kv_tiers.test_tiers_engine import (
    BLOCK,
    GREEDY,
    HOST_GIB,
    Counting,
    assert_clean,
    make_llm,
    model_dir,  # noqa: F401 (a fixture)
    prompts,
)
from workers.engine.kv_tiers import build
from workers.engine.kv_tiers.layer_onboard import AUTO_MIN_HOST_BLOCKS, OnboardJob
from workers.engine.kv_tiers.manager import TierHit

STAGING = 64 * 4096  # the disk's staging above it: 64 of the tiny model's blocks


def tokens(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def on_disk_only(llm) -> None:
    """Everything the pool cached goes to the disk, and the host memory above it (the
    staging tier) forgets it: the next run onboards from the disk."""
    tiers = llm.engine.kv_tiers
    llm.engine.block_manager.evict()
    tiers.wait_idle()
    staging = tiers._lookup[0]
    for junk in range(staging.capacity_blocks):
        staging.put(junk, torch.zeros(staging.block_bytes, dtype=torch.uint8))


def disk_llm(model_dir, tmp_path, monkeypatch, **kwargs):  # noqa: F811
    monkeypatch.setattr(build, "STAGING_BYTES", STAGING)
    return make_llm(model_dir, kv_disk_tier_path=str(tmp_path), kv_tier_onboard="on", **kwargs)


def record_jobs(llm) -> list[OnboardJob]:
    jobs: list[OnboardJob] = []
    llm.engine.kv_tiers.layerwise.after_group = lambda job, _: jobs.count(job) or jobs.append(job)
    return jobs


@pytest.mark.parametrize("tier", ["host", "disk", "disk-fp8", "disk-keyed"])
def test_the_synchronous_and_the_no_tier_tokens(model_dir, tmp_path, monkeypatch, tier):  # noqa: F811
    """``disk-keyed``: block files MAC'd with a secret, verified range by range."""
    extra = {"kv_cache_dtype": "fp8_e4m3"} if tier.endswith("fp8") else {}
    ps = prompts()
    want = tokens(make_llm(model_dir, **extra).generate(ps, GREEDY))
    if tier.endswith("keyed"):
        secret = tmp_path / "secret"
        secret.write_text("s" * 32)
        extra = {"kv_disk_tier_secret_file": str(secret)}
    if tier == "host":
        sync = make_llm(model_dir, kv_host_tier_gib=HOST_GIB, kv_tier_onboard="off")
        llm = make_llm(model_dir, kv_host_tier_gib=HOST_GIB, kv_tier_onboard="on")
    else:
        sync = disk_llm(model_dir, tmp_path / "sync", monkeypatch, **extra)
        sync.engine.kv_tiers.layerwise.mode = "off"
        llm = disk_llm(model_dir, tmp_path / "lw", monkeypatch, **extra)
    for engine_llm in (sync, llm):
        assert tokens(engine_llm.generate(ps, GREEDY)) == want
        if tier == "host":
            engine_llm.engine.block_manager.evict()
        else:
            on_disk_only(engine_llm)
    jobs = record_jobs(llm)
    counting = Counting(llm.engine.scheduler)
    assert tokens(sync.generate(ps, GREEDY)) == want
    outs = llm.generate(ps, GREEDY)
    assert tokens(outs) == want
    num_layers = llm.engine.kv_cache.shape[1]
    assert jobs and all(job.published == [1, 2] == list(range(1, num_layers + 1)) for job in jobs)
    for out, p in zip(outs, ps, strict=True):
        assert out.num_cached_tokens == BLOCK * ((len(p) - 1) // BLOCK)
        assert counting.computed[out.request_id] == len(p) - out.num_cached_tokens + 11
    stats, sync_stats = llm.engine.kv_tiers.stats(), sync.engine.kv_tiers.stats()
    # A shared prefix is onboarded once: a request whose prefix another one admitted in
    # the same step onboards waits a step, then finds it in the pool (as the sync path's).
    assert stats.onboarded == sync_stats.onboarded == sum(j.num_blocks for j in jobs) > 0
    assert stats.onboard_failed == 0
    assert llm.engine.kv_tiers.tiers[-1].stats().hits >= stats.onboarded
    assert_clean(llm)


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_read_failing_after_a_group_recomputes_from_that_block(
    model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    damage,
):
    """The second hit block's file is damaged once the first layer group was copied:
    truncated (its next range is short), or a byte of its last layer flipped (its checksum,
    known after the last range, is wrong). That block and the ones after it are recomputed,
    the first one is kept."""
    ps = prompts(1)
    want = tokens(make_llm(model_dir).generate(ps, GREEDY))
    llm = disk_llm(model_dir, tmp_path, monkeypatch)
    assert tokens(llm.generate(ps, GREEDY)) == want
    on_disk_only(llm)
    disk = llm.engine.kv_tiers.tiers[-1]
    num_on_disk = disk.stats().blocks
    jobs: list[OnboardJob] = []

    def truncate_second_block(job: OnboardJob, layers: int) -> None:
        jobs.append(job)
        if layers == 1:
            path = disk._path(job.block_hashes[1])
            os.truncate(path, 100) if damage == "truncated" else flip_last_byte(path)

    llm.engine.kv_tiers.layerwise.after_group = truncate_second_block
    counting = Counting(llm.engine.scheduler)
    (out,) = llm.generate(ps, GREEDY)
    assert tokens([out]) == want
    (job,) = set(jobs)
    num_hit = len(job.block_hashes)
    assert num_hit >= 3 and job.num_blocks == 1 and job.published == [1, 2]
    assert out.num_cached_tokens == BLOCK  # the first block only
    # The chunk that ran with the bad block was dropped; the rest computed again after it.
    first_chunk = len(ps[0]) - num_hit * BLOCK
    assert counting.computed[out.request_id] == first_chunk + len(ps[0]) - BLOCK + 11
    stats = llm.engine.kv_tiers.stats()
    assert (stats.onboarded, stats.onboard_failed) == (1, num_hit - 1)
    assert disk.stats().errors == 1
    assert_clean(llm)
    # The bad file is gone, every other block stays; the recomputed ones are in the pool.
    assert disk.stats().blocks == num_on_disk - 1
    disk.check_integrity()


def test_a_step_failing_while_it_onboards_frees_and_recomputes(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """The forward raises after its first layer, while the second group is on its way: the
    onboarding stops, nothing counts as arrived; the retry recomputes the prefix (the same
    tokens) and an abort then leaks no block in the pool or a tier."""
    ps = prompts(2)
    want = tokens(make_llm(model_dir).generate(ps, GREEDY))
    llm = disk_llm(model_dir, tmp_path, monkeypatch)
    llm.generate(ps, GREEDY)
    on_disk_only(llm)
    disk = llm.engine.kv_tiers.tiers[-1]
    num_on_disk = disk.stats().blocks
    engine = llm.engine
    jobs = record_jobs(llm)
    run = engine.runner.run

    def failing_run(inputs, hook=None):
        def raising(layer: int) -> None:
            hook(layer)
            raise RuntimeError("injected")

        return run(inputs, raising)

    engine.runner.run = failing_run
    ids = [engine.add_request(p, GREEDY) for p in ps]
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.run = run
    assert jobs and all(j.is_done and j.is_cancelled for j in jobs)
    assert not engine.kv_tiers.layerwise.jobs
    engine.abort_request(ids[1])
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outs.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert outs[ids[0]] == want[0]
    assert_clean(llm)
    assert disk.stats().blocks == num_on_disk and disk.stats().errors == 0
    disk.check_integrity()


def test_the_first_chunk_computes_while_later_groups_arrive(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """With a deterministic delay per onboarded layer group and per computed layer, the
    step's forward ends before onboarding and compute summed: layer 0 computes while group
    1 is read."""
    delay = 0.3
    ps = prompts(1)
    llm = disk_llm(model_dir, tmp_path, monkeypatch)
    llm.generate(ps, GREEDY)
    on_disk_only(llm)
    engine = llm.engine
    jobs = record_jobs(llm)
    record = engine.kv_tiers.layerwise.after_group

    published: list[float] = []  # when each group is published (after its delay)

    def slow_group(job: OnboardJob, layers: int) -> None:
        record(job, layers)
        time.sleep(delay)
        published.append(time.perf_counter())

    engine.kv_tiers.layerwise.after_group = slow_group
    layer_s: list[float] = []
    starts: list[float] = []

    def slow_layer(*_args) -> None:
        starts.append(time.perf_counter())
        time.sleep(delay)

    layers = engine.model.model.layers
    handles = [layer.register_forward_pre_hook(slow_layer) for layer in layers]
    handles += [
        layer.register_forward_hook(lambda *_a: layer_s.append(time.perf_counter() - starts[-1]))
        for layer in layers
    ]
    run, run_s = engine.runner.run, []

    def timed_run(inputs, hook=None):
        t0 = time.perf_counter()
        try:
            return run(inputs, hook)
        finally:
            run_s.append(time.perf_counter() - t0)

    engine.runner.run = timed_run
    engine.add_request(ps[0], GREEDY)
    t0 = time.perf_counter()
    engine.step()  # admission starts the onboarding; the first chunk waits per layer
    step_s = time.perf_counter() - t0
    for handle in handles:
        handle.remove()
    (job,) = set(jobs)
    assert job.num_blocks == len(job.block_hashes) > 0
    compute_s = sum(layer_s[: len(layers)])
    # Layer 0 computed while the last group was still on its way...
    assert published[0] < starts[0] < published[-1] - delay / 2
    # ... so the forward took about 3 delays, not onboarding + compute (about 2 + 2).
    assert run_s[0] < step_s
    assert run_s[0] < job.seconds + compute_s - delay / 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_preemption_and_aborts_with_a_small_pool(model_dir):  # noqa: F811
    """14 blocks of 8 for 6 requests of up to 75 tokens: requests are preempted while
    others onboard their prefixes layer-wise from the host tier (the pool emptied into it
    first); the tokens are the plain engine's, aborts leave nothing behind."""
    ps = prompts(6)
    want = tokens(make_llm(model_dir).generate(ps, GREEDY))
    llm = make_llm(
        model_dir, num_kv_blocks=14, max_model_len=96, kv_host_tier_gib=HOST_GIB,
        kv_tier_onboard="on",
    )  # fmt: skip
    assert tokens(llm.generate(ps, GREEDY)) == want
    engine = llm.engine
    engine.block_manager.evict()
    jobs = record_jobs(llm)
    num_preemptions = engine.scheduler.num_preemptions
    assert tokens(llm.generate(ps, GREEDY)) == want
    assert engine.scheduler.num_preemptions > num_preemptions and jobs
    engine.block_manager.evict()
    num_jobs = len(jobs)
    ids = [engine.add_request(p, GREEDY) for p in ps]
    engine.step()
    assert len(jobs) > num_jobs  # the first step onboarded layer-wise
    engine.abort_request(ids[::2])  # right after the step that onboarded them
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outs.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert [outs[i] for i in ids[1::2]] == want[1::2]
    assert not engine.kv_tiers.layerwise.jobs
    assert_clean(llm)


def test_auto_takes_disk_hits_and_large_host_hits(model_dir, tmp_path, monkeypatch):  # noqa: F811
    llm = disk_llm(model_dir, tmp_path, monkeypatch, kv_host_tier_gib=HOST_GIB)
    layerwise = llm.engine.kv_tiers.layerwise
    assert make_llm(model_dir, kv_host_tier_gib=HOST_GIB).engine.kv_tiers.layerwise.mode == "off"
    layerwise.mode = "auto"
    host, disk = 0, 1  # lookup order
    few = AUTO_MIN_HOST_BLOCKS - 1
    assert not layerwise.applies(TierHit(tuple(range(few)), (host,) * few))
    assert layerwise.applies(TierHit(tuple(range(few + 1)), (host,) * (few + 1)))
    assert layerwise.applies(TierHit((1, 2), (host, disk)))
    layerwise.mode = "off"
    assert not layerwise.applies(TierHit((1, 2), (host, disk)))
