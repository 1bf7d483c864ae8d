"""One try at a request on the workers a route chose: submit, hand the KV off, stream.

``Router`` decides where a request goes (``router/routing.py``) and what happens when a
worker is lost (a migration: ``router/migration.py``); an :class:`Attempts` runs one
decision: it counts the request against its workers, submits ``prefill`` work and, when the
prefill worker's handle event comes, ``decode`` work with the handles (or ``full`` work to
one worker), streaming the client's events as they come; a long prompt may go layer-wise
instead (decode worker first: ``router/layerwise.py``). Who must be told when the
request ends early is ``Pending``'s (``router/pending.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from msgspec.structs import replace

from router.config import RouterConfig
from router.events import GenerateEvent
from router.layerwise import goes_layerwise, run_layerwise
from router.peer_prefix import PeerExports
from router.pending import Pending
from router.policy import RouteDecision
from router.validation import ValidRequest
from router.workers import Expected, WorkerView
from workers.protocol.wire import WorkItem


class Attempts:
    """Runs route decisions on the router's pools (its live lists and name index)."""

    def __init__(
        self,
        config: RouterConfig,
        by_name: dict[str, WorkerView],
        prefill: Sequence[WorkerView],
        decode: Sequence[WorkerView],
        peers: PeerExports | None,
    ):
        self.config = config
        self.by_name = by_name
        self.prefill = prefill
        self.decode = decode
        self.peers = peers  # peer pull (G4), router/peer_prefix.py

    async def run(
        self, pending: Pending, valid: ValidRequest, token_ids: list[int], decision: RouteDecision
    ) -> AsyncIterator[GenerateEvent]:
        """One try at the request on the workers ``decision`` chose, after the output the
        client already has (a migration's)."""
        stream = pending.stream
        outputs = tuple(stream.output_token_ids)
        decode = pending.decode = self.by_name[decision.decode]
        prefill = self.by_name[decision.prefill] if decision.prefill is not None else None
        num_tokens = len(token_ids) + len(outputs)
        self._expect(pending, num_tokens, decision.cached_tokens, decode, prefill)
        stream.stamps.decode_worker = decode.name
        params = valid.params
        if outputs and params.prompt_logprobs is not None:
            # Resumed after output went out: its prompt logprobs went with the first token.
            params = dataclasses.replace(params, prompt_logprobs=None)
        item = WorkItem(stream.request_id, tuple(token_ids), params, "full")
        if outputs:
            item = replace(item, output_token_ids=outputs)
        trace = pending.trace
        uncached = len(token_ids) - decision.cached_tokens
        if prefill is not None and goes_layerwise(prefill, item, uncached):
            async for out in run_layerwise(pending, item, prefill, decode):
                yield out
            return
        if prefill is not None:
            stream.stamps.prefill_worker = prefill.name
            handle_event = None
            with trace.attempt("prefill", prefill.name) as parent:
                prefill_item = replace(item, mode="prefill", traceparent=parent)
                prefill_item = await self._peer_prefix(pending, prefill_item, prefill)
                async for out, event in pending.stream_from(prefill, prefill_item):
                    if event is not None and event.kv_handles:
                        handle_event = event
                        break
                    if out is not None:
                        yield out
            if handle_event is None:
                return  # ended on the prefill worker (first token was the last, or abort)
            # P holds the KV under a lease until a decode worker's notice or expiry; until
            # D has the handle, ending the request means declining it (see Pending.settle).
            pending.unread_handles = handle_event.kv_handles
            first = replace(handle_event, finished=False, kv_handles=())
            out = stream.on_event(first)
            if out is not None:
                yield out
            if pending.is_aborted and not stream.is_finished:
                yield stream.abort_event()
            if stream.is_finished:
                return  # a stop string on the first token, or an abort
            item = replace(
                item,
                mode="decode",
                kv_handles=handle_event.kv_handles,
                first_token_id=handle_event.token_ids[0],
            )
        else:
            item = await self._peer_prefix(pending, item, decode)
        with trace.attempt(item.mode, decode.name) as parent:
            item = replace(item, traceparent=parent)
            async for out, _event in pending.stream_from(decode, item):
                if out is not None:
                    yield out

    async def _peer_prefix(self, pending: Pending, item: WorkItem, target: WorkerView) -> WorkItem:
        """Peer pull (G4): ``item`` with a peer's handles on its prompt's first blocks, when
        another worker holds enough more of it than ``target`` (router/peer_prefix.py)."""
        if self.peers is None or item.params.prompt_logprobs is not None:
            return item  # prompt logprobs: every prompt position is computed by the worker
        cfg = self.config
        workers = [*self.prefill, *self.decode]
        item = await self.peers.attach(item, target, workers, cfg.block_size, cfg.peer_min_blocks)
        pending.unread_handles = item.kv_handles  # declined if the submit fails
        return item

    def _expect(
        self,
        pending: Pending,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        decode: WorkerView,
        prefill: WorkerView | None,
    ) -> None:
        """Count the request against its workers from now on, before either has it: the
        next request of a burst must see it (Pending.settle drops it on every end path)."""
        request_id = pending.stream.request_id
        num_blocks = -(-num_prompt_tokens // self.config.block_size)
        uncached = num_prompt_tokens - num_cached_tokens
        if prefill is not None:
            prefill.expect(request_id, Expected(uncached, num_blocks))
            pending.routed.append(prefill)
        # A decode worker fed by a prefill worker receives the prompt's blocks; it computes
        # none of them.
        decode.expect(request_id, Expected(0 if prefill else uncached, num_blocks))
        pending.routed.append(decode)
