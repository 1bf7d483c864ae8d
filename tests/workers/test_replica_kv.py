"""Rank 0's bookkeeping of a multi-rank receive (``workers/replica_kv.py``), links faked.

A decode replica of several ranks (TP and/or pipeline stages) admits a request only when
every rank's part of its KV has arrived, and fails the whole receive when any rank's
part fails, even if rank 0's own part arrived: the caller then recomputes or fails the
request and frees its blocks once, after the future completes. Here rank 0's connector
and the other ranks' replies are scripted, so the order of arrivals is exact.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvtransfer import KVHandle, TransferResult
from kvtransfer.errors import TransferFailedError
from kvtransfer.messages import encode as encode_kv
from workers.replica_kv import ReplicaKV
from workers.replica_messages import RankReply, Received, decode_command, encode_reply


class FakeLink:
    """Three ranks: rank 0 here, ranks 1 and 2 answer with the scripted replies."""

    world_size = 3
    rank = 0

    def __init__(self):
        self.commands = []
        self.replies: dict[int, list[Received]] = {1: [], 2: []}

    def send(self, data: bytes) -> int:
        self.commands.append(decode_command(data))
        return len(self.commands) - 1

    def settle(self, before: int | None = None) -> None:
        self.settled = len(self.commands) if before is None else before

    def gather(self, data: bytes) -> list[bytes]:
        answers = [data]
        for rank in (1, 2):
            received, self.replies[rank] = tuple(self.replies[rank]), []
            answers.append(encode_reply(RankReply(rank, received=received)))
        return answers


class FakeConnector:
    """Rank 0's connector: receives complete when the test says so."""

    def __init__(self):
        self.local: Future = Future()

    def receive(self, handles, block_ids) -> Future:
        return self.local


def _handles() -> tuple[bytes, ...]:
    handle = KVHandle("prefill-0", "req", 1, (3, 4), "fp", 12, 7, 30.0, 0.0)
    return (encode_kv(handle),)


def _receive(link: FakeLink) -> tuple[ReplicaKV, FakeConnector, Future]:
    kv = ReplicaKV(link)  # type: ignore[arg-type]
    connector = FakeConnector()
    kv.bind(connector, lambda rid, reason: None, lambda: None)  # type: ignore[arg-type]
    future = kv.receive(_handles(), [10, 11])
    # Every other rank was told to receive the same handles into the same blocks.
    (op,) = link.commands[-1].receives
    assert op.request_id == "req" and op.block_ids == (10, 11)
    return kv, connector, future


def test_a_receive_completes_only_when_every_rank_has_its_part():
    link = FakeLink()
    kv, connector, future = _receive(link)
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.replies[1].append(Received("req", "", 0.02, 50))
    kv._round()  # what poll() does every POLL_S while other ranks owe news
    kv.poll()
    assert not future.done()  # rank 2 has not reported yet
    link.replies[2].append(Received("req", "", 0.03, 25))
    kv._round()
    kv.poll()
    result = future.result(timeout=0)
    assert result.num_bytes == 175 and result.seconds == pytest.approx(0.03)
    assert not kv.owed


def test_one_failed_rank_fails_the_whole_receive_even_when_rank_0s_part_arrived():
    link = FakeLink()
    kv, connector, future = _receive(link)
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.replies[1].append(Received("req", "PeerLostError: prefill-0.rank1 lost"))
    link.replies[2].append(Received("req", "", 0.03, 25))
    kv._round()
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 1: PeerLostError"):
        future.result(timeout=0)
    assert not kv.owed  # nothing left outstanding: the caller may free the blocks


def test_a_failed_rank_does_not_complete_the_receive_before_the_others_are_done():
    link = FakeLink()
    kv, connector, future = _receive(link)
    link.replies[2].append(Received("req", "TransferTimeoutError: late"))
    kv._round()
    kv.poll()
    # Rank 0's and rank 1's parts may still write into the blocks: not complete yet.
    assert not future.done()
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.replies[1].append(Received("req", "", 0.02, 50))
    kv._round()
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 2: TransferTimeoutError"):
        future.result(timeout=0)
