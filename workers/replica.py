"""Joining the ranks of one replica: the process group, the control link, agreed sizes.

Each rank is its own process (a Ray actor in the cluster, a spawned process in tests).
The model's collectives use the default group: NCCL on CUDA, gloo on CPU. Rank 0's
commands always travel on a gloo group (host memory, ``workers/rank_link.py``): on CPU
that is the default group itself.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from workers.models.parallel import ParallelContext
from workers.rank_link import RankLink

# A collective waits this long for a hung peer (a dead one is seen at once: its
# connections close). Generous: the ranks of a large model finish loading at different
# times, and the first collective waits for the slowest.
GROUP_TIMEOUT_S = 600.0


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous of rank 0's store)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def join_replica(
    rank: int, world_size: int, address: str, port: int, device_type: str
) -> tuple[ParallelContext, RankLink]:
    """Join the replica's process group (rank 0 hosts the store at ``address:port``)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    control = None if backend == "gloo" else dist.new_group(backend="gloo")
    return ParallelContext(rank, world_size), RankLink(rank, world_size, control)


def agree_min(link: RankLink) -> Callable[[int], int]:
    """For the engine's ``agree_num_blocks``: every rank takes the smallest value."""

    def agree(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=link.group)
        return int(tensor.item())

    return agree


def leave_replica() -> None:
    """Close this rank's connections, so that no other rank waits on it."""
    if dist.is_initialized():
        dist.destroy_process_group()
