"""Worker replicas on Ray: place, start, wait, introduce, stop. Bring-up and restart share it.

A replica is one placement group with a bundle per pipeline stage, and one actor per
rank: rank 0 a ``WorkerActor`` (schedules, talks to the router), the others
``RankActor``s that follow it. A stage's bundle holds all its ``tensor_parallel`` ranks
(a bundle is always on one node: the all-reduce of every layer stays inside it), and the
group is ``PACK``: its stages share a node when one has room, else they span nodes (the
activations between stages are one tensor per step). The group is placed all or nothing,
so a replica is never half placed, and a restart removes and places it as a unit. Every rank has its own KV agent, so decode and
prefill replicas are introduced rank by rank, in both directions: the reader needs the
owner's memory, the owner needs the reader for completion notices.

Bring-up (``cluster/bringup.py``) does this for every replica at once; a restart
(``cluster/restart.py``) for one, with ``cancel`` set when the cluster shuts down so that
it gives up between Ray calls instead of waiting out their timeouts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.models.rank_layout import stage_and_tp_rank
from workers.protocol.wire import WorkerInfo, decode_as
from workers.serving.ray_rank import RankActor
from workers.serving.ray_worker import ACTOR_CONCURRENCY, WorkerActor
from workers.serving.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading weights of a large model can take minutes
_PEER_TIMEOUT_S = 60.0
_CANCEL_POLL_S = 0.5
RUN_ID = uuid.uuid4().hex[:8]


class Cancelled(RuntimeError):
    """The cluster is shutting down: a restart in progress gives up."""


@dataclass
class Replica:
    spec: WorkerSpec
    bundle: dict[str, float]  # what each rank reserves (a restart asks for the same)
    ranks: list  # every rank's actor handle, rank 0 first
    placement_group: object
    is_killed: bool = False


def rank_bundle(device: str, node_resource: str | None = None) -> dict[str, float]:
    """What one rank reserves: a CPU, a GPU on CUDA, and one unit of the pool's
    ``node_resource`` when set, so that only the nodes offering it (the Helm chart's
    worker group of the pool) can hold the rank."""
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if device == "cuda" else {})}
    if node_resource:
        bundle[node_resource] = 1.0
    return bundle


def place_replica(
    spec: WorkerSpec, bundle: dict[str, float], generation: int = 0, cancel=None
) -> Replica:
    """One placement group with a bundle per stage (``bundle`` per rank of the stage), and
    each rank's actor (not started) in its stage's bundle.

    ``generation`` counts restarts: Ray may still hold a killed actor's name for a moment,
    so a replacement gets names of its own.
    """
    # Unique per serving process: two deployments may share one Ray cluster.
    ray_name = f"baton-{RUN_ID}-{spec.name}" + (f"-{generation}" if generation else "")
    tp, pp = spec.tensor_parallel, spec.pipeline_parallel
    stage_bundle = {key: value * tp for key, value in bundle.items()}
    pg = placement_group([stage_bundle] * pp, strategy="PACK", name=ray_name)
    try:
        _get(pg.ready(), READY_TIMEOUT_S, cancel)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        stages = f"{pp} stages of " if pp > 1 else ""
        raise RuntimeError(
            f"{spec.role}: the Ray cluster cannot place worker {spec.name} "
            f"({stages}{stage_bundle}, each on one node); "
            f"resources: {ray.available_resources()}"
        ) from None
    except BaseException:
        remove_placement_group(pg)
        raise
    ranks = []
    for rank in range(spec.num_ranks):
        options = dict(
            name=ray_name if rank == 0 else f"{ray_name}-rank{rank}",
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=ACTOR_CONCURRENCY,
            max_restarts=0,  # a dead rank is replaced with its whole replica, not alone
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=stage_and_tp_rank(rank, tp, pp)[0]
            ),
        )
        if rank == 0:
            ranks.append(ray.remote(WorkerActor).options(**options).remote(spec.to_bytes()))
        else:
            ranks.append(ray.remote(RankActor).options(**options).remote(spec.to_bytes(), rank))
    return Replica(spec, bundle, ranks, pg)


def dp_group_specs(spec: WorkerSpec, role: str, group: int) -> list[WorkerSpec]:
    """Data-parallel group ``group`` of a pool whose ``spec`` has ``data_parallel`` N > 1:
    N one-rank workers, each its own worker to the router (``<role>-<group * N + r>``),
    rank ``r`` of the group ``<role>-g<group>`` (docs/moe.md)."""
    size = spec.data_parallel
    return [
        dataclasses.replace(
            spec, name=f"{role}-{group * size + r}", dp_rank=r, dp_group=f"{role}-g{group}"
        )
        for r in range(size)
    ]


def dp_group_members(replicas: dict[str, Replica], name: str) -> list[str]:
    """The workers of ``name``'s data-parallel group, by rank (just ``name`` outside one)."""
    spec = replicas[name].spec
    if spec.data_parallel == 1:
        return [name]
    members = [n for n, r in replicas.items() if r.spec.dp_group == spec.dp_group]
    return sorted(members, key=lambda n: replicas[n].spec.dp_rank)


