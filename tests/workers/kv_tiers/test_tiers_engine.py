"""The engine with KV tiers: a prefix onboarded from a tier gives the same tokens as one
computed, and what was onboarded is not computed again."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.tools.make_model import make_model
from tests.workers import test_engine_roles as roles
from workers import LLM, SamplingParams
from workers.engine.kv_tiers import build
from workers.engine.scheduler import Scheduler

BLOCK = 8
HOST_GIB = 1 / 1024  # 1 MiB: 256 blocks of the tiny model's 4 KiB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return path


def make_llm(model_dir, **kwargs) -> LLM:
    args = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8)
    return LLM(str(model_dir), **(args | kwargs))


def prompts(num: int = 4) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(1000) for _ in range(29)]
    return [shared + [rng.randrange(1000) for _ in range(11 + 7 * i)] for i in range(num)]


class Counting:
    """Counts the prompt tokens the scheduler hands to the model, per request."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.computed: dict[str, int] = {}
        inner = scheduler.schedule

        def schedule(slot: int = 0):
            out = inner(slot)
            for c in out.chunks:
                self.computed[c.request_id] = self.computed.get(c.request_id, 0) + c.num_tokens
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.scheduler.requests
    for tier in engine.kv_tiers.tiers:
        tier.check_integrity()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_onboarded_from_host_gives_the_computed_tokens(model_dir, params):
    ps = prompts()
    plain = make_llm(model_dir)
    assert plain.engine.kv_tiers is None
    want = [list(o.token_ids) for o in plain.generate(ps, params)]

    llm = make_llm(model_dir, kv_host_tier_gib=HOST_GIB)
    first = llm.generate(ps, params)
    assert [list(o.token_ids) for o in first] == want
    bm = llm.engine.block_manager
    num_cached = bm.num_cached_blocks
    assert num_cached > 0
    assert bm.evict() == num_cached  # the pool forgets everything: it all goes to G2
    host = llm.engine.kv_tiers.tiers[0]
    assert host.stats().blocks == num_cached

    counting = Counting(llm.engine.scheduler)
    second = llm.generate(ps, params)
    assert [list(o.token_ids) for o in second] == want
    for out, p in zip(second, ps, strict=True):
        full = BLOCK * ((len(p) - 1) // BLOCK)
        assert out.num_cached_tokens == full  # the whole prompt but its last block's tail
        # Only the rest of the prompt and the decodes were computed: nothing onboarded.
        assert counting.computed[out.request_id] == len(p) - full + GREEDY.max_tokens - 1
    stats = llm.engine.kv_tiers.stats()
    # Each shared block is onboarded once: the first request's copy is then in the pool.
    shared = 29 // BLOCK
    assert stats.onboarded == sum((len(p) - 1) // BLOCK for p in ps) - shared * (len(ps) - 1)
    assert stats.onboard_failed == 0
    assert host.stats().hits == stats.onboarded
    assert_clean(llm)


def run_twice_with_the_pool_emptied(llm: LLM, ps, params) -> tuple[list, list]:
    first = llm.generate(ps, params)
    llm.engine.block_manager.evict()  # everything the pool cached goes down a tier
    return first, llm.generate(ps, params)


def test_fp8_cache_onboards_the_same_bytes(model_dir):
    ps = prompts()
    want = [list(o.token_ids) for o in make_llm(model_dir, kv_cache_dtype="fp8_e4m3").generate(
        ps, GREEDY)]  # fmt: skip
    llm = make_llm(model_dir, kv_cache_dtype="fp8_e4m3", kv_host_tier_gib=HOST_GIB)
    assert llm.engine.kv_cache.dtype == torch.uint8
    first, second = run_twice_with_the_pool_emptied(llm, ps, GREEDY)
    assert [list(o.token_ids) for o in first] == want
    assert [list(o.token_ids) for o in second] == want
    assert llm.engine.kv_tiers.stats().onboarded > 0
    assert_clean(llm)


def test_draft_model_recomputes_its_kv_for_onboarded_blocks(model_dir):
    """The draft (here the target itself) has no KV of onboarded blocks: it must compute
    it, not read what an earlier owner of those block ids left. With correct draft KV the
    self-draft's every proposal is accepted."""
    ps = prompts()
    want = [list(o.token_ids) for o in make_llm(model_dir).generate(ps, GREEDY)]
    llm = make_llm(
        model_dir,
        kv_host_tier_gib=HOST_GIB,
        speculative_method="draft",
        speculative_draft_model=str(model_dir),
    )
    llm.engine.spec.adaptive = False  # speculate at every step it may
    first, second = run_twice_with_the_pool_emptied(llm, ps, GREEDY)
    assert [list(o.token_ids) for o in first] == want
    # Fill the freed blocks' draft KV with garbage: a read of it would be rejected.
    llm.engine.spec.draft.runner.kv_cache.normal_()
    llm.engine.block_manager.evict()
    third = llm.generate(ps, GREEDY)
    assert [list(o.token_ids) for o in second] == want
    assert [list(o.token_ids) for o in third] == want
    assert llm.engine.kv_tiers.stats().onboarded > 0
    stats = llm.engine.spec_stats
    assert stats.num_steps > 0 and stats.acceptance_rate == 1.0
    assert_clean(llm)


def test_preemption_and_aborts_with_a_small_pool_and_host_tier(model_dir):
    ps = prompts(6)
    want = [list(o.token_ids) for o in make_llm(model_dir).generate(ps, GREEDY)]
    # 14 blocks of 8 for 6 requests of up to 75 tokens: preemption must happen, and the
    # preempted requests find their blocks in the pool or the host tier.
    llm = make_llm(model_dir, num_kv_blocks=14, max_model_len=96, kv_host_tier_gib=HOST_GIB)
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outs] == want
    assert llm.engine.kv_tiers.stats().offloaded > 0
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in ps]
    for _ in range(3):
        engine.step()
    engine.abort_request(ids[::2])
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_prefix_caching_off_turns_the_tiers_off(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=False, kv_host_tier_gib=HOST_GIB)
    assert llm.engine.kv_tiers is None
    assert len(llm.generate(prompts(2), GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_decode_role_with_tiers_gives_the_aggregated_tokens(model_dir):
    """Prefill and decode workers both with a host tier; the second round's prompts are
    onboarded on the prefill side, and the decode side's pool evicts into its tier."""
    agg = roles.make_engine(str(model_dir))
    pre = roles.make_engine(str(model_dir), kv_host_tier_gib=HOST_GIB, num_kv_blocks=24)
    dec = roles.make_engine(str(model_dir), kv_host_tier_gib=HOST_GIB, num_kv_blocks=24)
    ps = prompts()
    params = [roles.GREEDY] * len(ps)
    want = [roles.tokens(d) for d in roles.aggregated(agg, ps, params)]
    for _ in range(2):
        held = roles.prefill(pre, ps, params)
        out = roles.decode(pre, dec, ps, params, held)
        for h, w in zip(held, want, strict=True):
            assert [h.token_ids[0], *roles.tokens(out[h.request_id])] == w
        pre.block_manager.evict()
        dec.block_manager.evict()
    assert pre.kv_tiers.stats().onboarded > 0
    assert dec.kv_tiers.stats().offloaded > 0
    roles.assert_no_blocks_in_use(agg, pre, dec)


def test_a_host_tier_too_small_for_one_block_is_named(model_dir):
    with pytest.raises(ValueError, match=r"kv_host_tier_gib: .* holds no KV block of 4096 bytes"):
        make_llm(model_dir, kv_host_tier_gib=1e-9)


@pytest.mark.parametrize(
    "params", [GREEDY, pytest.param(SEEDED, marks=pytest.mark.slow)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("with_host", [True, False], ids=["host+disk", "disk"])
def test_prefix_onboarded_from_disk_gives_the_computed_tokens(
    model_dir, tmp_path, monkeypatch, params, with_host
):
    """After the first run the host memory above the disk (the host tier, or the disk
    writer's staging without one) is flooded with other blocks: the second run finds its
    prefixes on disk only."""
    host_bytes = 64 * 4096
    monkeypatch.setattr(build, "STAGING_BYTES", host_bytes)
    host = {"kv_host_tier_gib": host_bytes / 2**30} if with_host else {}
    ps = prompts()
    want = [list(o.token_ids) for o in make_llm(model_dir).generate(ps, params)]
    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path), **host)
    tiers = llm.engine.kv_tiers
    assert [t.name for t in tiers.tiers] == (["host", "disk"] if with_host else ["disk"])
    first = llm.generate(ps, params)
    llm.engine.block_manager.evict()
    tiers.wait_idle()  # the disk has every block now
    above = tiers._lookup[0]  # the host tier or the staging one
    assert tiers.stats().writer.written == tiers.stats().offloaded > 0
    for junk in range(64):
        above.put(junk, torch.zeros(4096, dtype=torch.uint8))
    counting = Counting(llm.engine.scheduler)
    second = llm.generate(ps, params)
    assert [list(o.token_ids) for o in first] == want
    assert [list(o.token_ids) for o in second] == want
    disk = tiers.tiers[-1]
    stats = tiers.stats()
    assert disk.stats().hits == stats.onboarded > 0 and stats.onboard_failed == 0
    for out, p in zip(second, ps, strict=True):
        assert out.num_cached_tokens == BLOCK * ((len(p) - 1) // BLOCK)
        # What was onboarded or found is not computed: the rest of the prompt and decodes.
        assert counting.computed[out.request_id] == len(p) - out.num_cached_tokens + 11
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    tiers.close()
