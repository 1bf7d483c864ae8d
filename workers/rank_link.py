"""Bytes between the ranks of one replica, over a gloo process group (host memory).

Rank 0 sends each command to every other rank, point to point and without waiting; the
other ranks receive them in order. Every rank can be asked to answer and rank 0 gathers
the answers. Messages up to a few KiB (a decode step of a small batch, most replies)
take one transfer: a fixed-size buffer whose first 8 bytes hold the length. Longer ones
take a second transfer for the rest. The group is gloo even when the model's own
collectives run on NCCL, so the control path never touches the GPU, and a peer that
dies closes its TCP connections: the next transfer with it raises at once.

Why rank 0 does not wait for its sends: with pipeline stages it sends the next batch's
command while earlier batches are still in the pipeline, and a rank of its own stage
reads that command only after it has run those batches *together with rank 0* (their
all-reduces). Waiting there would deadlock. ``settle`` waits for the sends that are
safe to wait for (the caller knows which), which also surfaces a dead peer.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

COMMAND_INLINE_BYTES = 16 * 1024
REPLY_INLINE_BYTES = 4 * 1024
_HEADER = 8
# Point-to-point tags of the commands; the activations between pipeline stages use 0.
_TAG_COMMAND = 1
_TAG_COMMAND_REST = 2


class RankLink:
    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None):
        if world_size < 2:
            raise ValueError("a rank link joins at least two ranks")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._command = torch.zeros(COMMAND_INLINE_BYTES, dtype=torch.uint8)
        self._reply = torch.zeros(REPLY_INLINE_BYTES, dtype=torch.uint8)
        self._replies = [torch.zeros_like(self._reply) for _ in range(world_size)]
        self.num_sent = 0  # rank 0: commands sent so far; the next one's number
        # Rank 0: (number, transfers, buffers) of sends not yet waited for. The buffers
        # must live until their transfers are done.
        self._unsettled: deque[tuple[int, list[dist.Work], list[torch.Tensor]]] = deque()

    def send(self, data: bytes) -> int:
        """Rank 0: send ``data`` to every other rank without waiting; returns its number."""
        assert self.rank == 0
        head = torch.zeros(COMMAND_INLINE_BYTES, dtype=torch.uint8)
        _pack(head, data)
        buffers = [head]
        rest_len = len(data) - (COMMAND_INLINE_BYTES - _HEADER)
        if rest_len > 0:
            buffers.append(_as_tensor(data[-rest_len:]))
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
        buf = self._command
        dist.recv(buf, 0, group=self.group, tag=_TAG_COMMAND)
        length, inline = _unpack(buf)
        if length == len(inline):
            return inline
        rest = torch.empty(length - len(inline), dtype=torch.uint8)
        dist.recv(rest, 0, group=self.group, tag=_TAG_COMMAND_REST)
        return inline + rest.numpy().tobytes()

    def gather(self, data: bytes) -> list[bytes] | None:
        """Every rank passes its answer; rank 0 gets all of them (rank order), others None.
        Rank 0 calls it only when no rank needs rank 0 to reach it (nothing in flight)."""
        if self.rank == 0:
            self.settle()
        _pack(self._reply, data)
        dist.all_gather(self._replies, self._reply, group=self.group)
        parts = [_unpack(buf) for buf in self._replies]
        longest = max(length for length, _ in parts)
        capacity = REPLY_INLINE_BYTES - _HEADER
        if longest > capacity:  # somebody's answer did not fit: everyone sends the rest
            rest = torch.zeros(longest - capacity, dtype=torch.uint8)
            tail = data[capacity:]
            if tail:
                rest[: len(tail)] = _as_tensor(tail)
            rests = [torch.empty_like(rest) for _ in range(self.world_size)]
            dist.all_gather(rests, rest, group=self.group)
            parts = [
                (length, inline + rests[i][: length - len(inline)].numpy().tobytes())
                for i, (length, inline) in enumerate(parts)
            ]
        if self.rank != 0:
            return None
        return [payload for _, payload in parts]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


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
