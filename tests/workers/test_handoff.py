"""KVHandoff: every row of its who-frees-what table, and every transition from every state.

No model: the prefill side's blocks come straight from a BlockManager; the decode side
runs a real Scheduler (simulated steps, as in test_scheduler.py), which allocates and
frees the request's blocks while the hand-off decides when it may.
"""

from __future__ import annotations

import pytest

from tests.workers.test_scheduler import BS, make_remote_request, make_request, run_step
from workers.engine.block_manager import BlockManager
from workers.engine.handoff import (
    PREFILL_STATES,
    HandoffError,
    HandoffState,
    KVHandoff,
    KVReceive,
)
from workers.engine.request import FinishReason, RequestStatus
from workers.engine.scheduler import Scheduler

HELD, OFFERED, LEASED = HandoffState.HELD, HandoffState.OFFERED, HandoffState.LEASED
AWAITING, RECEIVING = HandoffState.AWAITING, HandoffState.RECEIVING
ABORTING, DECLINING = HandoffState.ABORTING, HandoffState.DECLINING


def held(prompt_len: int = 6, rid: str = "p") -> tuple[KVHandoff, BlockManager, list[int]]:
    """Prefill: a request whose prompt filled ceil(prompt_len / BS) blocks, handed over."""
    bm = BlockManager(16, BS)
    assert bm.allocate_slots(rid, 0, prompt_len)
    handoff = KVHandoff(bm)
    handoff.hold(rid, bm.block_table(rid))
    return handoff, bm, bm.block_table(rid)


def assert_freed(bm: BlockManager, rid: str) -> None:
    bm.check_integrity()
    assert not bm.has_request(rid) and bm.num_used_blocks == 0


def decode_scheduler(num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, 16)


def receiving(prompt_len: int = 6) -> tuple[Scheduler, list[int]]:
    """Decode: a remote-prefill request admitted into RECEIVING, its receive taken."""
    sched = decode_scheduler()
    sched.add(make_remote_request("d", list(range(prompt_len))))
    assert sched.handoff.state("d") is AWAITING
    run_step(sched)
    table = sched.block_manager.block_table("d")
    assert sched.handoff.take_receives() == [KVReceive("d", tuple(table))]
    assert sched.handoff.state("d") is RECEIVING and sched.handoff.num_receiving == 1
    return sched, table


# ---- the table, row by row -------------------------------------------------------------
def test_finish_prefill_offers_leases_and_frees_only_at_the_lease_end():
    handoff, bm, table = held()
    assert handoff.state("p") is HELD and handoff.is_held("p") and handoff.num_held == 1
    assert handoff.held_block_ids("p") == tuple(table) and len(table) == 2
    assert handoff.offer("p") == tuple(table)
    assert handoff.state("p") is OFFERED
    assert handoff.offered("p") is True
    assert handoff.state("p") is LEASED and bm.block_table("p") == table
    assert handoff.lease_ended("p") is True  # D's done notice
    assert handoff.state("p") is None and handoff.num_held == 0
    assert_freed(bm, "p")
    assert handoff.lease_ended("p") is False  # a late notice: harmless


def test_finish_decode_receives_then_the_request_owns_its_blocks():
    sched, table = receiving(prompt_len=9)
    assert sched.receiving["d"].status is RequestStatus.RECEIVING
    req = sched.finish_receiving("d", ok=True)
    assert sched.handoff.state("d") is None and sched.handoff.num_receiving == 0
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 9
    assert sched.block_manager.block_table("d") == table  # the request's now
    sched.finish(req, FinishReason.LENGTH)
    assert_freed(sched.block_manager, "d")


def test_abort_on_prefill_before_the_handle_reached_decode_waits_for_the_lease():
    handoff, bm, table = held()
    handoff.offer("p")
    assert handoff.abort("p") is True  # a D may read these blocks once the handle is out
    assert handoff.state("p") is OFFERED and bm.block_table("p") == table
    handoff.offered("p")
    assert handoff.abort("p") is True
    assert handoff.state("p") is LEASED and bm.block_table("p") == table
    assert handoff.lease_ended("p")  # the router's decline through a D ends the lease
    assert_freed(bm, "p")


def test_abort_on_prefill_before_any_offer_frees_at_once():
    handoff, bm, _ = held()
    assert handoff.abort("p") is True  # in-process engine: no lease, nobody can read
    assert handoff.state("p") is None
    assert_freed(bm, "p")


