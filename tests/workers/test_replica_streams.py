"""Rank 0's bookkeeping of a replica's layer-wise streams (``workers/parallel/replica_kv.py``,
``replica_streams.py``), links faked so that the order of the other ranks' news is exact.

What must hold: a decode replica's reservations go out only once every rank has one (in
rank order), and a rank that cannot reserve fails them; its receive completes only when
every rank's part did. A prefill replica's stream completes only once every rank's
stream has ended (the block ids are shared: rank 0 frees them after), fails if one
failed, and a rank's failure stops the others' parts at once. Each step's streamed
chunks travel with its command.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from kvtransfer import TransferResult
from kvtransfer.errors import TransferFailedError
from tests.workers.test_replica_kv import FakeLink
from workers.engine.layerwise import LayerwiseStreams, StreamChunk
from workers.engine.step_inputs import StepInputs
from workers.parallel.replica_kv import ReplicaKV
from workers.parallel.replica_messages import Received, Reserved, Streamed


class StreamingConnector:
    """Rank 0's connector: reservations at once; futures complete when the test says."""

    def __init__(self):
        self.local: Future = Future()
        self.abandoned: list[str] = []
        self.sources: list = []

    def replica_agents(self, worker_id):
        return (f"{worker_id}#a", f"{worker_id}.rank1#b")

    def expect_stream(self, request_id, block_ids, sources, first_block=0):
        self.sources.append((tuple(sources), first_block))
        return b"res0", self.local

    def open_stream(self, request_id, reservations):
        return self.local

    def abandon_stream(self, request_id, reason):
        self.abandoned.append(request_id)

    def abort(self, request_id):
        pass


def _replica() -> tuple[ReplicaKV, StreamingConnector, FakeLink]:
    link = FakeLink()
    kv = ReplicaKV(link)  # type: ignore[arg-type]
    connector = StreamingConnector()
    kv.bind(connector, lambda rid, reason: None, lambda: None)  # type: ignore[arg-type]
    return kv, connector, link


def test_reservations_go_out_once_every_rank_reserved_and_the_receive_waits_for_all():
    kv, connector, link = _replica()
    reserving, future = kv.expect_stream("req", [10, 11], "prefill-0", first_block=2)
    assert connector.sources == [(("prefill-0#a", "prefill-0.rank1#b"), 2)]
    (op,) = link.commands[-1].reserves  # every rank reserves the same blocks
    assert (op.request_id, op.source, op.block_ids, op.first_block) == (
        "req", "prefill-0", (10, 11), 2,
    )  # fmt: skip
    link.answer(2, reserved=(Reserved("req", b"res2"),))
    kv.poll()
    assert not reserving.done()  # rank 1 has not reserved yet
    link.answer(1, reserved=(Reserved("req", b"res1"),))
    kv.poll()
    assert reserving.result(timeout=0) == (b"res0", b"res1", b"res2")
    connector.local.set_result(TransferResult("req", "push", 100, 3, 0.01))
    link.answer(1, received=(Received("req", "", 0.02, 50),))
    kv.poll()
    assert not future.done()  # rank 2's layers are not all in
    link.answer(2, received=(Received("req", "", 0.01, 50),))
    kv.poll()
    assert future.result(timeout=0).num_bytes == 200
    assert not kv.pending


def test_a_rank_that_cannot_reserve_fails_the_reservations():
    kv, connector, link = _replica()
    reserving, future = kv.expect_stream("req", [10], "prefill-0")
    error = "KVTransferError: prefill-0: 1 ranks handshaken"
    link.answer(1, reserved=(Reserved("req", b"", error),), received=(Received("req", error),))
    link.answer(2, reserved=(Reserved("req", b"res2"),))
    kv.poll()
    with pytest.raises(RuntimeError, match="rank 1: KVTransferError"):
        reserving.result(timeout=0)
    kv.abort("req")  # what the caller does: every rank stops
    assert link.commands[-1].aborts == ("req",)
    connector.local.set_exception(TransferFailedError("aborted"))
    link.answer(2, received=(Received("req", "TransferAbortedError: aborted"),))
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 1"):
        future.result(timeout=0)


def test_a_stream_ends_once_every_rank_has_nothing_in_flight():
    kv, connector, link = _replica()
    future = kv.open_stream("req", [b"res0", b"res1"], 2)
    (op,) = link.commands[-1].stream_opens
    assert (op.request_id, op.reservations, op.group_size) == ("req", (b"res0", b"res1"), 2)
    connector.local.set_result(1000)
    link.answer(1, streamed=(Streamed("req", "", 500),))
    kv.poll()
    assert not future.done()  # rank 2 may still read the blocks
    link.answer(2, streamed=(Streamed("req", "", 250),))
    kv.poll()
    assert future.result(timeout=0) == 1750
    assert not kv.pending and connector.abandoned == []


def test_a_rank_whose_stream_failed_stops_the_others_and_fails_the_stream():
    kv, connector, link = _replica()
    future = kv.open_stream("req", [b"res0"], 1)
    link.answer(2, streamed=(Streamed("req", "PeerLostError: no handshake with d"),))
    kv.poll()
    # The others stop now: their readers hear "failed" instead of waiting for rank 2.
    assert connector.abandoned == ["req"] and link.commands[-1].stream_aborts == ("req",)
    assert not future.done()
    connector.local.set_exception(TransferFailedError("abandoned"))
    link.answer(1, streamed=(Streamed("req", "TransferAbortedError: abandoned"),))
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 2: PeerLostError"):
        future.result(timeout=0)
    assert not kv.pending


def test_a_steps_streamed_chunks_travel_with_its_command():
    kv, _, link = _replica()
    launched = [StreamChunk("req", 16, 16, 40, (3, 4, 5, 6))]

    streams = LayerwiseStreams(block_size=8, first_layer=0, num_layers=2)
    streams.launched = launched
    kv.bind_streams(streams)
    inputs = StepInputs(
        input_ids=np.arange(16, dtype=np.int64),
        positions=np.arange(16, 32, dtype=np.int64),
        slot_mapping=np.arange(16, dtype=np.int64),
        block_tables=np.array([[3, 4, 5, 6]], dtype=np.int32),
        seq_lens=(32,),
        query_start_loc=(0, 16),
        num_decodes=0,
        sample_indices=(15,),
    )
    kv.before_forward(inputs)
    (chunk,) = link.commands[-1].stream_chunks
    assert (chunk.request_id, chunk.start_pos, chunk.num_tokens) == ("req", 16, 16)
    assert (chunk.num_prompt_tokens, chunk.block_ids) == (40, (3, 4, 5, 6))
    kv.before_forward(inputs)  # a step sent without launching: never the last one's
    assert link.commands[-1].stream_chunks == ()
