"""Joining the ranks of one replica: the process group, the control link, agreed sizes.

Each rank is its own process (a Ray actor in the cluster, a spawned process in tests).
The model's collectives use one group per stage's tensor-parallel ranks (NCCL on CUDA,
gloo on CPU), with a deadline for a hung peer far tighter than bring-up's
(``MODEL_GROUP_TIMEOUT_S``); the activations pass from stage to stage point to point on
the default group. Rank 0's commands always travel on
a gloo group (host memory, ``workers/parallel/rank_link.py``): on CPU that is the default group
itself. The other ranks' answers travel on a gloo group of their own. How ranks map to (stage, TP rank): ``workers/models/parallel.py``.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from workers.models.parallel import ParallelContext
from workers.models.rank_layout import rank_of, stage_and_tp_rank
from workers.parallel.rank_link import RankLink

# A collective waits this long for a hung peer (a dead one is seen at once: its
# connections close). Generous: the ranks of a large model finish loading at different
# times, and the first collective waits for the slowest.
GROUP_TIMEOUT_S = 600.0
# A collective of the model (attention's all-reduce, the experts' dispatch) waits this long
# for a hung (alive but stuck) peer. Once loaded, a stage's ranks run the same layers in
# lockstep and every collective resynchronises them, so a wait this long is a stuck rank,
# not a slow one: the step raises and the replica's requests migrate (docs/moe.md).
MODEL_GROUP_TIMEOUT_S = 60.0


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous of rank 0's store)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def join_replica(
    rank: int, world_size: int, address: str, port: int, device_type: str, pp_size: int = 1
) -> tuple[ParallelContext, RankLink]:
    """Join the replica's process group (rank 0 hosts the store at ``address:port``):
    ``world_size`` ranks, ``pp_size`` pipeline stages of ``world_size // pp_size`` each."""
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(f"{world_size} ranks do not split into {pp_size} pipeline stages")
    tp_size = world_size // pp_size
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    control = None if backend == "gloo" else dist.new_group(backend="gloo")
    # The other ranks' answers to rank 0 have a gloo group of their own: a thread on rank
    # 0 reads them while its engine thread uses the other groups (workers/parallel/rank_link.py).
    replies = dist.new_group(backend="gloo")
    stage, tp_rank = stage_and_tp_rank(rank, tp_size, pp_size)
    tp_group = None  # one rank per stage: the model has no collective
    if tp_size > 1:
        # Creating a group is collective: every rank creates every stage's, in order. Its
        # own timeout, not the bring-up's: the model's collectives start after loading.
        timeout = datetime.timedelta(seconds=MODEL_GROUP_TIMEOUT_S)
        for other in range(pp_size):
            ranks = [rank_of(other, t, tp_size, pp_size) for t in range(tp_size)]
            group = dist.new_group(ranks, timeout=timeout)
            if other == stage:
                tp_group = group
    parallel = ParallelContext(tp_rank, tp_size, tp_group, stage, pp_size)
    return parallel, RankLink(rank, world_size, control, replies)


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
