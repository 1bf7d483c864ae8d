"""One request's life in the router, from admission to settled: one object, explicit states.

A :class:`RequestLife` owns one request from the moment the router admitted it: its
state, its inbox (``router/inbox.py``), what it holds on the workers (``Holdings``,
``router/holdings.py``: the ledger; this class decides when). The
:class:`~router.router.Router` creates it, puts into its inbox (worker events, a worker's
loss, an abort) and iterates :meth:`RequestLife.run`, the client's stream; when that
stream ends, however it ended, the router calls :meth:`RequestLife.settle`, the one
place that releases what the request holds, exactly once. Only this class changes the
state; an illegal transition raises :class:`IllegalTransition`::

    admitted ─> routed ─┬─> prefilling ─> handing_off ─> decoding
                        ├─> reserving ─> prefilling    (layer-wise: D reserves first)
                        └─> decoding                   (``full`` work on one worker)
    routed | reserving | prefilling | handing_off | decoding ─> migrating ─> routed
    any state but settling / settled ─> settling ─> settled

What each state means, and what ending the request there takes (``settle``):

=============  ===========================================  ================================
admitted       validated, admitted (a quota share), its id   nothing on the workers
               registered; not routed yet
routed         workers chosen, counting it                   they stop counting it
               (``WorkerView.routed``); nothing submitted
reserving      layer-wise: D admitted it and reserves        abort on D
               blocks for P's KV
prefilling     P computes the prompt (layer-wise: into D's   abort on P; a handle that comes
               reserved blocks)                              anyway is declined; layer-wise:
                                                             abort D's reservation too
handing_off    P's first token went out; P holds the KV      decline the handle through a D
               under a lease until D has the handle          (P frees the blocks)
decoding       D (or one worker, ``full`` work) owns it      abort on D (it stops, or declines
                                                             the transfer: P's lease ends)
migrating      its worker was lost (router/migration.py):    (already dropped)
               the lost attempt's counts dropped, its
               unread handle declined; -> routed, or
               UNAVAILABLE
settling       the client's stream ended; the worker side    -
               is ending (the owner's final event awaited)
settled        the id free, the quota back, no count left    -
=============  ===========================================  ================================

Per streamed token the router pops the inbox's deque, tells the ledger
(``Holdings.on_event``) and calls ``RequestStream.on_event``, inside :meth:`RequestLife.run`:
between a worker's event and the front end's write there are two generators, ``run`` and
``Router.generate``.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial

from msgspec.structs import replace

from router import attempt as attempts
from router import layerwise
from router.attempt import Attempt
from router.config import RouterConfig
from router.events import GenerateEvent
from router.holdings import Holdings
from router.inbox import ABORT, Inbox, Item, WorkerEvent, WorkerGone
from router.migration import WorkerLost, died, next_route
from router.peer_prefix import PeerExports
from router.policy import RouteDecision
from router.request_trace import RequestTrace
from router.routing import Routing
from router.stream import RequestStream, merge_events
from router.validation import ValidRequest
from router.workers import WorkerView, decline
from workers.protocol.wire import TokenEvent, WorkItem

logger = logging.getLogger(__name__)


class State(enum.Enum):
    ADMITTED = "admitted"
    ROUTED = "routed"
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    HANDING_OFF = "handing_off"
    DECODING = "decoding"
    MIGRATING = "migrating"
    SETTLING = "settling"
    SETTLED = "settled"


_S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    _S.ADMITTED: frozenset({_S.ROUTED, _S.SETTLING}),
    _S.ROUTED: frozenset({_S.RESERVING, _S.PREFILLING, _S.DECODING, _S.MIGRATING, _S.SETTLING}),
    _S.RESERVING: frozenset({_S.PREFILLING, _S.MIGRATING, _S.SETTLING}),
    _S.PREFILLING: frozenset({_S.HANDING_OFF, _S.MIGRATING, _S.SETTLING}),
    _S.HANDING_OFF: frozenset({_S.DECODING, _S.MIGRATING, _S.SETTLING}),
    _S.DECODING: frozenset({_S.MIGRATING, _S.SETTLING}),
    _S.MIGRATING: frozenset({_S.ROUTED, _S.SETTLING}),
    _S.SETTLING: frozenset({_S.SETTLED}),
    _S.SETTLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request's life was asked to go where its state machine does not lead (a bug)."""


