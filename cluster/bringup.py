"""Bring a cluster config up on Ray: worker pools in placement groups, KV peers, the router.

Ray: connect to the cluster in ``RAY_ADDRESS`` (what ``ray job submit`` sets) or to a
running local one (``address="auto"``); else start a local instance, which keeps Ray's
token authentication on. Each worker replica gets its own placement group, its
``tensor_parallel`` ranks packed on one node (STRICT_PACK), one actor per rank: rank 0
(``WorkerActor``) schedules and talks to the router, the others (``RankActor``) follow
it. Every rank has its own KV agent: every rank of every decode worker is introduced to
every rank of every prefill worker (KV-transfer metadata both ways) before the router
starts. Workers
push their token events to the router over an event channel (``workers/channel.py``)
whose listener binds to loopback when the whole Ray cluster is this node, else to this
node's Ray address; connections must present the listener's random token.
Tear-down stops the actors (their leases released), removes the placement groups and
shuts down a Ray instance that we started.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, PoolSection
from cluster.model_source import resolve_model_dir, served_name
from cluster.parallel_check import check_pool_parallel
from router.router import Router, RouterConfig
from workers.channel import ChannelListener
from workers.models.arch_config import ArchConfig
from workers.ray_rank import RankActor
from workers.ray_worker import ACTOR_CONCURRENCY, RayWorkerClient, WorkerActor
from workers.tokenizer import Tokenizer
from workers.wire import WorkerInfo, decode_as
from workers.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # loading weights of a large model can take minutes
_NAMESPACE = "baton"
_RUN_ID = uuid.uuid4().hex[:8]


@dataclass
class Cluster:
    config: ClusterConfig
    router: Router
    listener: ChannelListener | None  # the workers' event channels; set once they run
    actors: dict[str, object] = field(default_factory=dict)  # name -> rank 0's actor
    ranks: dict[str, list] = field(default_factory=dict)  # name -> every rank's actor
    placement_groups: list = field(default_factory=list)
    started_ray: bool = False

    def shutdown(self) -> None:
        """Stop every worker (leases released, NIXL agents closed) and free the resources."""
        stops = []
        for name, actor in self.actors.items():
            try:
                stops.append(actor.stop.remote())
            except Exception:
                logger.warning("cannot stop %s", name, exc_info=True)
        try:
            ray.get(stops, timeout=30)
            # Rank 0's loop sent its followers a stop command; wait for them to leave.
            ray.get([a.stop.remote() for r in self.ranks.values() for a in r[1:]], timeout=30)
        except Exception:
            logger.warning("some workers did not stop cleanly", exc_info=True)
        for ranks in self.ranks.values():
            for actor in ranks:
                ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.actors.clear()
        self.ranks.clear()
        self.placement_groups.clear()
        if self.started_ray:
            ray.shutdown()


def connect_ray(num_cpus: int) -> bool:
    """Join the configured/running Ray cluster, else start a local one; True if we started it."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, namespace=_NAMESPACE, logging_level="WARNING")
        return False
    if address != "local":  # RAY_ADDRESS=local: always a new instance of our own
        try:
            ray.init(address="auto", namespace=_NAMESPACE, logging_level="WARNING")
            return False
        except ConnectionError:
            pass
    # Logical CPUs: every worker reserves one; they need not match the physical cores.
    ray.init(
        address="local",
        num_cpus=max(num_cpus, os.cpu_count() or 1),
        namespace=_NAMESPACE,
        include_dashboard=False,
        logging_level="WARNING",
    )
    return True


