"""Scheduler: token budget, chunked prefill, decode-first batches, preemption, aborts.

No model: a step is simulated by advancing the scheduled chunks and appending a
token to every chunk that samples.
"""

from __future__ import annotations

import random

from workers.engine.block_manager import BlockManager
from workers.engine.handoff import KVReceive
from workers.engine.request import FinishReason, Request, RequestStatus
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.protocol.sampling_params import SamplingParams

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


# ---- disaggregated roles -------------------------------------------------------------
def make_remote_request(rid: str, prompt: list[int], first_token: int = 9) -> Request:
    """Decode role: the prompt was prefilled elsewhere, which also sampled the first token."""
    req = make_request(rid, prompt)
    req.append_token(first_token)
    req.is_remote_prefill = True
    return req


def test_remote_prefill_shares_its_cached_prefix_and_receives_the_rest_into_fresh_blocks():
    sched = make_scheduler(budget=16)
    sched.add(make_request("local", [0, 1, 2, 3, 70, 71, 72, 73]))
    run_step(sched)  # "local"'s two full blocks are now in the prefix cache
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 50]  # the first block is "local"'s
    remote = make_remote_request("remote", prompt)
    sched.add(remote)
    out = run_step(sched)
    assert [c.request_id for c in out.chunks] == ["local"]  # nothing computed for "remote"
    assert remote.status is RequestStatus.RECEIVING and remote not in sched.running
    bm = sched.block_manager
    table = bm.block_table("remote")
    # The first block is "local"'s (shared, never written); two fresh ones receive the rest.
    assert len(table) == 3 and table[0] == bm.block_table("local")[0]
    assert not set(table[1:]) & set(bm.block_table("local"))
    assert sched.handoff.take_receives() == [KVReceive("remote", tuple(table[1:]), 1)]
    assert sched.handoff.take_receives() == []
    assert remote.num_computed_tokens == remote.num_cached_tokens == 4
    for _ in range(3):  # never scheduled while receiving
        assert [c.request_id for c in run_step(sched).chunks] == ["local"]

    sched.finish_receiving("remote", ok=True)
    assert remote.status is RequestStatus.RUNNING and remote.num_computed_tokens == 9
    (_, chunk) = run_step(sched).chunks
    # The first token's KV and the second token: one decode from position 9.
    assert (chunk.request_id, chunk.start_pos, chunk.num_tokens, chunk.needs_sample) == (
        "remote",
        9,
        1,
        True,
    )
    # On arrival the new full block was published to the prefix cache.
    hit = bm.find_prefix([*prompt, 1])
    assert hit.block_ids == (bm.block_table("local")[0], table[1])


def test_receiving_counts_as_running_and_is_never_preempted():
    # 4 blocks: "remote" holds 2 while receiving; "a" grows until it needs a third.
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, budget=64)
    sched.add(make_remote_request("remote", list(range(8))))
    sched.add(make_request("a", [1, 2, 3]))
    sched.add(make_request("b", [4]))
    run_step(sched)
    assert [r.request_id for r in sched.waiting] == ["b"]  # max_num_seqs=2 reached
    preempted = [p for _ in range(8) for p in run_step(sched).preempted_ids]
    assert preempted == ["a"]  # the one running request yields, not the receiving one
    assert sched.receiving["remote"].status is RequestStatus.RECEIVING
    assert len(sched.block_manager.block_table("remote")) == 2


def test_remote_prefill_without_blocks_waits_at_the_head_of_the_queue():
    sched = make_scheduler(num_blocks=3, budget=64)
    sched.add(make_request("big", list(range(8))))
    sched.add(make_remote_request("remote", list(range(50, 62))))  # 3 blocks: not now
    sched.add(make_request("small", [1]))
    run_step(sched)
    assert [r.request_id for r in sched.waiting] == ["remote", "small"]
    sched.finish(sched.requests["big"], FinishReason.LENGTH)
    run_step(sched)
    assert [r.request_id for r in sched.handoff.take_receives()] == ["remote"]


def test_failed_receive_recomputes_into_the_same_blocks():
    sched = make_scheduler(budget=8)
    sched.add(make_remote_request("remote", list(range(10))))
    run_step(sched)
    (receive,) = sched.handoff.take_receives()
    blocks = receive.block_ids
    sched.finish_receiving("remote", ok=False)
    steps = [run_step(sched).chunks for _ in range(2)]
    assert [(c.start_pos, c.num_tokens, c.needs_sample) for (c,) in steps] == [
        (0, 8, False),
        (8, 3, True),  # the rest of the prompt and the first token, then sample the 2nd
    ]
    assert sched.block_manager.block_table("remote")[:3] == list(blocks)


