"""The engine with KV tiers: a prefix onboarded from a tier gives the same tokens as one
computed, and what was onboarded is not computed again."""

from __future__ import annotations

import random

import pytest

from cluster.tools.make_model import make_model
from workers import LLM, SamplingParams
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