def start_replicas(replicas: dict[str, Replica], cancel=None) -> None:
    """Every rank loads its shard; a replica's ranks meet at its rank 0 (all at once:
    joining the process group waits for every rank). The workers of a data-parallel group
    (``WorkerSpec.dp_group``, one rank each) meet at their group's rank 0 the same way:
    ``replicas`` must hold every worker of such a group."""
    calls = []
    meetings: dict[str, list] = {}  # data-parallel group -> where its workers meet
    for replica in replicas.values():
        spec = replica.spec
        if spec.data_parallel > 1 and spec.dp_rank == 0:
            meeting = _get(replica.ranks[0].rendezvous.remote(), READY_TIMEOUT_S, cancel)
            meetings[spec.dp_group] = meeting
    for name, replica in replicas.items():
        ranks = replica.ranks
        address, port = "", 0
        if len(ranks) > 1:
            address, port = _get(ranks[0].rendezvous.remote(), READY_TIMEOUT_S, cancel)
        elif replica.spec.data_parallel > 1:
            if replica.spec.dp_group not in meetings:
                raise RuntimeError(f"worker {name}: its group's rank 0 is not being started")
            address, port = meetings[replica.spec.dp_group]
        calls += [(name, r, a.start.remote(address, port)) for r, a in enumerate(ranks)]
    for name, rank, ref in calls:
        try:
            error = _get(ref, READY_TIMEOUT_S, cancel)
        except ray.exceptions.RayActorError as exc:
            error = str(exc)
        if error:
            raise RuntimeError(f"worker {name} (rank {rank}) failed to start: {error}")


def wait_ready(replicas: dict[str, Replica], cancel=None) -> list[WorkerInfo]:
    """Each replica's ``describe`` (rank 0), in order; raises if one cannot answer."""
    refs = {name: r.ranks[0].describe.remote() for name, r in replicas.items()}
    infos = []
    for name, ref in refs.items():
        try:
            infos.append(decode_as(_get(ref, READY_TIMEOUT_S, cancel), WorkerInfo))
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"worker {name} failed to start: {exc}") from None
    return infos


def check_agree(infos: Sequence[WorkerInfo]) -> WorkerInfo:
    """The first info, once every other agrees with it on what the router relies on."""
    first = infos[0]
    for info in infos[1:]:
        for key in ("architecture", "dtype", "max_model_len", "vocab_size", "block_size"):
            if getattr(info, key) != getattr(first, key):
                raise RuntimeError(
                    f"workers disagree on {key}: {first.name} has {getattr(first, key)}, "
                    f"{info.name} has {getattr(info, key)}"
                )
    return first


def introduce(
    replicas: dict[str, Replica], pairs: Iterable[tuple[str, str]], fresh: str = ""
) -> None:
    """Every rank of decode replica D and every rank of prefill replica P exchange
    KV-transfer metadata, for each (D, P) in ``pairs``.

    Bring-up (``fresh`` empty): any failure raises. A restart (``fresh`` names the new
    replica): only the new replica's failures raise. A peer replica that cannot take part
    is skipped with a warning: it is down too, and its own restart introduces it to
    everyone, this new replica included (restarts run one at a time).
    """
    pairs = list(pairs)
    meta: dict[str, list[bytes]] = {}
    for name in {n for pair in pairs for n in pair}:
        ranks = replicas[name].ranks
        try:
            meta[name] = ray.get([a.kv_metadata.remote() for a in ranks], timeout=_PEER_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            if not fresh or name == fresh:
                raise RuntimeError(f"worker {name} has no KV metadata: {exc}") from None
            why = str(exc).splitlines()[0]  # Ray's errors go on for a page
            logger.warning("%s is skipped for KV transfer (it is down): %s", name, why)
    calls = []
    for d, p in pairs:
        if d not in meta or p not in meta:
            continue
        for d_rank, d_actor in enumerate(replicas[d].ranks):
            for p_rank, p_actor in enumerate(replicas[p].ranks):
                calls.append((d, d_rank, p, p_rank, d_actor.add_peer.remote(meta[p][p_rank])))
                calls.append((p, p_rank, d, d_rank, p_actor.add_peer.remote(meta[d][d_rank])))
    for who, rank, peer, peer_rank, ref in calls:
        try:
            error = ray.get(ref, timeout=_PEER_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            error = str(exc)
        if not error:
            continue
        message = f"{who} rank {rank} cannot reach {peer} rank {peer_rank} for KV transfer"
        if not fresh or who == fresh:
            raise RuntimeError(f"{message}: {error}")
        # The first line: Ray's errors go on for a page.
        logger.warning("%s (it is down): %s", message, error.splitlines()[0])


def stop_replicas(replicas: Iterable[Replica]) -> None:
    """Stop every replica (leases released, NIXL agents closed), then free its resources."""
    replicas = [r for r in replicas if not r.is_killed]
    stops = []
    for replica in replicas:
        try:
            stops.append(replica.ranks[0].stop.remote())
        except Exception:
            logger.warning("cannot stop %s", replica.spec.name, exc_info=True)
    try:
        ray.get(stops, timeout=30)
        # Rank 0's loop sent its followers a stop command; wait for them to leave.
        ray.get([a.stop.remote() for r in replicas for a in r.ranks[1:]], timeout=30)
    except Exception:
        logger.warning("some workers did not stop cleanly", exc_info=True)
    for replica in replicas:
        kill_replica(replica)


def kill_replica(replica: Replica) -> None:
    """Kill every rank's process and remove the placement group (no graceful stop: used
    after a stop, or on a replica that already failed). Idempotent."""
    if replica.is_killed:
        return
    replica.is_killed = True
    for actor in replica.ranks:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            logger.debug("cannot kill a rank of %s", replica.spec.name, exc_info=True)
    try:
        remove_placement_group(replica.placement_group)
    except Exception:
        logger.warning("cannot remove the placement group of %s", replica.spec.name, exc_info=True)


def _get(ref, timeout_s: float, cancel: threading.Event | None):
    """``ray.get`` with a timeout that gives up early (Cancelled) once ``cancel`` is set."""
    if cancel is None:
        return ray.get(ref, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        if cancel.is_set():
            raise Cancelled("the cluster is shutting down")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout_s:g} s")
        ready, _ = ray.wait([ref], timeout=min(left, _CANCEL_POLL_S))
        if ready:
            return ray.get(ref)
