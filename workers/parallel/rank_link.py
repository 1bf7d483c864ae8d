"""Bytes between the ranks of one replica, over gloo process groups (host memory).

Rank 0 sends each command to every other rank, point to point and without waiting; the
other ranks receive them in order. The other ranks send their news back (``reply``)
whenever they have some, on a group of their own, and a thread on rank 0 takes it in
(``start_replies``, ``take_replies``): rank 0 never waits for an answer. Messages up to
a few KiB (a decode step of a small batch, most replies) take one transfer: a fixed-size
buffer whose first 8 bytes hold the length. Longer ones take a second transfer for the
rest. The groups are gloo even when the model's own collectives run on NCCL, so the
control path never touches the GPU, and a peer that dies closes its TCP connections:
the next send to it raises at once.

Why rank 0 waits for neither its sends nor answers: with pipeline stages it sends the
next batch's command while earlier batches are still in the pipeline, and a rank of its
own stage reads that command only after it has run those batches *together with rank 0*
(their all-reduces). Waiting there would deadlock; so would waiting for an answer that
comes only after that command. ``settle`` waits for the sends that are safe to wait for
(the caller knows which), which also surfaces a dead peer. Answers come on a separate
group so that the reading thread never shares a group with the engine's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COMMAND_INLINE_BYTES = 16 * 1024
REPLY_INLINE_BYTES = 4 * 1024
_HEADER = 8
# Point-to-point tags of the commands; the activations between pipeline stages use 0.
_TAG_COMMAND = 1
_TAG_COMMAND_REST = 2
# Tags of the answers, on the reply group.
_TAG_REPLY = 3
_TAG_REPLY_REST = 4


class RankLink:
    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        reply_group: dist.ProcessGroup | None = None,
    ):
        if world_size < 2:
            raise ValueError("a rank link joins at least two ranks")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.reply_group = reply_group  # the answers' own group (every rank is in it)
        self._command = torch.zeros(COMMAND_INLINE_BYTES, dtype=torch.uint8)
        self.num_sent = 0  # rank 0: commands sent so far; the next one's number
        # Rank 0: (number, transfers, buffers) of sends not yet waited for. The buffers
        # must live until their transfers are done.
        self._unsettled: deque[tuple[int, list[dist.Work], list[torch.Tensor]]] = deque()
        # Rank 0: answers read by the reply thread (bytes), or the error that ended it.
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None

    def send(self, data: bytes) -> int:
        """Rank 0: send ``data`` to every other rank without waiting; returns its number."""
        assert self.rank == 0
        buffers = _frames(data, COMMAND_INLINE_BYTES)
        works = [
            dist.isend(buf, peer, group=self.group, tag=tag)
            for peer in range(1, self.world_size)
            for buf, tag in zip(buffers, (_TAG_COMMAND, _TAG_COMMAND_REST), strict=False)
        ]
        number = self.num_sent
        self.num_sent += 1
        self._unsettled.append((number, works, buffers))
        return number

    def settle(self, before: int | None = None) -> None:
        """Rank 0: wait until the sends numbered below ``before`` (all: None) arrived.
        Raises if a peer is gone. Only for sends that no rank needs rank 0 to reach."""
        while self._unsettled and (before is None or self._unsettled[0][0] < before):
            _, works, _ = self._unsettled[0]
            for work in works:
                work.wait()
            self._unsettled.popleft()

    def receive(self) -> bytes:
        """The other ranks: rank 0's next message."""
        assert self.rank != 0
        dist.recv(self._command, 0, group=self.group, tag=_TAG_COMMAND)
        return _whole(self._command, 0, self.group, _TAG_COMMAND_REST)

    # ---- answers: the other ranks -> rank 0 -----------------------------------------
    def reply(self, data: bytes) -> None:
        """The other ranks: send ``data`` to rank 0 (non-empty; rank 0's reader is always
        receiving, so this returns at once). Raises if rank 0 is gone."""
        assert self.rank != 0 and data
        self._send_reply(data)

    def reply_done(self) -> None:
        """The other ranks: the last answer; rank 0's reader stops once every rank sent it."""
        self._send_reply(b"")

    def start_replies(self, wake: Callable[[], None]) -> None:
        """Rank 0: read the other ranks' answers on a thread; ``wake`` runs after each."""
        assert self.rank == 0 and self._reader is None
        self._reader = threading.Thread(
            target=self._read_replies, args=(wake,), name="rank-replies", daemon=True
        )
        self._reader.start()

    def take_replies(self) -> list[bytes]:
        """Rank 0: the answers read since the last call, in arrival order (each rank's in
        the order it sent them). Raises if the reader failed (a rank is gone)."""
        out = []
        while True:
            try:
                item = self._replies.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, Exception):
                self._replies.put(item)  # every later call raises too
                raise RuntimeError(f"the replica's answers stopped: {item}") from item
            out.append(item)

    def join_replies(self, timeout_s: float) -> bool:
        """Rank 0: wait until every other rank sent its last answer; False on timeout."""
        if self._reader is None:
            return True
        self._reader.join(timeout_s)
        return not self._reader.is_alive()

    def _send_reply(self, data: bytes) -> None:
        for buf, tag in zip(
            _frames(data, REPLY_INLINE_BYTES), (_TAG_REPLY, _TAG_REPLY_REST), strict=False
        ):
            dist.send(buf, 0, group=self.reply_group, tag=tag)

    def _read_replies(self, wake: Callable[[], None]) -> None:
        head = torch.zeros(REPLY_INLINE_BYTES, dtype=torch.uint8)
        left = self.world_size - 1  # ranks that have not sent their last answer
        try:
            while left:
                # Whichever rank answers first. A dead rank does not end this wait (gloo
                # does not notice it here); rank 0's sends do (``settle``).
                src = dist.recv(head, src=None, group=self.reply_group, tag=_TAG_REPLY)
                data = _whole(head, src, self.reply_group, _TAG_REPLY_REST)
                if not data:
                    left -= 1
                    continue
                self._replies.put(data)
                wake()
        except Exception as exc:
            logger.warning("rank 0 stops reading the other ranks' answers: %s", exc)
            self._replies.put(exc)
            wake()


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _frames(data: bytes, inline_bytes: int) -> list[torch.Tensor]:
    """A message as transfers: a buffer of ``inline_bytes`` (the length, then as much as
    fits), and the rest, if any."""
    head = torch.zeros(inline_bytes, dtype=torch.uint8)
    _pack(head, data)
    rest_len = len(data) - (inline_bytes - _HEADER)
    return [head, _as_tensor(data[-rest_len:])] if rest_len > 0 else [head]


def _whole(head: torch.Tensor, src: int, group, rest_tag: int) -> bytes:
    """The message whose first transfer is ``head``: receives the rest from ``src``."""
    length, inline = _unpack(head)
    if length == len(inline):
        return inline
    rest = torch.empty(length - len(inline), dtype=torch.uint8)
    dist.recv(rest, src, group=group, tag=rest_tag)
    return inline + rest.numpy().tobytes()


def _pack(buf: torch.Tensor, data: bytes) -> None:
    """Length header, then as much of ``data`` as fits."""
    inline = data[: buf.numel() - _HEADER]
    buf[:_HEADER] = _as_tensor(len(data).to_bytes(_HEADER, "little"))
    if inline:
        buf[_HEADER : _HEADER + len(inline)] = _as_tensor(inline)


def _unpack(buf: torch.Tensor) -> tuple[int, bytes]:
    """(total length, the part carried inline)."""
    raw = buf.numpy()
    length = int.from_bytes(raw[:_HEADER].tobytes(), "little")
    inline = min(length, buf.numel() - _HEADER)
    return length, raw[_HEADER : _HEADER + inline].tobytes()
