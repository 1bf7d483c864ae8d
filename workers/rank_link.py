"""Bytes between the ranks of one replica, over a gloo process group (host memory).

Rank 0 broadcasts each command; every rank can be asked to answer and rank 0 gathers
the answers. Messages up to a few KiB (a decode step of a small batch, most replies)
take one collective: a fixed-size buffer whose first 8 bytes hold the length. Longer
ones take a second collective for the rest. The group is gloo even when the model's
own collectives run on NCCL, so the control path never touches the GPU, and a peer
that dies closes its TCP connections: the next collective raises at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

COMMAND_INLINE_BYTES = 16 * 1024
REPLY_INLINE_BYTES = 4 * 1024
_HEADER = 8


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

    def broadcast(self, data: bytes | None = None) -> bytes:
        """Rank 0 passes ``data``; every rank returns it."""
        buf = self._command
        if self.rank == 0:
            assert data is not None
            _pack(buf, data)
        dist.broadcast(buf, 0, group=self.group)
        length, inline = _unpack(buf)
        if length == len(inline):
            return inline
        rest = torch.empty(length - len(inline), dtype=torch.uint8)
        if self.rank == 0:
            assert data is not None
            rest.copy_(_as_tensor(data[len(inline) :]))
        dist.broadcast(rest, 0, group=self.group)
        return inline + rest.numpy().tobytes()

    def gather(self, data: bytes) -> list[bytes] | None:
        """Every rank passes its answer; rank 0 gets all of them (rank order), others None."""
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