def test_failed_partial_receive_recomputes_after_the_shared_prefix_only():
    sched = make_scheduler(budget=16)
    sched.add(make_request("local", [*range(8), 90]))
    run_step(sched)  # "local"'s first two blocks are now in the prefix cache
    local_blocks = sched.block_manager.block_table("local")[:2]
    sched.add(make_remote_request("remote", [*range(8), 60, 61, 62]))
    run_step(sched)
    (receive,) = sched.handoff.take_receives()
    assert receive.first_block == 2 and len(receive.block_ids) == 1
    sched.finish_receiving("remote", ok=False)
    chunks = [c for c in run_step(sched).chunks if c.request_id == "remote"]
    # The prompt after the shared blocks and the first token; nothing written into those.
    assert [(c.start_pos, c.num_tokens, c.needs_sample) for c in chunks] == [(8, 4, True)]
    assert sched.block_manager.block_table("remote") == [*local_blocks, *receive.block_ids]


def test_abort_while_partially_receiving_keeps_the_shared_prefix_cached():
    sched = make_scheduler(budget=16)
    sched.add(make_request("local", [*range(8), 90], max_tokens=1))
    run_step(sched)
    sched.finish(sched.requests["local"], FinishReason.LENGTH)
    bm = sched.block_manager
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    sched.add(make_remote_request("remote", [*range(8), 60, 61, 62]))
    run_step(sched)
    assert sched.handoff.take_receives()[0].first_block == 2
    assert bm.num_used_blocks == 3 and bm.num_cached_blocks == 0  # the cached ones revived
    assert sched.abort(["remote"]) == []  # a transfer may still write the fresh block
    req = sched.finish_receiving("remote", ok=True)
    assert req.finish_reason is FinishReason.ABORT
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # the shared blocks stay
    assert bm.find_prefix([*range(8), 1]).num_blocks == 2


def test_abort_while_receiving_frees_only_after_the_transfer_ended():
    sched = make_scheduler()
    sched.add(make_remote_request("remote", list(range(6))))
    run_step(sched)
    assert sched.abort(["remote"]) == []
    assert sched.block_manager.num_used_blocks == 2 and sched.num_unfinished == 1
    req = sched.finish_receiving("remote", ok=True)
    assert req.finish_reason is FinishReason.ABORT and sched.num_unfinished == 0
    assert sched.block_manager.num_used_blocks == 0
    sched.block_manager.check_integrity()


def test_hold_keeps_the_blocks_out_of_scheduling():
    sched = make_scheduler()
    req = make_request("p", list(range(6)))
    sched.add(req)
    run_step(sched)
    sched.hold(req)
    assert sched.num_unfinished == 0 and run_step(sched).is_empty
    assert sched.abort(["p"]) == []  # no longer the scheduler's
    bm = sched.block_manager
    assert bm.block_table("p") and bm.num_used_blocks == 2
    bm.free("p")  # what the engine's release_held does
    bm.check_integrity()
    assert bm.num_used_blocks == 0


# ---- slots: one batch per pipeline stage in flight ---------------------------------------


def test_slots_balance_requests_and_schedule_only_their_own():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=64, num_slots=2)
    for rid in "abcde":
        sched.add(make_request(rid, [1, 2, 3]))
    assert [sched.requests[r].slot for r in "abcde"] == [0, 1, 0, 1, 0]
    first = sched.schedule(0)
    assert [c.request_id for c in first.chunks] == ["a", "c", "e"]
    # Slot 0's batch is "in flight" (not updated): slot 1 draws only its own requests,
    # and slot 0's running requests are not touched.
    second = sched.schedule(1)
    assert [c.request_id for c in second.chunks] == ["b", "d"]
    for out in (first, second):
        for chunk in out.chunks:
            sched.update_computed(chunk).append_token(7)
    again = sched.schedule(0)
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in again.chunks] == [
        ("a", 3, 1),
        ("c", 3, 1),
        ("e", 3, 1),
    ]
    sched.block_manager.check_integrity()
    # A request added later goes to the slot with fewer unfinished requests.
    sched.finish(sched.requests["b"], FinishReason.STOP)
    sched.finish(sched.requests["d"], FinishReason.STOP)
    sched.add(make_request("f", [4, 5]))
    assert sched.requests["f"].slot == 1


def test_a_slot_preempts_only_its_own_requests():
    """Blocks run out while slot 1's batch is in flight: slot 0 preempts its own newest
    request, never one of slot 1 (whose KV the pipeline is still writing)."""
    sched = Scheduler(BlockManager(6, BS), max_num_seqs=8, max_num_batched_tokens=64, num_slots=2)
    for rid in "abcd":
        sched.add(make_request(rid, [1, 2, 3, 4]))  # one full block each
    for slot in (0, 1):
        for chunk in sched.schedule(slot).chunks:
            sched.update_computed(chunk).append_token(7)
    assert sched.block_manager.num_free_blocks == 2
    in_flight = sched.schedule(1)  # b and d take the two free blocks for their 5th token
    assert [c.request_id for c in in_flight.chunks] == ["b", "d"]
    out = sched.schedule(0)  # a and c need a block each: none is free
    assert out.preempted_ids == ("c",)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert {sched.requests[r].status for r in "bd"} == {RequestStatus.RUNNING}
    sched.block_manager.check_integrity()


