"""A rank other than 0 (TP and/or pipeline): it does what rank 0's commands say, in order.

No scheduler, sampler or router traffic here: each :class:`RankCommand` brings the KV
operations of this rank's connector and, for a step, the forward pass's inputs, which
this rank runs on its shard of the weights and its heads of the KV cache (a pipeline
stage's layers: it receives the previous stage's activations and sends its own on). It answers
when asked (``workers/replica_kv.py`` is the other end). ``run`` returns on a stop
command and raises when the link to rank 0 breaks (rank 0 died) or a command is out of
sequence; the caller then tears the process group down so that no rank waits on it.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future

from kvtransfer import KVConnector, KVHandle
from kvtransfer.messages import decode_as as decode_kv
from kvtransfer.messages import encode as encode_kv
from workers.engine import LLMEngine
from workers.rank_link import RankLink
from workers.replica_messages import (
    Offered,
    OfferOp,
    RankReply,
    Received,
    decode_command,
    encode_reply,
)

logger = logging.getLogger(__name__)


class RankFollower:
    def __init__(
        self, engine: LLMEngine, link: RankLink, dst_tp_size: int = 1, dst_pp_size: int = 1
    ):
        self.engine = engine
        self.link = link
        self.dst_tp_size = dst_tp_size  # prefill: the decode pool's layout (who reads us)
        self.dst_pp_size = dst_pp_size
        self.connector: KVConnector | None = None
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # from the connector thread
        self._receives: dict[str, Future] = {}
        self.steps = 0

    def on_release(self, request_id: str, reason: str) -> None:
        """The connector thread: this rank's lease of ``request_id`` ended."""
        self._released.put(request_id)

    def run(self) -> None:
        expected = 0
        while True:
            command = decode_command(self.link.receive())
            if command.seq != expected:
                raise RuntimeError(f"rank command {command.seq} arrived, {expected} expected")
            expected += 1
            connector = self.connector
            if connector is not None:
                for request_id in command.aborts:
                    connector.abort(request_id)
                for handles in command.declines:
                    connector.decline([decode_kv(h, KVHandle) for h in handles], "aborted")
            for op in command.receives:
                self._start_receive(op.handles, op.block_ids)
            offered = tuple(self._offer(op) for op in command.offers)
            if command.reply:
                self.link.gather(encode_reply(self._reply(offered)))
            if command.step is not None:
                self.engine.runner.run(command.step)
                self.steps += 1
            if command.stop:
                return

    def _offer(self, op: OfferOp) -> Offered:
        try:
            if self.connector is None:
                raise RuntimeError("no KV connector on this rank")
            handle = self.connector.offer(
                op.request_id,
                op.block_ids,
                num_tokens=op.num_tokens,
                first_token_id=op.first_token_id,
                dst_tp_size=self.dst_tp_size,
                dst_pp_size=self.dst_pp_size,
            )
        except Exception as exc:
            return Offered(op.request_id, b"", f"{type(exc).__name__}: {exc}")
        return Offered(op.request_id, encode_kv(handle))

    def _start_receive(self, handles: tuple[bytes, ...], block_ids: tuple[int, ...]) -> None:
        decoded = [decode_kv(h, KVHandle) for h in handles]
        request_id = decoded[0].req_id
        try:
            if self.connector is None:
                raise RuntimeError("no KV connector on this rank")
            self._receives[request_id] = self.connector.receive(decoded, block_ids)
        except Exception as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            self._receives[request_id] = failed

    def _reply(self, offered: tuple[Offered, ...]) -> RankReply:
        released = []
        while True:
            try:
                released.append(self._released.get_nowait())
            except queue.Empty:
                break
        received = []
        for request_id, future in list(self._receives.items()):
            if not future.done():
                continue
            del self._receives[request_id]
            exc = future.exception()
            if exc is not None:
                received.append(Received(request_id, f"{type(exc).__name__}: {exc}"))
            else:
                result = future.result()
                received.append(Received(request_id, "", result.seconds, result.num_bytes))
        return RankReply(self.link.rank, offered, tuple(released), tuple(received))