@dataclass(frozen=True)
class RouterSide:
    """What every request's life uses of its router (the router's live pools and calls)."""

    config: RouterConfig
    routing: Routing
    by_name: dict[str, WorkerView]
    prefill: Sequence[WorkerView]
    decode: Sequence[WorkerView]
    peers: PeerExports | None  # peer pull (G4), router/peer_prefix.py
    spawn: Callable  # runs a coroutine in the background (the router keeps a reference)


class RequestLife:
    """One request from admission to settled (the module's table); the only writer of its
    state. The router puts into ``inbox``; ``run`` and ``settle`` read it."""

    def __init__(
        self,
        side: RouterSide,
        stream: RequestStream,
        trace: RequestTrace,
        valid: ValidRequest,
        token_ids: list[int],
        on_settled: Callable[[RequestLife], None],
        principal: str = "",
        deadline: float = math.inf,
        idle_timeout_s: float = math.inf,
    ):
        """``on_settled``: the router's release (the id, the quota, the planner's feed),
        called exactly once, by ``settle``. ``deadline``: the loop time the request must
        end by; ``idle_timeout_s``: the longest wait for a worker's next event."""
        self.side = side
        self.stream = stream
        self.trace = trace  # router/tracing.py; NO_TRACE when tracing is off
        self.valid = valid
        self.token_ids = token_ids
        self.principal = principal  # who sent it (router/auth.py); only they may abort it
        self.deadline = deadline
        self.idle_timeout_s = idle_timeout_s
        self.state = State.ADMITTED
        self.inbox = Inbox()
        self.holdings = Holdings(stream.request_id, self.inbox, trace)
        # The worker whose events the client's stream reads now (and its name).
        self._worker: WorkerView | None = None
        self._source = ""
        self.is_aborted = False
        self.num_migrations = 0
        self._on_settled = on_settled
        self._span = None  # the open attempt span (RequestTrace.open_attempt)

    def _to(self, state: State) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"{self.stream.request_id}: {self.state.value} -> {state.value}"
            )
        self.state = state

    # ---- what the router tells it -------------------------------------------------------
    def abort(self) -> bool:
        """An abort (a client's, the drain's): the stream ends with ``Finish(abort)``.
        False when its output already ended."""
        if self.stream.is_finished or self.state in (State.SETTLING, State.SETTLED):
            return False
        self.is_aborted = True
        self.inbox.put(ABORT)
        return True

    def lose(self, worker: WorkerView) -> bool:
        """``worker`` is lost (dead, or migrated away from): True when it owns the request,
        which then migrates."""
        if self.holdings.owner is not worker:
            return False
        self.inbox.put(WorkerGone(worker.name))
        return True

    # ---- the client's stream ------------------------------------------------------------
    async def run(self) -> AsyncIterator[GenerateEvent]:
        """The client's events, the last with its Finish; raises RouterError. Routes,
        submits, hands off, and migrates the request when its worker is lost."""
        stream, inbox, holdings = self.stream, self.inbox, self.holdings
        queued = inbox.queued  # tested and popped directly: the per-token path
        is_timed = self.deadline != math.inf or self.idle_timeout_s != math.inf
        try:
            attempt = self._route(self.side.routing.route(self.trace, self.valid, self.token_ids))
            while True:
                try:
                    await self._begin(attempt)
                    while True:
                        if queued:
                            item = queued.popleft()
                        elif is_timed:
                            item = await inbox.get_within(self.deadline, self.idle_timeout_s)
                        else:
                            item = await inbox.get()
                        if type(item) is WorkerEvent:
                            event = item.event
                            if item.worker != self._source:  # a worker the request left
                                if event.spans:
                                    self.trace.worker_spans(event.spans)
                                continue
                            holdings.on_event(self._worker, event)  # raises if it failed
                            if event.kv_reservations:  # layer-wise: D reserved; now P
                                await self._prefill_into(attempt, event.kv_reservations)
                                continue
                            if event.kv_handles or event.kv_streamed:  # P's first token
                                out = self._handed_off(event)
                                if out is not None:
                                    yield out
                                if self.is_aborted and not stream.is_finished:
                                    yield stream.abort_event()
                                if stream.is_finished:
                                    return  # a stop string on the first token, or an abort
                                await self._decode_after(attempt, event)
                                continue
                            out = stream.on_event(event)
                            # Events that queued behind this one while the client's stream
                            # was busy (a router under load) go out with it as one chunk:
                            # the front end's encoding then runs once per chunk, not once
                            # per token (vLLM's output collector merges the same way). Idle,
                            # nothing is queued: one chunk per engine step.
                            if (
                                queued
                                and not stream.is_finished
                                and _is_plain(queued[0], self._source)
                            ):
                                out = self._merge_queued(out)
                            if out is not None:
                                yield out
                            if stream.is_finished:
                                return
                        elif type(item) is WorkerGone:
                            if item.worker == self._source:  # the request's worker died
                                view = self._worker
                                role, error = view.client.role, view.error or "gone"
                                raise WorkerLost(view.name, died(role), error)
                        elif self.is_aborted:  # ABORT
                            yield stream.abort_event()
                            return
                except WorkerLost as lost:
                    migrated = await self._migrate(lost)
                    if migrated is None:  # aborted meanwhile
                        yield stream.abort_event()
                        return
                    attempt = migrated
        except BaseException as exc:
            self._close_span(exc)
            raise
        finally:
            self._close_span()

    def _route(self, decision: RouteDecision) -> Attempt:
        """admitted / migrating -> routed: the attempt, counted on its workers."""
        self._to(State.ROUTED)
        stream = self.stream
        attempt = attempts.plan(
            decision,
            self.side.by_name,
            stream.request_id,
            self.valid,
            self.token_ids,
            stream.output_token_ids,
        )
        self.holdings.counted(attempts.expect(attempt, self.side.config.block_size), attempt.decode)
        stream.stamps.decode_worker = attempt.decode.name
        return attempt

    async def _begin(self, attempt: Attempt) -> None:
        """routed -> the attempt's first work submitted: reserving, prefilling or decoding."""
        if attempt.prefill is None:
            self._to(State.DECODING)
            await self._submit(attempt.decode, attempt.item, with_peer_prefix=True)
        elif attempt.is_layerwise:
            self._to(State.RESERVING)
            reserve = layerwise.reserve_item(attempt.item, attempt.prefill)
            await self._submit(attempt.decode, reserve, span="reserve")
        else:
            self._to(State.PREFILLING)
            self.stream.stamps.prefill_worker = attempt.prefill.name
            item = attempts.prefill_item(attempt)
            await self._submit(attempt.prefill, item, with_peer_prefix=True)

    async def _prefill_into(self, attempt: Attempt, reservations: tuple[bytes, ...]) -> None:
        """reserving -> prefilling (layer-wise): P computes into D's reserved blocks."""
        assert attempt.prefill is not None
        self._to(State.PREFILLING)
        self.holdings.reserved = attempt.decode
        self.stream.stamps.prefill_worker = attempt.prefill.name
        work = layerwise.streaming_prefill_item(attempt.item, reservations)
        await self._submit(attempt.prefill, work)

    def _handed_off(self, event: TokenEvent) -> GenerateEvent | None:
        """prefilling -> handing_off: P's first token (with its handle, or layer-wise
        streamed into D's blocks) goes to the client at once."""
        self._to(State.HANDING_OFF)
        self._close_span()
        if event.kv_handles:
            # P holds the KV under a lease until a decode worker's notice or expiry; until
            # D has the handle, ending the request means declining it (``settle``).
            self.holdings.unread_handles = event.kv_handles
        first = replace(event, finished=False, kv_handles=(), kv_streamed=False)
        return self.stream.on_event(first)

    async def _decode_after(self, attempt: Attempt, first: TokenEvent) -> None:
        """handing_off -> decoding: D gets the first token (and P's handle), and streams."""
        if first.kv_streamed:
            assert attempt.prefill is not None
            self.holdings.reserved = None  # the owner from here on: aborted as such
            work = layerwise.streamed_decode_item(attempt.item, attempt.prefill, first)
        else:
            work = attempts.decode_item(attempt, first)
        await self._submit(attempt.decode, work)
        self._to(State.DECODING)

    async def _submit(
        self, worker: WorkerView, item: WorkItem, *, span: str = "", with_peer_prefix=False
    ) -> None:
        """Send ``item`` to ``worker``, whose events the stream reads from now on, under
        an attempt span of its own; WorkerLost when it cannot take it."""
        self._close_span()
        self._span, parent = self.trace.open_attempt(span or item.mode, worker.name)
        item = replace(item, traceparent=parent)
        if with_peer_prefix:
            side = self.side
            workers = [*side.prefill, *side.decode]
            item = await attempts.with_peer_prefix(side.peers, item, worker, workers, side.config)
            self.holdings.unread_handles = item.kv_handles  # declined if the submit fails
        self._worker, self._source = worker, worker.name
        stamps = self.stream.stamps
        if not stamps.submitted:
            stamps.submitted = time.monotonic()
        await self.holdings.submit(worker, item)

    def _merge_queued(self, out: GenerateEvent | None) -> GenerateEvent | None:
        """``out`` and the plain events queued behind it, as one client event."""
        stream, queued = self.stream, self.inbox.queued
        worker = self._worker
        outs = [out] if out is not None else []
        while queued and not stream.is_finished and _is_plain(queued[0], self._source):
            event = queued.popleft().event  # type: ignore[union-attr]
            self.holdings.on_event(worker, event)
            if (more := stream.on_event(event)) is not None:
                outs.append(more)
        return merge_events(outs) if outs else None

    def _close_span(self, exc: BaseException | None = None) -> None:
        if self._span is not None:
            self.trace.close_attempt(self._span, exc)
            self._span = None

    # ---- a lost worker ------------------------------------------------------------------
    async def _migrate(self, lost: WorkerLost) -> Attempt | None:
        """-> migrating: drop the lost attempt, then where the request continues (-> routed);
        None if it was aborted meanwhile. Raises UNAVAILABLE past ``router.migration_limit``
        or with nowhere to go (router/migration.py)."""
        self._close_span(lost)
        self._to(State.MIGRATING)
        side, stream, holdings = self.side, self.stream, self.holdings
        await holdings.release_reservation()  # layer-wise, P lost: D's reservation first
        # The items still queued from the lost attempt (a dead worker's failed event is
        # followed by its death notice) are dropped, an abort kept in ``is_aborted``.
        self._worker, self._source = None, ""
        self.inbox.clear()
        if handles := holdings.forget_attempt():  # P's KV no decode worker will read now
            side.spawn(decline(handles, None, side.decode))
        self.num_migrations += 1
        route_again = partial(side.routing.route, self.trace, self.valid)
        args = (self.num_migrations, side.config, route_again, self.token_ids)
        decision = next_route(lost, *args, stream, self.trace, self.is_aborted)
        if decision is None:
            return None
        return self._route(decision)

    # ---- the end ------------------------------------------------------------------------
    def settle(self, is_cut_short: bool) -> Coroutine[None, None, None]:
        """The client's stream ended, whatever ended it (its Finish, an abort, the client
        gone, a deadline, an error, the drain; ``is_cut_short``: ``run`` did not reach its
        end): -> settling now; the returned coroutine (the router runs it in the
        background) ends the worker side (``Holdings.end_on_workers``: a handle declined,
        a reservation and the owner aborted, the owner's final event awaited), drops every
        count, calls the router's ``on_settled`` and goes -> settled. Exactly once: a
        second call raises IllegalTransition."""
        self._to(State.SETTLING)
        if is_cut_short:  # cancelled, deadline, or an error: stop it on the worker
            self.is_aborted = True
            self.trace.event("abort")
        return self._settle(self.is_aborted or self.stream.is_finished)

    async def _settle(self, must_abort: bool) -> None:
        try:
            await self.holdings.end_on_workers(must_abort, self.side.decode)
        finally:
            self.holdings.release()
            self._to(State.SETTLED)
            self._on_settled(self)


def _is_plain(item: Item | None, worker: str) -> bool:
    """Whether a queued item is a token event of ``worker`` that needs nothing but the
    stream (no hand-off, no failure): one that can join the chunk being sent."""
    if type(item) is not WorkerEvent or item.worker != worker:
        return False
    event = item.event
    return not (event.error or event.kv_handles or event.kv_streamed or event.kv_reservations)
