"""Rank 0's bookkeeping of a multi-rank receive (``workers/parallel/replica_kv.py``), links faked.

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
from kvtransfer.messages import decode_as as decode_kv
from kvtransfer.messages import encode as encode_kv
from workers.parallel.replica_kv import ReplicaKV
from workers.parallel.replica_messages import (
    Offered,
    RankReply,
    Received,
    decode_command,
    encode_reply,
)


class FakeLink:
    """Three ranks: rank 0 here; the test scripts what ranks 1 and 2 send back."""

    world_size = 3
    rank = 0

    def __init__(self):
        self.commands = []
        self.news: list[bytes] = []  # what the other ranks sent, not yet taken

    def send(self, data: bytes) -> int:
        self.commands.append(decode_command(data))
        return len(self.commands) - 1

    def settle(self, before: int | None = None) -> None:
        self.settled = len(self.commands) if before is None else before

    def start_replies(self, wake) -> None:
        self.wake = wake

    def take_replies(self) -> list[bytes]:
        news, self.news = self.news, []
        return news

    def answer(self, rank: int, **news) -> None:
        self.news.append(encode_reply(RankReply(rank, **news)))


class FakeConnector:
    """Rank 0's connector: receives complete when the test says so; offers at once."""

    def __init__(self):
        self.local: Future = Future()

    def receive(self, handles, block_ids) -> Future:
        return self.local

    def offer(self, request_id, block_ids, **kwargs) -> KVHandle:
        return KVHandle("prefill-0", request_id, 0, tuple(block_ids), "fp", 12, 7, 30.0, 0.0)


def _handles() -> tuple[bytes, ...]:
    handle = KVHandle("prefill-0", "req", 1, (3, 4), "fp", 12, 7, 30.0, 0.0)
    return (encode_kv(handle),)


def _replica(link: FakeLink, released: list | None = None) -> tuple[ReplicaKV, FakeConnector]:
    kv = ReplicaKV(link)  # type: ignore[arg-type]
    connector = FakeConnector()
    on_release = (
        (lambda rid, reason: released.append((rid, reason)))
        if released is not None
        else (lambda rid, reason: None)
    )
    kv.bind(connector, on_release, lambda: None)  # type: ignore[arg-type]
    return kv, connector


def _receive(link: FakeLink) -> tuple[ReplicaKV, FakeConnector, Future]:
    kv, connector = _replica(link)
    future = kv.receive(_handles(), [10, 11])
    # Every other rank was told to receive the same handles into the same blocks.
    (op,) = link.commands[-1].receives
    assert op.request_id == "req" and op.block_ids == (10, 11)
    return kv, connector, future


def test_a_receive_completes_only_when_every_rank_has_its_part():
    link = FakeLink()
    kv, connector, future = _receive(link)
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.answer(1, received=(Received("req", "", 0.02, 50),))
    kv.poll()
    assert not future.done()  # rank 2 has not reported yet
    link.answer(2, received=(Received("req", "", 0.03, 25),))
    kv.poll()
    result = future.result(timeout=0)
    assert result.num_bytes == 175 and result.seconds == pytest.approx(0.03)
    assert not kv.pending


def test_one_failed_rank_fails_the_whole_receive_even_when_rank_0s_part_arrived():
    link = FakeLink()
    kv, connector, future = _receive(link)
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.answer(1, received=(Received("req", "PeerLostError: prefill-0.rank1 lost"),))
    link.answer(2, received=(Received("req", "", 0.03, 25),))
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 1: PeerLostError"):
        future.result(timeout=0)
    assert not kv.pending  # nothing left outstanding: the caller may free the blocks


def test_a_failed_rank_does_not_complete_the_receive_before_the_others_are_done():
    link = FakeLink()
    kv, connector, future = _receive(link)
    link.answer(2, received=(Received("req", "TransferTimeoutError: late"),))
    kv.poll()
    # Rank 0's and rank 1's parts may still write into the blocks: not complete yet.
    assert not future.done()
    connector.local.set_result(TransferResult("req", "pull", 100, 2, 0.01))
    link.answer(1, received=(Received("req", "", 0.02, 50),))
    kv.poll()
    with pytest.raises(TransferFailedError, match="rank 2: TransferTimeoutError"):
        future.result(timeout=0)


def test_an_offer_completes_when_every_rank_has_answered_and_frees_after_every_lease():
    link, released = FakeLink(), []
    kv, _ = _replica(link, released)
    future = kv.offer("req", [5, 6], num_tokens=12, first_token_id=7)
    (op,) = link.commands[-1].offers  # the other ranks were told to offer the same blocks
    assert (op.request_id, op.block_ids, op.num_tokens, op.first_token_id) == ("req", (5, 6), 12, 7)
    link.answer(2, offered=(Offered("req", b"h2"),))
    kv.poll()
    assert not future.done()  # rank 1 has not answered: no handle goes out yet
    # Rank 1's offer and its lease's end in one message: the offer counts first.
    link.answer(1, offered=(Offered("req", b"h1"),), released=("req",))
    kv.poll()
    handles = future.result(timeout=0)
    assert handles[1:] == (b"h1", b"h2") and decode_kv(handles[0], KVHandle).req_id == "req"
    kv.local_released("req", "released")
    link.answer(2, released=("req",))
    assert released == []  # not before poll takes the news in
    kv.poll()
    assert released == [("req", "released")]  # once, after the last rank's lease ended


def test_a_rank_that_cannot_offer_fails_the_offer_and_nothing_is_held():
    link, released = FakeLink(), []
    kv, _ = _replica(link, released)
    future = kv.offer("req", [5], num_tokens=3, first_token_id=7)
    link.answer(1, offered=(Offered("req", b"", "RuntimeError: no room"),))
    link.answer(2, offered=(Offered("req", b"h2"),))
    kv.poll()
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: no room"):
        future.result(timeout=0)
    assert not kv.pending
    kv.local_released("req", "expired")  # the leases that did start end by expiry
    link.answer(2, released=("req",))
    kv.poll()
    assert released == []  # the caller freed the blocks when the offer failed
