"""Scheduler: token budget, chunked prefill, decode-first batches, preemption, aborts.

No model: a step is simulated by advancing the scheduled chunks and appending a
token to every chunk that samples.
"""

from __future__ import annotations

import random

from workers.block_manager import BlockManager
from workers.request import FinishReason, Request, RequestStatus
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput

BS = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget)


def make_request(rid: str, prompt: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset())


def run_step(sched: Scheduler, next_token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    for chunk in out.chunks:
        req = sched.update_computed(chunk)
        if chunk.needs_sample:
            req.append_token(next_token)
    sched.block_manager.check_integrity()
    return out


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(budget=8)
    sched.add(make_request("a", list(range(20))))
    steps = [run_step(sched) for _ in range(4)]
    sizes = [[(c.start_pos, c.num_tokens, c.needs_sample) for c in s.chunks] for s in steps]
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)]]


def test_decodes_first_and_budget_shared_with_new_prefill():
    sched = make_scheduler(budget=10)
    sched.add(make_request("a", [1, 2, 3]))
    run_step(sched)  # a prefilled, has sampled one token
    sched.add(make_request("b", list(range(30))))
    out = run_step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add(make_request(f"r{i}", [i, i + 1]))
    out = run_step(sched)
    assert {c.request_id for c in out.chunks} == {"r0", "r1"}
    assert len(sched.waiting) == 2


def test_preemption_when_blocks_run_out_and_recompute_from_prefix_cache():
    # 6 blocks of 4 slots; two requests of 8 prompt tokens use 2 blocks each, then grow.
    sched = make_scheduler(num_blocks=6, budget=64)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(100, 108)))
    sched.add(a)
    sched.add(b)
    preempted: list[str] = []
    for _ in range(12):
        out = run_step(sched)
        preempted.extend(out.preempted_ids)
        if preempted:
            break
    assert preempted == ["b"]  # the later request yields
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    assert not sched.block_manager.has_request("b")
    # Finish a; b comes back and finds its full prompt blocks in the prefix cache.
    sched.finish(a, FinishReason.LENGTH)
    out = run_step(sched)
    (chunk,) = out.chunks
    assert chunk.request_id == "b" and chunk.start_pos >= 8
    assert b.num_preemptions == 1


def test_abort_at_any_moment_leaves_nothing_in_use():
    rng = random.Random(0)
    for trial in range(30):
        sched = make_scheduler(num_blocks=24, max_num_seqs=4, budget=12)
        requests = [
            make_request(f"t{trial}-{i}", [rng.randrange(5) for _ in range(rng.randrange(1, 40))])
            for i in range(6)
        ]
        for req in requests:
            sched.add(req)
        for _ in range(rng.randrange(0, 15)):
            run_step(sched)
            for req in list(sched.requests.values()):
                if req.num_output_tokens >= 3:
                    sched.finish(req, FinishReason.LENGTH)
        aborted = sched.abort([r.request_id for r in requests] + ["unknown"])
        assert all(r.finish_reason is FinishReason.ABORT for r in aborted)
        assert sched.num_unfinished == 0
        bm = sched.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0
        assert bm.num_free_blocks == bm.num_blocks


def test_fcfs_head_of_queue_is_not_overtaken():
    sched = make_scheduler(num_blocks=4, budget=64)
    sched.add(make_request("big", list(range(12))))  # 3 blocks
    sched.add(make_request("huge", list(range(50, 64))))  # 4 blocks: does not fit beside big
    sched.add(make_request("small", [1]))
    out = run_step(sched)
    assert [c.request_id for c in out.chunks] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["huge", "small"]
