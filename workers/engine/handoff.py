"""A request's KV hand-off from a prefill worker (P) to a decode worker (D), as one state
machine per request: the one place that decides who frees the hand-off's blocks, and when.

Prefill side (the request left the scheduler after its first token; its blocks keep
the prompt's KV)::

    HELD --offer--> OFFERED --offered--> LEASED --lease_ended--> (released: blocks freed)
      |                |
      |                +--offer_failed / lease_ended--> (released: blocks freed)
      +--abort / release--> (released: blocks freed; no lease exists yet)

Prefill side of a layer-wise stream (``stream_opened`` before the first chunk: the
request's writes read its blocks while it computes; ``kvtransfer/stream.py``)::

    (scheduled) --hold--> HELD --stream_ended--> (released: blocks freed)
         |                 +--abort--> HELD (kept: writes may be in flight)
         +--finish / abort (keeps_blocks)--> STREAMING --stream_ended--> (released)

Decode side (the request was admitted with P's handles; its prompt's KV comes from P,
except the leading blocks D's own prefix cache already holds: those are shared, never
written, and only the rest is received, ``KVReceive.first_block``). A peer pull (G4) is
the same on the worker that pulls: a request whose prompt's first blocks come from
another worker's lease, the rest computed here after the receive::

    AWAITING --start_receiving--> RECEIVING --received--> (received: the request runs on)
       |                              |
       |                              +--abort--> ABORTING --received--> (released)
       +--request_ended--> DECLINING --take_declines--> (released)
       +--not_needed--> (no hand-off: a peer prefix its own cache covers; declined)

Who frees what (docs/serving.md, "Ending early", has the router's side of each row):

=====================  ====================================  ================================
moment                 prefill (P)                           decode (D)
=====================  ====================================  ================================
finish: D received     D's ``done`` notice ends the lease:   ``received``: RECEIVING -> over;
the KV                 ``lease_ended`` frees (LEASED ->      the blocks are the request's;
                       released)                             ``Scheduler.finish`` frees them
abort before the       ``abort`` leaves OFFERED / LEASED     --
handle reached D       alone (D may be reading); the router
                       declines the handle through a D,
                       whose notice ends the lease
                       (``lease_ended`` frees). A HELD one
                       (no offer yet) is freed at once
abort on D before its  the decline's notice ends the lease   no blocks yet: AWAITING ->
receive started        (``lease_ended`` frees)               DECLINING; the worker declines
                                                             the handles (``take_declines``)
abort on D while       D's ``aborted`` notice ends the       RECEIVING -> ABORTING: blocks
receiving              lease (``lease_ended`` frees)         kept until the transfer ended;
                                                             ``received``, then
                                                             ``Scheduler.finish`` frees them
transfer fails         D's ``failed`` notice (or expiry)     ``received``: recomputed into
                       ends the lease (``lease_ended``       the same blocks (or aborted
                       frees)                                first: ABORTING, then freed)
offer fails on a rank  ``offer_failed`` frees at once: no    --
                       handle went out
lease expiry (D died,  ``lease_ended`` frees                 --
never read it)
decline (nothing will  its notice ends the lease             --
read it)               (``lease_ended`` frees)
layer-wise: the        HELD; ``stream_ended`` frees once     --  (D's stream future completes
stream's future        the stream's future completed (no     once every layer landed, or
completes              write in flight)                      fails: recomputed as above)
layer-wise: first      ``keeps_blocks``: -> STREAMING, not   D's stream fails or completes;
token ends it, or      freed by the scheduler;               the router aborts D (never
abort while it         ``abandon_stream``, then              given a first token)
computes               ``stream_ended`` frees
layer-wise:            never preempted (the scheduler skips  --
preemption             it: its blocks are being read)
=====================  ====================================  ================================

P's held blocks belong to no scheduled request, so the hand-off frees them itself
(``BlockManager.free``; full prompt blocks stay in the prefix cache). D's blocks belong
to a request in the scheduler, which frees them when the request ends; the hand-off
only refuses to let it end while a transfer may still write into them.

Transitions are methods; a wrong state raises ``HandoffError`` and changes nothing.
Transport news (``offered``, ``offer_failed``, ``lease_ended``) and ``release`` return
False for a request with no open hand-off (late news is harmless); ``abort`` and
``request_ended`` take any id. ``release`` (an in-process hand-off that needs no lease)
frees in any prefill state. Pure Python: the engine loop's thread owns it, like the
block manager.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.block_manager import BlockManager


class HandoffState(enum.Enum):
    # Prefill side: the blocks keep the prompt's KV, out of scheduling.
    HELD = "held"  # no lease yet
    OFFERED = "offered"  # a lease is being put on every rank of the replica
    LEASED = "leased"  # the handles went out: a decode worker may read the blocks
    # Decode side: the prompt's KV comes from a prefill worker.
    AWAITING = "awaiting"  # waiting in the queue for blocks
    RECEIVING = "receiving"  # fresh blocks given; a transfer may be writing into them
    ABORTING = "aborting"  # aborted while receiving: the blocks stay until the transfer ended
    DECLINING = "declining"  # ended before its receive started: the handles must be declined
    # Prefill side, layer-wise: ended (first token was its last, abort) while its stream's
    # writes may still read its blocks; freed by ``stream_ended``.
    STREAMING = "streaming"


PREFILL_STATES = (
    HandoffState.HELD,
    HandoffState.OFFERED,
    HandoffState.LEASED,
    HandoffState.STREAMING,
)
_RECEIVING_STATES = (HandoffState.RECEIVING, HandoffState.ABORTING)


class HandoffError(ValueError):
    """A transition that is not allowed in the request's current hand-off state."""


