"""Prefill side of the layer-wise KV hand-off: which blocks and layers of which request
go out after each layer of a step (pure bookkeeping; the transport is the caller's).

A request streamed in groups of ``group_size`` layers (``kvtransfer/layerwise.py``
chooses it) writes, after each group of each of its chunks, the blocks that chunk
completed (the final chunk: the rest of the prompt, its partial last block included)
for the group's layers. Blocks of different chunks are disjoint, so no write ever
overwrites another's bytes; the last group of the final chunk is the stream's last
write (it carries the one notice). ``ModelRunner.run`` calls the hook after each layer
of a step that has such a chunk, once that layer's KV is stored.

Who frees what: the blocks are the prefill request's; its writes read them until the
stream's future (``KVConnector.open_stream``) completes, so the worker keeps them held
(``KVHandoff``) until then: ``open`` a stream, and say when its future completed
(``ended``); meanwhile the request is never preempted and its end does not free its
blocks. A request that ends before its final chunk (abort) must also have its
connector stream abandoned (``KVConnector.abandon_stream``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtransfer.layerwise import layer_groups
from workers.engine.handoff import KVHandoff
from workers.engine.request import Request
from workers.engine.scheduler import SchedulerOutput

# (first_block, block_ids, model layers [start, end), layers_ready, is_last) -> None
WriteLayers = Callable[[int, tuple[int, ...], tuple[int, int], int, bool], None]


@dataclass
class _Stream:
    group_size: int
    write: WriteLayers
    num_sent_blocks: int = 0  # prompt blocks whose writes went out in earlier chunks
    num_chunks: int = 0  # chunks done (layers_ready counts chunks x layers)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed request's prefill chunk of a step: what the hook needs of it (rank 0
    sends these to the other ranks of a replica with the step, ``workers/parallel/``)."""

    request_id: str
    start_pos: int
    num_tokens: int
    num_prompt_tokens: int
    block_ids: tuple[int, ...]  # the request's blocks up to the chunk's end


@dataclass(frozen=True)
class _Job:
    """One request's chunk in this step: what goes out after which layer."""

    stream: _Stream
    first_block: int
    block_ids: tuple[int, ...]
    upto: int  # prompt blocks sent once this chunk's last group went out
    is_final: bool
    group_ends: dict[int, tuple[int, int]]  # local layer index -> the group it ends


class LayerwiseStreams:
    def __init__(
        self, block_size: int, first_layer: int, num_layers: int, handoff: KVHandoff | None = None
    ):
        self.block_size = block_size
        self.first_layer = first_layer  # this rank's model layers: a pipeline stage's
        self.num_layers = num_layers
        self._streams: dict[str, _Stream] = {}
        self._handoff = handoff  # who frees the blocks (``open`` / ``ended``)
        self.launched: list[StreamChunk] = []  # the streamed chunks of the step being sent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, group_size: int, write: WriteLayers) -> None:
        """Stream ``request_id``'s KV in groups of ``group_size`` layers through ``write``
        (before its first chunk is scheduled)."""
        if not 1 <= group_size <= self.num_layers:
            raise ValueError(f"group_size {group_size} outside 1..{self.num_layers}")
        self._streams[request_id] = _Stream(group_size, write)

    def remove(self, request_id: str) -> bool:
        """Forget a request (its last write went out, or it was abandoned)."""
        return self._streams.pop(request_id, None) is not None

    def open(self, request_id: str, group_size: int, write: WriteLayers) -> None:
        """A worker's stream (``add``) whose blocks the hand-off keeps held until
        ``ended``: never preempted, not freed at the request's end (``KVHandoff``)."""
        self.add(request_id, group_size, write)
        if self._handoff is not None:
            self._handoff.stream_opened(request_id)

    def ended(self, request_id: str) -> bool:
        """The stream's future completed (no write in flight): a request that ended
        meanwhile has its blocks freed now (True)."""
        self.remove(request_id)
        return self._handoff.stream_ended(request_id) if self._handoff is not None else False

    def chunks_of(self, sched: SchedulerOutput, requests: Sequence[Request]) -> list[StreamChunk]:
        """The streamed prefill chunks of a step. ``requests``: one per chunk."""
        if not self._streams:
            return []
        return [
            StreamChunk(
                chunk.request_id,
                chunk.start_pos,
                chunk.num_tokens,
                req.num_prompt_tokens,
                tuple(chunk.block_ids),
            )
            for chunk, req in zip(sched.chunks, requests, strict=True)
            if chunk.request_id in self._streams and chunk.start_pos < req.num_prompt_tokens
        ]

    def launching(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The engine is about to send a step (``ModelRunner.launch``): its streamed chunks
        are ``launched`` until the next one, for the other ranks of a replica."""
        if not self._streams:
            self.launched = []
            return
        self.launched = self.chunks_of(sched, [requests[c.request_id] for c in sched.chunks])

    def take_launched(self) -> list[StreamChunk]:
        """The streamed chunks of the step being sent, once (a step sent without a
        ``launching`` before it gets none, never an earlier step's)."""
        launched, self.launched = self.launched, []
        return launched

    def hook_for(
        self, sched: SchedulerOutput, requests: Sequence[Request]
    ) -> Callable[[int], None] | None:
        """The per-layer hook of a step (None when no chunk of it streams): called with
        the local index of each layer once its KV is stored. ``requests``: one per chunk."""
        return self.hook_for_chunks(self.chunks_of(sched, requests))

    def hook_for_chunks(self, chunks: Sequence[StreamChunk]) -> Callable[[int], None] | None:
        """``hook_for`` from the step's streamed chunks (a rank other than 0 gets them from
        rank 0 with the step; chunks of requests not streamed here are skipped)."""
        jobs = []
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            num_prompt = chunk.num_prompt_tokens
            if stream is None or chunk.start_pos >= num_prompt:
                continue  # not streamed, or a decode step past the prompt
            end = chunk.start_pos + chunk.num_tokens
            is_final = end >= num_prompt
            upto = -(-num_prompt // self.block_size) if is_final else end // self.block_size
            block_ids = tuple(chunk.block_ids[stream.num_sent_blocks : upto])
            if block_ids:
                groups = layer_groups(self.num_layers, stream.group_size)
                ends = {g_end - 1: (g_start, g_end) for g_start, g_end in groups}
                jobs.append(_Job(stream, stream.num_sent_blocks, block_ids, upto, is_final, ends))
        if not jobs:
            return None
        return lambda layer: self._layer_done(jobs, layer)

    def _layer_done(self, jobs: list[_Job], layer: int) -> None:
        for job in jobs:
            group = job.group_ends.get(layer)
            if group is None:
                continue
            stream = job.stream
            is_last_group = group[1] == self.num_layers
            layers_ready = stream.num_chunks * self.num_layers + group[1]
            layers = (self.first_layer + group[0], self.first_layer + group[1])
            stream.write(
                job.first_block, job.block_ids, layers, layers_ready, job.is_final and is_last_group
            )
            if is_last_group:  # (a step that raised sends its chunk again when rerun)
                stream.num_chunks += 1
                stream.num_sent_blocks = job.upto