def test_abort_on_decode_before_the_receive_started_declines_the_handles():
    sched = decode_scheduler(num_blocks=1)  # 2 blocks needed: it waits in the queue
    sched.add(make_remote_request("d", list(range(6))))
    run_step(sched)
    assert sched.handoff.state("d") is AWAITING and sched.handoff.take_receives() == []
    (req,) = sched.abort(["d"])
    assert req.finish_reason is FinishReason.ABORT
    assert sched.handoff.state("d") is DECLINING and "d" in sched.handoff
    assert sched.handoff.abort("d") is True and sched.handoff.state("d") is DECLINING
    assert sched.handoff.take_declines() == ["d"]
    assert sched.handoff.state("d") is None and sched.handoff.take_declines() == []
    assert_freed(sched.block_manager, "d")


def test_abort_on_decode_while_receiving_frees_only_when_the_transfer_ended():
    sched, table = receiving()
    assert sched.abort(["d"]) == []
    assert sched.handoff.state("d") is ABORTING and sched.num_unfinished == 1
    assert sched.abort(["d"]) == [] and sched.handoff.state("d") is ABORTING
    assert sched.block_manager.block_table("d") == table  # a transfer may be writing
    assert sched.handoff.num_receiving == 1 and list(sched.receiving) == ["d"]
    with pytest.raises(HandoffError, match="aborting"):
        sched.finish(sched.requests["d"], FinishReason.ABORT)
    req = sched.finish_receiving("d", ok=True)
    assert req.finish_reason is FinishReason.ABORT and sched.handoff.state("d") is None
    assert_freed(sched.block_manager, "d")
    assert sched.handoff.take_declines() == []  # its transfer sent P the notice


def test_transfer_failure_recomputes_on_decode_and_the_notice_frees_prefill():
    sched, table = receiving()
    req = sched.finish_receiving("d", ok=False)
    assert sched.handoff.state("d") is None and req.status is RequestStatus.RUNNING
    assert req.num_computed_tokens == 0 and sched.block_manager.block_table("d") == table
    (chunk,) = run_step(sched).chunks  # the prompt again, into the same blocks
    assert (chunk.start_pos, chunk.block_ids[:2]) == (0, tuple(table))
    assert sched.handoff.state("d") is None  # a preemption would not receive again

    handoff, bm, _ = held()
    handoff.offer("p")
    handoff.offered("p")
    assert handoff.lease_ended("p")  # D's failed notice (or expiry)
    assert_freed(bm, "p")


def test_transfer_failure_with_on_failure_fail_aborts_then_frees():
    sched, _ = receiving()
    assert sched.abort(["d"]) == []  # what the worker does before reporting the end
    req = sched.finish_receiving("d", ok=False)
    assert req.finish_reason is FinishReason.ABORT
    assert_freed(sched.block_manager, "d")


def test_offer_failure_frees_at_once():
    handoff, bm, _ = held()
    handoff.offer("p")
    assert handoff.offer_failed("p") is True  # no handle went out
    assert handoff.state("p") is None
    assert_freed(bm, "p")
    assert handoff.offer_failed("p") is False and handoff.offered("p") is False


@pytest.mark.parametrize("state", [OFFERED, LEASED], ids=["offered", "leased"])
def test_lease_expiry_or_decline_frees(state):
    """Expiry (D died or never read), a decline's notice, shutdown: one path."""
    handoff, bm, _ = held()
    handoff.offer("p")
    if state is LEASED:
        handoff.offered("p")
    assert handoff.lease_ended("p") is True
    assert handoff.state("p") is None
    assert_freed(bm, "p")


def test_release_frees_a_held_request_in_any_prefill_state():
    for steps in ([], ["offer"], ["offer", "offered"]):
        handoff, bm, _ = held()
        for step in steps:
            getattr(handoff, step)("p")
        assert handoff.release("p") is True
        assert_freed(bm, "p")
        assert handoff.release("p") is False


def test_receives_and_declines_come_out_once_in_order():
    handoff = KVHandoff(BlockManager(16, BS))
    for rid in "abc":
        handoff.expect(rid)
    handoff.start_receiving("b", [3, 4])
    handoff.start_receiving("a", [5])
    handoff.request_ended("c")
    assert handoff.take_receives() == [KVReceive("b", (3, 4)), KVReceive("a", (5,))]
    assert handoff.take_receives() == []
    assert handoff.ids(RECEIVING, ABORTING) == ["a", "b"]  # the order their hand-off opened
    assert handoff.take_declines() == ["c"] and handoff.ids(DECLINING) == []


