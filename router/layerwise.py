"""One try at a request with the layer-wise KV hand-off (docs/kvtransfer.md): which
requests, and the work items of its three steps.

The whole-request hand-off runs the prefill worker first and gives the decode worker
its handles after. Streaming the KV layer group by layer group as the prefill computes
needs blocks on the decode worker *before*, so the order turns round (the request's
states: ``reserving`` -> ``prefilling`` -> ``handing_off`` -> ``decoding``,
``router/lifecycle.py``):

1. the decode worker admits the request (``WorkItem.kv_stream_from``: the prefill
   worker's name) and answers, once its engine gave it blocks, with the reservation
   (``TokenEvent.kv_reservations``): :func:`reserve_item`;
2. the prefill worker gets the request with it (``WorkItem.kv_reservations``), writes
   the KV into those blocks as it computes, and answers with the first token
   (``TokenEvent.kv_streamed``), streamed to the client at once: :func:`streaming_prefill_item`;
3. the decode worker gets that token (the same id again, with ``first_token_id``) and
   decodes once every layer landed (or recomputes, if the stream failed):
   :func:`streamed_decode_item`.

Which requests: those whose uncached prompt is at least the prefill worker's reported
``layerwise_min_tokens`` (its own measured numbers, ``workers/serving/layerwise_stats.py``;
0 = none, e.g. ``kv_transfer.layerwise: off``). A request resuming after output (a
migration) takes the whole-request path.

Ending early: until step 3, the decode worker holds a reservation for the request
(``RequestLife.reserved``): the request's settle aborts it there, and a lost prefill
worker's migration aborts it and waits for its end first (the next try may go there
again); the prefill worker stops its stream on abort, and the decode side hears "failed".
"""

from __future__ import annotations

from msgspec.structs import replace

from router.workers import WorkerView
from workers.protocol.wire import TokenEvent, WorkItem


def goes_layerwise(prefill: WorkerView, item: WorkItem, num_uncached: int) -> bool:
    """Whether this try streams the KV layer-wise (the prefill worker's threshold)."""
    report = prefill.report
    threshold = report.layerwise_min_tokens if report is not None else 0
    return threshold > 0 and num_uncached >= threshold and not item.output_token_ids


def reserve_item(item: WorkItem, prefill: WorkerView) -> WorkItem:
    """Step 1, to the decode worker: reserve blocks for what ``prefill`` will stream."""
    return replace(item, mode="decode", kv_stream_from=prefill.name)


def streaming_prefill_item(item: WorkItem, reservations: tuple[bytes, ...]) -> WorkItem:
    """Step 2, to the prefill worker: compute, writing the KV into the reservations."""
    return replace(item, mode="prefill", kv_reservations=reservations)


def streamed_decode_item(item: WorkItem, prefill: WorkerView, first: TokenEvent) -> WorkItem:
    """Step 3, to the decode worker again: the first token; decode once the KV landed."""
    return replace(
        item, mode="decode", kv_stream_from=prefill.name, first_token_id=first.token_ids[0]
    )
