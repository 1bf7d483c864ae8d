"""One try at a request with the layer-wise KV hand-off (docs/kvtransfer.md).

The whole-request hand-off runs the prefill worker first and gives the decode worker
its handles after. Streaming the KV layer group by layer group as the prefill computes
needs blocks on the decode worker *before*, so the order turns round:

1. the decode worker admits the request (``WorkItem.kv_stream_from``: the prefill
   worker's name) and answers, once its engine gave it blocks, with the reservation
   (``TokenEvent.kv_reservations``);
2. the prefill worker gets the request with it (``WorkItem.kv_reservations``), writes
   the KV into those blocks as it computes, and answers with the first token
   (``TokenEvent.kv_streamed``), streamed to the client at once;
3. the decode worker gets that token (the same id again, with ``first_token_id``) and
   decodes once every layer landed (or recomputes, if the stream failed).

Which requests: those whose uncached prompt is at least the prefill worker's reported
``layerwise_min_tokens`` (its own measured numbers, ``workers/serving/layerwise_stats.py``;
0 = none, e.g. ``kv_transfer.layerwise: off``). A request resuming after output (a
migration) takes the whole-request path.

Ending early: until step 3, the decode worker holds a reservation for the request
(``Pending.reserved``): ``Pending.settle`` and a migration abort it there; the prefill
worker stops its stream on abort, and the decode side hears "failed".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from msgspec.structs import replace

from router.events import GenerateEvent
from router.migration import WorkerLost
from router.pending import SETTLE_TIMEOUT_S, Pending
from router.workers import WorkerView, abort_on
from workers.protocol.wire import TokenEvent, WorkItem


def goes_layerwise(prefill: WorkerView, item: WorkItem, num_uncached: int) -> bool:
    """Whether this try streams the KV layer-wise (the prefill worker's threshold)."""
    report = prefill.report
    threshold = report.layerwise_min_tokens if report is not None else 0
    return threshold > 0 and num_uncached >= threshold and not item.output_token_ids


async def run_layerwise(
    pending: Pending, item: WorkItem, prefill: WorkerView, decode: WorkerView
) -> AsyncIterator[GenerateEvent]:
    """Steps 1 to 3 above for ``item`` (its ``full`` work item)."""
    stream, trace = pending.stream, pending.trace
    reservations: tuple[bytes, ...] = ()
    with trace.attempt("reserve", decode.name) as parent:
        reserve = replace(item, mode="decode", kv_stream_from=prefill.name, traceparent=parent)
        async for out, event in pending.stream_from(decode, reserve):
            if event is not None and event.kv_reservations:
                reservations = event.kv_reservations
                break
            if out is not None:
                yield out
    if not reservations:
        return  # ended on the decode worker (an abort)
    pending.reserved = decode
    stream.stamps.prefill_worker = prefill.name
    first: TokenEvent | None = None
    try:
        with trace.attempt("prefill", prefill.name) as parent:
            work = replace(item, mode="prefill", kv_reservations=reservations, traceparent=parent)
            async for out, event in pending.stream_from(prefill, work):
                if event is not None and event.kv_streamed:
                    first = event
                    break
                if out is not None:
                    yield out
    except WorkerLost:
        await release(pending, decode)  # before the next try, which may go there again
        raise
    if first is None:
        return  # ended on the prefill worker (its first token was the last, or an abort)
    out = stream.on_event(replace(first, finished=False, kv_streamed=False))
    if out is not None:
        yield out
    if pending.is_aborted and not stream.is_finished:
        yield stream.abort_event()
    if stream.is_finished:
        return  # a stop string on the first token, or an abort: settle aborts the decode
    with trace.attempt("decode", decode.name) as parent:
        work = replace(
            item,
            mode="decode",
            kv_stream_from=prefill.name,
            first_token_id=first.token_ids[0],
            traceparent=parent,
        )
        pending.reserved = None  # the owner from here on: aborted as such
        async for out, _event in pending.stream_from(decode, work):
            if out is not None:
                yield out


async def release(pending: Pending, decode: WorkerView) -> None:
    """The try failed after the decode worker reserved (a lost prefill worker): abort the
    reservation there and wait (up to ``SETTLE_TIMEOUT_S``) for its end, so that the
    request's id is free there for the next try."""
    request_id = pending.stream.request_id
    pending.reserved = None
    await abort_on(decode, request_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while decode.is_alive and request_id in decode.active:
        try:
            source, event = await asyncio.wait_for(
                pending.events.get(), max(deadline - loop.time(), 0.0)
            )
        except asyncio.TimeoutError:
            return
        if source == decode.name and event is not None and event.finished:
            decode.end(request_id)