def bring_up(config: ClusterConfig) -> Cluster:
    """Start the workers and build the router (not yet polling: ``await router.start()``)."""
    model_dir = resolve_model_dir(config.model.path)
    name = served_name(config.model.name, model_dir)
    arch = ArchConfig.from_model_dir(model_dir)
    pools = (("prefill", config.prefill), ("decode", config.decode))
    num_ranks = sum(p.replicas * p.tensor_parallel * p.pipeline_parallel for _, p in pools)
    started = connect_ray(num_ranks)
    cluster = Cluster(config, router=None, listener=None, started_ray=started)  # type: ignore[arg-type]
    try:
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        gpus_per_node = max((n["Resources"].get("GPU", 0) for n in ray.nodes()), default=0)
        # Local CPU ranks share the machine's cores; give each its share of threads.
        threads = max(1, (os.cpu_count() or 1) // num_ranks) if started else 0
        roles: dict[str, str] = {}
        for role, pool in pools:
            device = pool.device if pool.device != "auto" else ("cuda" if has_gpu else "cpu")
            check_pool_parallel(role, pool, arch, device, int(gpus_per_node))
            for index in range(pool.replicas):
                worker = f"{role}-{index}"
                spec = _spec(config, pool, worker, role, str(model_dir), name, device, threads)
                ranks, pg = _place_replica(spec, device)
                cluster.actors[worker] = ranks[0]
                cluster.ranks[worker] = ranks
                cluster.placement_groups.append(pg)
                roles[worker] = role
        _start_replicas(cluster.ranks)
        infos = _wait_ready(cluster.actors)
        # Only now, with every worker placed, is it known whether they all run on this node.
        listener = cluster.listener = ChannelListener(_channel_host())
        clients: dict[str, list[RayWorkerClient]] = {"prefill": [], "decode": []}
        for worker, role in roles.items():
            clients[role].append(RayWorkerClient(worker, role, cluster.actors[worker], listener))
        _introduce(cluster.ranks, clients)
        info = _check_agree(infos)
        cluster.router = Router(
            RouterConfig(
                model_name=name,
                architecture=info.architecture,
                dtype=info.dtype,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
                block_size=info.block_size,
                policy=config.router.policy,
                disaggregation=config.router.disaggregation,
                auto_local_prefill_tokens=config.router.auto_local_prefill_tokens,
                saturated_queue=config.router.auto_saturated_queue,
                max_queued_requests=config.router.max_queued_requests,
                kv_transfer_backend=config.kv_transfer.backend,
            ),
            Tokenizer.from_dir(model_dir),
            clients["prefill"],
            clients["decode"],
        )
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _channel_host() -> str:
    """Where workers can reach this process: loopback unless Ray spans other nodes."""
    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if all(n.get("NodeManagerAddress") == here for n in nodes):
        return "127.0.0.1"
    return here


def _spec(
    config: ClusterConfig,
    pool: PoolSection,
    worker: str,
    role: str,
    model_dir: str,
    name: str,
    device: str,
    threads: int,
) -> WorkerSpec:
    kv = config.kv_cache
    return WorkerSpec(
        name=worker,
        role=role,
        model=model_dir,
        model_id=name,
        dtype=config.model.dtype,
        device=device,
        max_model_len=config.model.max_model_len,
        block_size=kv.block_size,
        num_kv_blocks=kv.num_blocks,
        kv_cache_memory_gib=kv.cpu_memory_gib,
        gpu_memory_fraction=kv.gpu_memory_fraction,
        max_num_seqs=pool.max_num_seqs,
        max_num_batched_tokens=max(pool.max_num_batched_tokens, pool.max_num_seqs),
        enable_prefix_caching=kv.enable_prefix_caching,
        kv_backend=config.kv_transfer.backend,
        kv_direction=config.kv_transfer.direction,
        lease_seconds=config.kv_transfer.lease_seconds,
        transfer_timeout_s=config.kv_transfer.timeout_seconds,
        on_failure=config.kv_transfer.on_failure,
        num_threads=threads if device == "cpu" else 0,
        tensor_parallel=pool.tensor_parallel,
        dst_tensor_parallel=config.decode.tensor_parallel,
    )


def _place_replica(spec: WorkerSpec, device: str) -> tuple[list, object]:
    """One placement group with a bundle per rank, and each rank's actor (not started)."""
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if device == "cuda" else {})}
    # Unique per serving process: two deployments may share one Ray cluster.
    ray_name = f"baton-{_RUN_ID}-{spec.name}"
    pg = placement_group([bundle] * spec.tensor_parallel, strategy="STRICT_PACK", name=ray_name)
    try:
        ray.get(pg.ready(), timeout=_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"{spec.role}: the Ray cluster cannot place worker {spec.name} "
            f"({spec.tensor_parallel} x {bundle} on one node); "
            f"resources: {ray.available_resources()}"
        ) from None
    ranks = []
    for rank in range(spec.tensor_parallel):
        options = dict(
            name=ray_name if rank == 0 else f"{ray_name}-rank{rank}",
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=ACTOR_CONCURRENCY,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank
            ),
        )
        if rank == 0:
            ranks.append(ray.remote(WorkerActor).options(**options).remote(spec.to_bytes()))
        else:
            ranks.append(ray.remote(RankActor).options(**options).remote(spec.to_bytes(), rank))
    return ranks, pg


def _start_replicas(replicas: dict[str, list]) -> None:
    """Every rank loads its shard; a replica's ranks meet at its rank 0 (all at once:
    joining the process group waits for every rank)."""
    calls = []
    for name, ranks in replicas.items():
        address, port = "", 0
        if len(ranks) > 1:
            address, port = ray.get(ranks[0].rendezvous.remote(), timeout=_READY_TIMEOUT_S)
        calls += [(name, r, a.start.remote(address, port)) for r, a in enumerate(ranks)]
    for name, rank, ref in calls:
        try:
            error = ray.get(ref, timeout=_READY_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            error = str(exc)
        if error:
            raise RuntimeError(f"worker {name} (rank {rank}) failed to start: {error}")


def _wait_ready(actors: dict[str, object]) -> list[WorkerInfo]:
    refs = {name: actor.describe.remote() for name, actor in actors.items()}  # type: ignore[attr-defined]
    infos = []
    for name, ref in refs.items():
        try:
            infos.append(decode_as(ray.get(ref, timeout=_READY_TIMEOUT_S), WorkerInfo))
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"worker {name} failed to start: {exc}") from None
    return infos


def _introduce(replicas: dict[str, list], clients: dict[str, list[RayWorkerClient]]) -> None:
    """Every rank of every decode worker and every rank of every prefill worker exchange
    KV-transfer metadata (each rank has its own agent)."""
    meta = {
        name: ray.get([a.kv_metadata.remote() for a in ranks], timeout=60)
        for name, ranks in replicas.items()
    }
    calls = []
    for p in clients["prefill"]:
        for d in clients["decode"]:
            for d_rank, d_actor in enumerate(replicas[d.name]):
                for p_rank, p_actor in enumerate(replicas[p.name]):
                    who, peer = f"{d.name} rank {d_rank}", f"{p.name} rank {p_rank}"
                    calls.append((who, peer, d_actor.add_peer.remote(meta[p.name][p_rank])))
                    calls.append((peer, who, p_actor.add_peer.remote(meta[d.name][d_rank])))
    for who, peer, ref in calls:
        error = ray.get(ref, timeout=60)
        if error:
            raise RuntimeError(f"{who} cannot reach {peer} for KV transfer: {error}")


def _check_agree(infos: list[WorkerInfo]) -> WorkerInfo:
    first = infos[0]
    for info in infos[1:]:
        for key in ("architecture", "dtype", "max_model_len", "vocab_size", "block_size"):
            if getattr(info, key) != getattr(first, key):
                raise RuntimeError(
                    f"workers disagree on {key}: {first.name} has {getattr(first, key)}, "
                    f"{info.name} has {getattr(info, key)}"
                )
    return first
