"""One try at a request on the workers a route chose: who, and the work items each gets.

Pure: a :class:`~router.policy.RouteDecision` and the request in, an :class:`Attempt` out
(no I/O, no state of its own). The request's :class:`~router.lifecycle.RequestLife` runs
it: whole-request hand-off (``prefill`` work to P, then ``decode`` work with P's handles
to D: :func:`prefill_item`, :func:`decode_item`), ``full`` work on one worker (no prefill
worker chosen, or a migrated request resuming after output), or layer-wise (decode worker
first: ``router/layerwise.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from msgspec.structs import replace

from router.config import RouterConfig
from router.layerwise import goes_layerwise
from router.peer_prefix import PeerExports
from router.policy import RouteDecision
from router.validation import ValidRequest
from router.workers import Expected, WorkerView
from workers.protocol.wire import TokenEvent, WorkItem


@dataclass(frozen=True)
class Attempt:
    """The workers of one try and its ``full`` work item (prompt, params, output so far)."""

    decode: WorkerView
    prefill: WorkerView | None  # None: ``full`` work on the decode worker
    item: WorkItem
    is_layerwise: bool  # the KV streams layer by layer as P computes (router/layerwise.py)
    num_cached_tokens: int  # of the prompt, on the chosen worker (the policy's count)


def plan(
    decision: RouteDecision,
    by_name: dict[str, WorkerView],
    request_id: str,
    valid: ValidRequest,
    token_ids: list[int],
    output_token_ids: list[int],
) -> Attempt:
    """The attempt ``decision`` calls for, after the output the client already has (a
    migration's: the worker resumes after it)."""
    decode = by_name[decision.decode]
    prefill = by_name[decision.prefill] if decision.prefill is not None else None
    params = valid.params
    outputs = tuple(output_token_ids)
    if outputs and params.prompt_logprobs is not None:
        # Resumed after output went out: its prompt logprobs went with the first token.
        params = dataclasses.replace(params, prompt_logprobs=None)
    item = WorkItem(request_id, tuple(token_ids), params, "full")
    if outputs:
        item = replace(item, output_token_ids=outputs)
    uncached = len(token_ids) - decision.cached_tokens
    is_layerwise = prefill is not None and goes_layerwise(prefill, item, uncached)
    return Attempt(decode, prefill, item, is_layerwise, decision.cached_tokens)


def expect(attempt: Attempt, block_size: int) -> list[WorkerView]:
    """Count the request against its workers from now on, before either has it (the next
    request of a burst must see it); returns them, for the request to drop the count on
    every end path (``RequestLife.settle``, a migration)."""
    item = attempt.item
    request_id = item.request_id
    num_tokens = len(item.prompt_token_ids) + len(item.output_token_ids)
    num_blocks = -(-num_tokens // block_size)
    uncached = num_tokens - attempt.num_cached_tokens
    counted = []
    if attempt.prefill is not None:
        attempt.prefill.expect(request_id, Expected(uncached, num_blocks))
        counted.append(attempt.prefill)
    # A decode worker fed by a prefill worker receives the prompt's blocks; it computes
    # none of them.
    fed = attempt.prefill is not None
    attempt.decode.expect(request_id, Expected(0 if fed else uncached, num_blocks))
    counted.append(attempt.decode)
    return counted


def prefill_item(attempt: Attempt) -> WorkItem:
    """Whole-request hand-off, step 1: P computes the prompt and holds its KV."""
    return replace(attempt.item, mode="prefill")


def decode_item(attempt: Attempt, handle_event: TokenEvent) -> WorkItem:
    """Step 2: D continues after P's first token, pulling the KV through P's handles."""
    return replace(
        attempt.item,
        mode="decode",
        kv_handles=handle_event.kv_handles,
        first_token_id=handle_event.token_ids[0],
    )


async def with_peer_prefix(
    peers: PeerExports | None,
    item: WorkItem,
    target: WorkerView,
    workers: list[WorkerView],
    config: RouterConfig,
) -> WorkItem:
    """Peer pull (G4): ``item`` with a peer's handles on its prompt's first blocks, when
    another worker holds enough more of it than ``target`` (router/peer_prefix.py)."""
    if peers is None or item.params.prompt_logprobs is not None:
        return item  # prompt logprobs: every prompt position is computed by the worker
    return await peers.attach(item, target, workers, config.block_size, config.peer_min_blocks)
