"""The scheduler's side of a peer pull (G4): a request whose prompt's first blocks come
from another worker's lease (``Request.num_peer_tokens``), the rest computed here.

Pure accounting (no model): it receives only the peer blocks after its own prefix-cache
hit, then computes the rest; a failed receive recomputes after its own hit; a prefix its
own cache covers by admission is declined and admitted as any request; nothing leaks.
"""

from __future__ import annotations

from workers.engine.handoff import HandoffState, KVReceive
from workers.engine.request import FinishReason, RequestStatus

from .test_scheduler import BS, make_request, make_scheduler, run_step

PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks of 4, then 2 tokens


def peer_request(rid: str, num_peer_blocks: int):
    req = make_request(rid, PROMPT, max_tokens=3)
    req.num_peer_tokens = num_peer_blocks * BS
    return req


def test_peer_blocks_after_the_own_hit_are_received_then_the_rest_computed():
    sched = make_scheduler(budget=32)
    sched.add(make_request("own", [*PROMPT[:8], 1], max_tokens=1))
    run_step(sched)  # "own" computed the prompt's first 2 blocks here
    own = sched.block_manager.block_table("own")[:2]
    sched.finish(sched.requests["own"], FinishReason.LENGTH)
    req = peer_request("p", 4)
    sched.add(req)
    assert sched.handoff.state("p") is HandoffState.AWAITING
    assert run_step(sched).chunks == ()  # only the admission into RECEIVING
    table = sched.block_manager.block_table("p")
    assert sched.handoff.take_receives() == [KVReceive("p", tuple(table[2:4]), 2)]
    assert table[:2] == own and len(table) == 4  # blocks for the peer prefix only, so far
    assert req.status is RequestStatus.RECEIVING and req.num_computed_tokens == 2 * BS

    sched.finish_receiving("p", ok=True)
    assert req.num_computed_tokens == 4 * BS and req.num_cached_tokens == 4 * BS
    (chunk,) = run_step(sched).chunks  # the rest of the prompt, then the first sample
    assert (chunk.start_pos, chunk.num_tokens, chunk.needs_sample) == (16, 6, True)
    sched.finish(req, FinishReason.LENGTH)
    bm = sched.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.find_prefix([*PROMPT, 1]).num_blocks == 5


def test_a_failed_peer_receive_recomputes_after_the_own_hit():
    sched = make_scheduler(budget=32)
    sched.add(make_request("own", [*PROMPT[:4], 1], max_tokens=1))
    run_step(sched)
    sched.finish(sched.requests["own"], FinishReason.LENGTH)
    sched.add(peer_request("p", 3))
    run_step(sched)
    assert sched.handoff.take_receives()[0].first_block == 1
    sched.finish_receiving("p", ok=False)
    (chunk,) = run_step(sched).chunks
    assert (chunk.start_pos, chunk.num_tokens) == (4, 18)  # after the own block only
    assert sched.requests["p"].num_cached_tokens == BS


def test_a_peer_prefix_the_own_cache_covers_is_declined_and_admitted_normally():
    sched = make_scheduler(budget=32)
    sched.add(make_request("own", [*PROMPT[:12], 1], max_tokens=1))
    run_step(sched)  # 3 blocks here: as many as the peer offers
    sched.finish(sched.requests["own"], FinishReason.LENGTH)
    sched.add(peer_request("p", 3))
    (chunk,) = run_step(sched).chunks
    assert sched.handoff.take_receives() == [] and sched.handoff.take_declines() == ["p"]
    assert sched.handoff.state("p") is None
    assert (chunk.start_pos, chunk.num_tokens) == (12, 10)  # computed after the own hit


def test_abort_while_awaiting_or_receiving_a_peer_prefix_leaks_nothing():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1, budget=32)
    sched.add(peer_request("a", 3))
    sched.add(peer_request("b", 3))  # waits for a seat: AWAITING
    run_step(sched)
    assert sched.handoff.state("a") is HandoffState.RECEIVING
    assert sched.abort(["b"])[0].finish_reason is FinishReason.ABORT
    assert sched.handoff.take_declines() == ["b"]
    assert sched.abort(["a"]) == []  # the transfer may still write: kept
    assert sched.finish_receiving("a", ok=True).finish_reason is FinishReason.ABORT
    bm = sched.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and not sched.requests