def _spans(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_pos, c.num_tokens, c.needs_sample) for c in out.chunks]


def _complete(sched: Scheduler, out: SchedulerOutput) -> None:
    """The batch came back from the pipeline: advance its chunks, sample 7 where due."""
    for chunk in out.chunks:
        req = sched.update_computed(chunk)
        if chunk.needs_sample:
            req.append_token(7)


def test_a_prompt_goes_on_in_another_slot_while_its_chunk_is_in_flight():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=8, num_slots=2)
    a = make_request("a", list(range(20)))
    sched.add(a)
    first = sched.schedule(0)
    second = sched.schedule(1)  # slot 0's batch is still in flight
    assert _spans(first) == [("a", 0, 8, False)]
    assert _spans(second) == [("a", 8, 8, False)]
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (0, 16)
    _complete(sched, first)
    third = sched.schedule(0)
    assert _spans(third) == [("a", 16, 4, True)]
    _complete(sched, second)
    # The chunk that samples is in flight: a has no known token left to schedule.
    assert sched.schedule(1).is_empty
    _complete(sched, third)
    assert (a.num_computed_tokens, a.num_in_flight_tokens, a.num_tokens) == (20, 0, 21)
    # Decodes stay in their own slot.
    assert sched.schedule(1).is_empty
    assert _spans(sched.schedule(0)) == [("a", 20, 1, True)]
    sched.block_manager.check_integrity()


def test_a_request_with_tokens_in_flight_is_never_preempted():
    """Slot 0 runs out of blocks while a's first chunk is in flight in slot 1: a is not
    the victim (the pipeline is still writing its KV); it just waits for blocks."""
    sched = Scheduler(BlockManager(4, BS), max_num_seqs=8, max_num_batched_tokens=8, num_slots=2)
    c, a = make_request("c", [1, 2, 3, 4]), make_request("a", list(range(20)))
    sched.add(c)  # slot 0
    sched.add(a)  # slot 1
    _complete(sched, sched.schedule(0))  # c's prompt: one full block; 5 tokens now
    in_flight = sched.schedule(1)
    assert _spans(in_flight) == [("a", 0, 8, False)]  # two blocks; one is left
    out = sched.schedule(0)
    # c's decode takes the last block; a's next chunk (lent to slot 0) finds none.
    assert _spans(out) == [("c", 4, 1, True)]
    assert out.preempted_ids == ()
    assert a.status is RequestStatus.RUNNING and a.num_in_flight_tokens == 8
    _complete(sched, in_flight)
    _complete(sched, out)
    assert a.num_computed_tokens == 8
    sched.block_manager.check_integrity()


def test_slots_with_prompts_in_several_batches_keep_every_invariant():
    """Random requests, budgets, block counts and aborts through 2-3 slots, run like the
    engine: fill every free slot, then complete the oldest batch. A chunk always starts
    where its request's computed tokens end (so no request is preempted, and no chunk
    lost or repeated, while in flight), and nothing is left in use."""
    rng = random.Random(3)
    overlaps = 0
    for trial in range(40):
        num_slots = rng.choice([2, 3])
        sched = Scheduler(
            BlockManager(rng.randrange(12, 24), BS),
            max_num_seqs=4,
            max_num_batched_tokens=rng.choice([4, 8, 12]),
            num_slots=num_slots,
        )
        for i in range(6):
            prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
            sched.add(make_request(f"t{trial}-{i}", prompt, max_tokens=rng.randrange(1, 6)))
        in_flight: list[tuple[int, SchedulerOutput, list[Request]]] = []
        for _ in range(500):
            busy = {slot for slot, _, _ in in_flight}
            for slot in (s for s in range(num_slots) if s not in busy):
                out = sched.schedule(slot)
                if out.is_empty:
                    continue
                owners = [sched.requests[c.request_id] for c in out.chunks]
                flying = {c.request_id for _, o, _ in in_flight for c in o.chunks}
                overlaps += sum(c.request_id in flying for c in out.chunks)
                in_flight.append((slot, out, owners))
            if not in_flight:
                break
            _, out, owners = in_flight.pop(0)
            for chunk, req in zip(out.chunks, owners, strict=True):
                if sched.requests.get(chunk.request_id) is not req:
                    continue  # aborted while in flight
                assert chunk.start_pos == req.num_computed_tokens
                sched.update_computed(chunk)
                if chunk.needs_sample:
                    req.append_token(7)
                    if req.num_output_tokens >= req.max_tokens:
                        sched.finish(req, FinishReason.LENGTH)
            if rng.random() < 0.05 and sched.requests:
                sched.abort([rng.choice(sorted(sched.requests))])
            assert all(r.num_in_flight_tokens >= 0 for r in sched.requests.values())
            sched.block_manager.check_integrity()
        assert sched.num_unfinished == 0, f"trial {trial}: requests left unfinished"
        assert sched.block_manager.num_used_blocks == 0
    assert overlaps > 50  # prompts really were in several batches at once