@dataclass(frozen=True)
class KVReceive:
    """A receive the worker must start: P's prompt blocks from ``first_block`` on go into
    ``block_ids`` (D's fresh blocks, in order). The request's blocks before them are D's
    own prefix-cache hits, shared with other requests: the transfer never touches them."""

    request_id: str
    block_ids: tuple[int, ...]
    first_block: int = 0  # prompt blocks D holds already (0: receive the whole prompt)


def check_peer_prefix(
    num_tokens: int, num_prompt_tokens: int, block_size: int, remote_first_token: int | None
) -> None:
    """A peer prefix (``LLMEngine.add_request(peer_prefix_tokens=...)``) is whole blocks
    of the prompt, leaving at least one token to compute here; ValueError otherwise."""
    if not num_tokens:
        return
    if remote_first_token is not None:
        raise ValueError("peer_prefix_tokens and remote_first_token exclude each other")
    if num_tokens < 0 or num_tokens % block_size or num_tokens >= num_prompt_tokens:
        raise ValueError(
            f"peer_prefix_tokens: {num_tokens} is not whole blocks of {block_size} tokens "
            f"shorter than the prompt ({num_prompt_tokens} tokens)"
        )


class KVHandoff:
    def __init__(self, block_manager: BlockManager):
        self._block_manager = block_manager
        self._states: dict[str, HandoffState] = {}  # open hand-offs only
        self._counts: Counter[HandoffState] = Counter()  # of _states' values (reports, steps)
        self._held_block_ids: dict[str, tuple[int, ...]] = {}  # prefill side
        # Decode side, for the worker to take: receives to start, handles to decline.
        self._new_receives: list[KVReceive] = []
        # Decode side, since start: prompt blocks to receive, and those D held already.
        self.num_receive_blocks = 0  # asked of P (a failed receive included)
        self.num_reused_blocks = 0  # found in D's own prefix cache instead
        self._new_declines: list[str] = []
        # Prefill, layer-wise: requests whose stream's writes may read their blocks.
        self._streams: set[str] = set()

    # ---- queries -----------------------------------------------------------------------
    def state(self, request_id: str) -> HandoffState | None:
        """The request's hand-off state; None when it has none open (any more)."""
        return self._states.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def ids(self, *states: HandoffState) -> list[str]:
        """Ids in any of ``states``, in the order their hand-off opened."""
        return [rid for rid, state in self._states.items() if state in states]

    def is_held(self, request_id: str) -> bool:
        """Prefill: the request's blocks keep its prompt's KV (held, offered or leased)."""
        return self._states.get(request_id) in PREFILL_STATES

    @property
    def num_held(self) -> int:
        return sum(self._counts[state] for state in PREFILL_STATES)

    @property
    def num_receiving(self) -> int:
        """Decode: requests with blocks a transfer may write into (receiving or aborting)."""
        return sum(self._counts[state] for state in _RECEIVING_STATES)

    # ---- prefill side ------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Iterable[int]) -> None:
        """The scheduler hands over a request whose prompt is computed: its blocks are
        the hand-off's from now on (-> HELD)."""
        self._move(request_id, "hold", (None,), HandoffState.HELD)
        self._held_block_ids[request_id] = tuple(block_ids)

    def held_block_ids(self, request_id: str) -> tuple[int, ...]:
        if not self.is_held(request_id):
            raise HandoffError(f"{request_id!r} is not held")
        return self._held_block_ids[request_id]

    def offer(self, request_id: str) -> tuple[int, ...]:
        """The worker puts the held blocks under a lease (HELD -> OFFERED); returns them."""
        self._move(request_id, "offer", (HandoffState.HELD,), HandoffState.OFFERED)
        return self._held_block_ids[request_id]

    def offered(self, request_id: str) -> bool:
        """Every rank has its lease; the handles go out (OFFERED -> LEASED)."""
        if request_id not in self._states:
            return False
        self._move(request_id, "offered", (HandoffState.OFFERED,), HandoffState.LEASED)
        return True

    def offer_failed(self, request_id: str) -> bool:
        """Some rank could not offer: no handle went out, so the blocks are freed now."""
        if request_id not in self._states:
            return False
        self._check(request_id, "offer_failed", (HandoffState.OFFERED,))
        self._free_held(request_id)
        return True

    def lease_ended(self, request_id: str) -> bool:
        """The lease ended on every rank (a decode worker's notice, a decline's, expiry or
        shutdown): nothing reads the blocks any more; they are freed."""
        if request_id not in self._states:
            return False
        self._check(request_id, "lease_ended", (HandoffState.OFFERED, HandoffState.LEASED))
        self._free_held(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """The caller knows nothing reads the blocks (an in-process hand-off that copied
        them, or gave up): free them in any prefill state. False for an unknown id."""
        if request_id not in self._states:
            return False
        self._check(request_id, "release", PREFILL_STATES)
        self._streams.discard(request_id)
        self._free_held(request_id)
        return True

    # ---- prefill side, layer-wise ------------------------------------------------------
    def stream_opened(self, request_id: str) -> None:
        """The request's KV streams out as it is computed: its blocks are read by writes
        until ``stream_ended`` (never freed before, never preempted)."""
        self._streams.add(request_id)

    def is_streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    def keeps_blocks(self, request_id: str, block_ids: Iterable[int]) -> bool:
        """The scheduler ends a request (first token was its last, abort): True when the
        hand-off keeps its blocks instead (a stream still reads them: -> STREAMING)."""
        if request_id not in self._streams or request_id in self._states:
            return False
        self._set(request_id, HandoffState.STREAMING)
        self._held_block_ids[request_id] = tuple(block_ids)
        return True

    def stream_ended(self, request_id: str) -> bool:
        """The stream's future completed: no write reads the blocks any more. A request
        the scheduler no longer has (HELD, STREAMING) has its blocks freed now (True); one
        still computing keeps them (its stream failed early; it goes on unstreamed)."""
        self._streams.discard(request_id)
        if self._states.get(request_id) in (HandoffState.HELD, HandoffState.STREAMING):
            self._free_held(request_id)
            return True
        return False

    # ---- decode side -------------------------------------------------------------------
    def expect(self, request_id: str) -> None:
        """The scheduler admitted a request whose prompt's KV comes from a prefill worker
        (-> AWAITING blocks)."""
        self._move(request_id, "expect", (None,), HandoffState.AWAITING)

    def start_receiving(
        self, request_id: str, block_ids: Iterable[int], first_block: int = 0
    ) -> None:
        """The scheduler gave the request fresh blocks for its prompt from block
        ``first_block`` on (the ones before are its own prefix-cache hits) (AWAITING ->
        RECEIVING); the worker takes them from ``take_receives``."""
        if first_block < 0:
            raise HandoffError(f"first_block must be >= 0, got {first_block}")
        block_ids = tuple(block_ids)
        if not block_ids:
            raise HandoffError(f"start_receiving of {request_id!r}: no block to receive")
        self._move(request_id, "start_receiving", (HandoffState.AWAITING,), HandoffState.RECEIVING)
        self._new_receives.append(KVReceive(request_id, block_ids, first_block))
        self.num_receive_blocks += len(block_ids)
        self.num_reused_blocks += first_block

    def not_needed(self, request_id: str) -> None:
        """A peer prefix (G4) the worker's own cache covers by now: nothing will be read,
        the handles are declined (``take_declines``) and the request is admitted as any
        other (AWAITING -> no hand-off)."""
        self._check(request_id, "not_needed", (HandoffState.AWAITING,))
        self._drop(request_id)
        self._new_declines.append(request_id)

    def take_receives(self) -> list[KVReceive]:
        """The receives started since the last call: the worker transfers P's prompt blocks
        from ``first_block`` on into exactly ``block_ids``, then reports ``received``."""
        receives, self._new_receives = self._new_receives, []
        return receives

    def received(self, request_id: str) -> bool:
        """The transfer into the request's blocks has ended, well or not: nothing writes
        them any more and the hand-off is over. True if it was aborted meanwhile: the
        caller finishes the request now (which frees the blocks)."""
        state = self._check(request_id, "received", _RECEIVING_STATES)
        self._drop(request_id)
        return state is HandoffState.ABORTING

    def request_ended(self, request_id: str) -> None:
        """The scheduler ends a request (its blocks are freed). One still AWAITING blocks
        never got to read P's: its handles must be declined (-> DECLINING). Not allowed
        while a transfer may write its blocks; no-op for a request without a hand-off."""
        if request_id in self._states:
            self._move(
                request_id, "request_ended", (HandoffState.AWAITING,), HandoffState.DECLINING
            )
            self._new_declines.append(request_id)

    def take_declines(self) -> list[str]:
        """Ids whose handles the worker must decline now, so that P frees its blocks at
        once instead of at lease expiry; their hand-off is over."""
        declines, self._new_declines = self._new_declines, []
        for request_id in declines:
            if request_id in self._states:  # not_needed dropped its state already
                self._drop(request_id)
        return declines

    # ---- either side -------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Abort as far as the hand-off is concerned; True when it has dealt with it (the
        caller must not finish the request now):

        - HELD (prefill, no lease yet): the blocks are freed now, unless a stream's
          writes may read them (``stream_ended`` frees them then);
        - OFFERED / LEASED / STREAMING (prefill): nothing changes; only the lease's (the
          stream's) end frees them;
        - RECEIVING / ABORTING (decode): -> ABORTING; ``received`` ends it;
        - DECLINING (decode): nothing; it has ended already.

        False for AWAITING (the caller finishes it: ``request_ended``) or no hand-off."""
        state = self._states.get(request_id)
        if state is HandoffState.HELD and request_id not in self._streams:
            self._free_held(request_id)
        elif state in _RECEIVING_STATES:
            self._set(request_id, HandoffState.ABORTING)
        return state is not None and state is not HandoffState.AWAITING

    # ---- internals ---------------------------------------------------------------------
    def _check(
        self, request_id: str, event: str, allowed: tuple[HandoffState | None, ...]
    ) -> HandoffState | None:
        state = self._states.get(request_id)
        if state not in allowed:
            now = state.value if state is not None else "without a hand-off"
            wanted = " or ".join(s.value if s is not None else "new" for s in allowed)
            raise HandoffError(f"{event} of {request_id!r}: it is {now}, not {wanted}")
        return state

    def _move(
        self,
        request_id: str,
        event: str,
        allowed: tuple[HandoffState | None, ...],
        to: HandoffState,
    ) -> None:
        self._check(request_id, event, allowed)
        self._set(request_id, to)

    def _set(self, request_id: str, state: HandoffState) -> None:
        old = self._states.get(request_id)
        if old is not None:
            self._counts[old] -= 1
        self._states[request_id] = state
        self._counts[state] += 1

    def _drop(self, request_id: str) -> None:
        self._counts[self._states.pop(request_id)] -= 1

    def _free_held(self, request_id: str) -> None:
        self._drop(request_id)
        del self._held_block_ids[request_id]
        # Full prompt blocks stay in the prefix cache (hashed) for later requests.
        self._block_manager.free(request_id)