def test_an_id_in_use_cannot_be_reused():
    sched = decode_scheduler()
    handoff = sched.handoff
    sched.add(make_request("p", [1, 2, 3]))
    run_step(sched)
    sched.hold(sched.requests["p"])
    assert handoff.state("p") is HELD and sched.num_unfinished == 0
    with pytest.raises(HandoffError, match="held"):
        sched.add(make_remote_request("p", [1, 2, 3]))
    assert handoff.state("p") is HELD and "p" not in sched.requests


# ---- every transition from every state -------------------------------------------------
NEW = None  # no hand-off open
STATES = [NEW, HELD, OFFERED, LEASED, AWAITING, RECEIVING, ABORTING, DECLINING]
FREED = "freed"  # the hand-off ended and freed the held blocks
ENDED = "ended"  # the hand-off ended; the blocks are the scheduler's to free
FALSE = "false"  # late transport news for an unknown id: False, nothing changes

# transition -> {state it is legal in: state after it}; any other state raises.
LEGAL: dict[str, dict[HandoffState | None, object]] = {
    "hold": {NEW: HELD},
    "offer": {HELD: OFFERED},
    "offered": {OFFERED: LEASED, NEW: FALSE},
    "offer_failed": {OFFERED: FREED, NEW: FALSE},
    "lease_ended": {OFFERED: FREED, LEASED: FREED, NEW: FALSE},
    "release": {HELD: FREED, OFFERED: FREED, LEASED: FREED, NEW: FALSE},
    "expect": {NEW: AWAITING},
    "start_receiving": {AWAITING: RECEIVING},
    "received": {RECEIVING: ENDED, ABORTING: ENDED},
    "request_ended": {NEW: NEW, AWAITING: DECLINING},
    "not_needed": {AWAITING: NEW},
    "abort": {
        NEW: NEW,
        HELD: FREED,
        OFFERED: OFFERED,
        LEASED: LEASED,
        AWAITING: AWAITING,
        RECEIVING: ABORTING,
        ABORTING: ABORTING,
        DECLINING: DECLINING,
    },
}
ARGS = {"hold": ([0, 1],), "start_receiving": ([0, 1],)}
PATH = {  # how to get there from NEW
    NEW: [],
    HELD: ["hold"],
    OFFERED: ["hold", "offer"],
    LEASED: ["hold", "offer", "offered"],
    AWAITING: ["expect"],
    RECEIVING: ["expect", "start_receiving"],
    ABORTING: ["expect", "start_receiving", "abort"],
    DECLINING: ["expect", "request_ended"],
}


def in_state(state: HandoffState | None) -> tuple[KVHandoff, BlockManager]:
    """A hand-off of request "r" in ``state``, "r" owning blocks 0 and 1 (as P's held
    blocks, or as D's blocks given by the scheduler) from the start."""
    bm = BlockManager(4, BS)
    assert bm.allocate_slots("r", 0, 2 * BS) and bm.block_table("r") == [0, 1]
    handoff = KVHandoff(bm)
    for step in PATH[state]:
        getattr(handoff, step)("r", *ARGS.get(step, ()))
    assert handoff.state("r") is state
    return handoff, bm


def assert_counts(handoff: KVHandoff) -> None:
    state = handoff.state("r")
    assert handoff.num_held == (state in PREFILL_STATES)
    assert handoff.num_receiving == (state in (RECEIVING, ABORTING))


@pytest.mark.parametrize("state", STATES, ids=lambda s: getattr(s, "value", "new"))
@pytest.mark.parametrize("transition", list(LEGAL))
def test_every_transition_from_every_state(transition, state):
    handoff, bm = in_state(state)
    call = getattr(handoff, transition)
    args = ARGS.get(transition, ())
    if state not in LEGAL[transition]:
        with pytest.raises(HandoffError, match=transition):
            call("r", *args)
        assert handoff.state("r") is state and bm.block_table("r") == [0, 1]
        assert_counts(handoff)
        return
    result = call("r", *args)
    assert_counts(handoff)
    want = LEGAL[transition][state]
    if want is FREED:
        assert handoff.state("r") is None and not bm.has_request("r")
    elif want is FALSE:
        assert result is False and handoff.state("r") is None
    elif want is ENDED:
        assert handoff.state("r") is None and result is (state is ABORTING)
    else:
        assert handoff.state("r") is want
    if want is not FREED:  # only the hand-off's own (held) blocks are ever freed by it
        assert bm.block_table("r") == [0, 1]
    bm.check_integrity()
