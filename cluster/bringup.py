"""Bring a cluster config up on Ray: worker pools in placement groups, KV peers, the router.

Ray: connect to the cluster in ``RAY_ADDRESS`` (what ``ray job submit`` sets) or to a
running local one (``address="auto"``); else start a local instance, which keeps Ray's
token authentication on. Each worker replica gets its own placement group, a bundle
per pipeline stage (a stage's ``tensor_parallel`` ranks on one node, the stages on one
node or several), one actor per rank, and every rank of every decode worker is
introduced to every rank of every prefill worker before the router starts
(``cluster/replicas.py``). Workers push their token events to the router over an event
channel (``workers/serving/channel.py``) whose listener binds to loopback when the whole Ray
cluster is this node, else to this node's Ray address; connections must present the
listener's random token, and run over TLS with a certificate the router makes (and the
workers pin) when they leave the host (``router.event_channel_tls``). The router restarts a replica that dies through
``cluster/restart.py``. Tear-down stops the actors (their leases released), removes the
placement groups and shuts down a Ray instance that we started.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field, replace

import ray
from ray._private import ray_constants

from cluster.config import ClusterConfig, PoolSection, engine_config, transfer_config
from cluster.config_schema import replaced
from cluster.metrics_exporter import NodeExporters, replica_nodes
from cluster.model_source import resolve_draft_model_dir, resolve_model_dir, served_name
from cluster.parallel_check import check_pool_parallel
from cluster.replicas import (
    RUN_ID,
    Replica,
    check_agree,
    dp_group_specs,
    introduce,
    place_replica,
    rank_bundle,
    start_replicas,
    stop_replicas,
    wait_ready,
)
from cluster.restart import RayRestarter
from cluster.scaling import RayProvisioner
from router.config import RouterConfig
from router.policy import KVWeights
from router.recovery import RestartPolicy
from router.router import Router
from workers.models.arch_config import ArchConfig
from workers.protocol.wire import WorkerInfo
from workers.serving.channel import ChannelListener
from workers.serving.metrics_node import default_root, node_directory, record_into
from workers.serving.ray_worker import RayWorkerClient
from workers.serving.worker_spec import WorkerSpec
from workers.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_NAMESPACE = "baton"


@dataclass
class Cluster:
    config: ClusterConfig
    router: Router
    listener: ChannelListener | None  # the workers' event channels; set once they run
    replicas: dict[str, Replica] = field(default_factory=dict)  # name -> running replica
    restarter: RayRestarter | None = None
    provisioner: RayProvisioner | None = None  # live scaling (cluster/scaling.py)
    exporters: NodeExporters | None = None  # None: metrics.enabled is false
    started_ray: bool = False

    def shutdown(self) -> None:
        """Stop every worker (leases released, NIXL agents closed) and free the resources;
        a restart in progress gives up first (the router no longer starts one)."""
        self.stop_workers()
        if self.started_ray:
            ray.shutdown()

    def stop_workers(self) -> None:
        """:meth:`shutdown` but Ray itself: blocks on Ray (a dead head: up to 60 s)."""
        if self.restarter is not None:
            self.restarter.close()
        stop_replicas(self.replicas.values())
        self.replicas.clear()
        if self.exporters is not None:
            self.exporters.close()

    def is_ray_head_gone(self) -> bool:
        """Whether the Ray instance this process started lost its GCS or raylet: they are
        our children, in our process group and cgroup, so a SIGTERM to the group (``kill
        -TERM -PGID``, ``timeout``) or the cgroup (systemd's default KillMode) ends them
        with us. Then every Ray call blocks (the driver waits 60 s for the GCS) and the
        workers are gone. False for a Ray cluster we joined."""
        node = ray._private.worker._global_node if self.started_ray else None
        if node is None:
            return False
        for kind in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET):
            if any(info.process.poll() is not None for info in node.all_processes.get(kind, ())):
                return True
        return False


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
    # Ray's processes (GCS, raylet, monitors; the raylet's workers after them) are our
    # children: in our process group and cgroup. A SIGTERM to the group (`timeout`,
    # `kill -TERM -PGID`) or the cgroup (systemd's default KillMode) would stop the head
    # under the drain: the raylet takes ~10 s to die, the GCS stops answering, every Ray
    # call of the drain then waits 60 s for it and ends in a traceback. They inherit a
    # blocked SIGTERM from this thread (as Ray blocks SIGINT for them), so only we see it
    # and drain; ray.shutdown() ends them (SIGKILL after 1 s each). Measured: group
    # SIGTERM 60 s + traceback before, a full drain after; ray.shutdown() 1.2 -> 5.5 s.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        # Logical CPUs: every worker reserves one; they need not match the physical cores.
        ray.init(
            address="local",
            num_cpus=max(num_cpus, os.cpu_count() or 1),
            namespace=_NAMESPACE,
            include_dashboard=False,
            logging_level="WARNING",
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return True


def local_rank_threads(cpus: int, reserved_cpus: int, num_ranks: int) -> int:
    """Torch threads of each rank on a local Ray instance Baton started: the cores but
    those kept for the router, shared evenly, at least one. Why keep one: with every core
    running a rank's math threads, the router's per-token work preempts one of them and
    the whole parallel step waits for it (bench/RESULTS.md: one stream's TPOT 11.8 ->
    7.1 ms on 2 cores)."""
    return max(1, (cpus - reserved_cpus) // num_ranks)


def bring_up(config: ClusterConfig) -> Cluster:
    """Start the workers and build the router (not yet polling: ``await router.start()``)."""
    model_dir = resolve_model_dir(config.model.path)
    name = served_name(config.model.name, model_dir)
    arch = ArchConfig.from_model_dir(model_dir)
    speculative = config.decode.speculative
    if speculative.draft_model is not None:  # checked here, like model.path: on this machine
        draft_dir = resolve_draft_model_dir(speculative.draft_model, arch.vocab_size)
        speculative = replaced(speculative, draft_model=str(draft_dir))
        config = replaced(config, decode=replaced(config.decode, speculative=speculative))
    pools = (("prefill", config.prefill), ("decode", config.decode))
    # decode.attention: data_parallel: each replica is a group of expert_parallel one-rank
    # workers (config.decode.data_parallel; 1 otherwise).
    num_ranks = sum(p.replicas * p.tensor_parallel * p.pipeline_parallel for _, p in pools)
    num_ranks += config.decode.replicas * (config.decode.data_parallel - 1)
    # A local Ray instance of ours gets CPUs for as many workers as live scaling may reach.
    most_ranks = max(p.tensor_parallel * p.pipeline_parallel for _, p in pools)
    most_workers = config.router.scale_max_replicas
    if config.planner.enabled:  # the planner's budget, where scaling sets no bound
        most_workers = most_workers or config.planner.max_workers
    started = connect_ray(max(num_ranks, most_workers * most_ranks))
    cluster = Cluster(config, router=None, listener=None, started_ray=started)  # type: ignore[arg-type]
    try:
        metrics_root = ""
        here = ray.get_runtime_context().get_node_id()  # this process's (the router's) node
        if config.metrics.enabled:
            metrics_root = default_root(RUN_ID)
            m = config.metrics
            cluster.exporters = NodeExporters(metrics_root, m.host, m.port, RUN_ID)
            # This process (the router) records into its node's directory too.
            record_into(node_directory(metrics_root, here))
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        node_gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]]
        threads = (
            local_rank_threads(os.cpu_count() or 1, config.router.reserved_cpus, num_ranks)
            if started
            else 0
        )
        templates: dict[str, tuple[WorkerSpec, dict[str, float]]] = {}
        for role, pool in pools:
            device = pool.device if pool.device != "auto" else ("cuda" if has_gpu else "cpu")
            check_pool_parallel(role, pool, arch, device, node_gpus)
            spec = _spec(config, pool, f"{role}-0", role, str(model_dir), name, device, threads)
            spec = replace(spec, metrics_dir=metrics_root)  # "" = no metrics
            templates[role] = (spec, rank_bundle(device, pool.node_resource))
            for index in range(pool.replicas):
                if spec.data_parallel > 1:  # a group of one-rank workers, started together
                    for member in dp_group_specs(spec, role, index):
                        cluster.replicas[member.name] = place_replica(member, templates[role][1])
                    continue
                worker = f"{role}-{index}"
                cluster.replicas[worker] = place_replica(
                    replace(spec, name=worker), templates[role][1]
                )
        replicas = cluster.replicas
        if cluster.exporters is not None:
            nodes = [here]
            nodes += [n for r in replicas.values() for n in replica_nodes(r.placement_group)]
            cluster.exporters.ensure(nodes)
        start_replicas(replicas)
        info = check_agree(wait_ready(replicas))
        # Only now, with every worker placed, is it known whether they all run on this node.
        host = _channel_host()
        tls = config.router.event_channel_tls
        listener = ChannelListener(host, tls=tls == "on" or (tls == "auto" and host != "127.0.0.1"))
        cluster.listener = listener
        logger.info(
            "event channel on %s: %s",
            host,
            "TLS 1.3, certificate pinned" if listener.cert_pem else "TCP",
        )
        clients: dict[str, list[RayWorkerClient]] = {"prefill": [], "decode": []}
        for worker, replica in replicas.items():
            role = replica.spec.role
            clients[role].append(RayWorkerClient(worker, role, replica.ranks[0], listener))
        pairs = [(d.name, p.name) for d in clients["decode"] for p in clients["prefill"]]
        # Peer pull (G4, router/peer_prefix.py): any worker may read any other's lease.
        peer_sharing = config.kv_cache.peer_sharing
        if peer_sharing:
            for pool in clients.values():
                pairs += [(a.name, b.name) for i, a in enumerate(pool) for b in pool[i + 1 :]]
        introduce(replicas, pairs)
        cluster.restarter = RayRestarter(
            replicas, listener, info, cluster.exporters, peer_sharing=peer_sharing
        )
        cluster.provisioner = RayProvisioner(cluster.restarter, replicas, templates)
        cluster.router = Router(
            router_config(config, name, info),
            Tokenizer.from_dir(model_dir),
            clients["prefill"],
            clients["decode"],
            # No restarter: a dead worker stays out of routing (state "down").
            restarter=cluster.restarter if config.router.restart_attempts > 0 else None,
            restart_policy=RestartPolicy(
                max_attempts=config.router.restart_attempts,
                backoff_s=config.router.restart_backoff_seconds,
                max_backoff_s=config.router.restart_max_backoff_seconds,
            ),
            tracing=_tracing(config),
            # A data-parallel decode group's workers start and stop together: no live
            # scaling by single workers (docs/moe.md, "Data-parallel attention").
            provisioner=cluster.provisioner if config.decode.data_parallel == 1 else None,
        )
        if config.planner.enabled:  # docs/planner.md; on a Ray of our own: no autoscaler
            from cluster.planner_ray import attach_planner

            attach_planner(cluster.router, config, templates, has_autoscaler=not started)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _tracing(config: ClusterConfig):
    """The router's tracer (router/tracing.py) when ``tracing.enabled``; else None."""
    settings = config.tracing.resolved()
    if settings is None:
        return None
    from router.tracing import Tracing

    return Tracing(settings)


def router_config(config: ClusterConfig, name: str, info: WorkerInfo) -> RouterConfig:
    """The router's settings: the config's ``router`` section (and the few others it
    needs), with what the workers resolved at start-up (``info``, which every worker
    agreed on) and the served model ``name``."""
    return RouterConfig(
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
        kv_weights=KVWeights(
            overlap_weight=config.router.kv_overlap_weight,
            balance_abs_requests=config.router.kv_balance_abs_requests,
            balance_rel=config.router.kv_balance_rel,
            host_tier_weight=config.router.kv_host_tier_weight,
            disk_tier_weight=config.router.kv_disk_tier_weight,
            receive_weight=config.router.kv_receive_weight,
        ),
        max_queued_requests=config.router.max_queued_requests,
        max_queued_share_per_key=config.router.max_queued_share_per_key,
        requests_per_second_per_key=config.router.requests_per_second_per_key,
        request_burst_per_key=config.router.request_burst_per_key,
        migration_limit=config.router.migration_limit,
        scale_down_grace_s=config.router.scale_down_grace_seconds,
        scale_max_replicas=config.router.scale_max_replicas,
        request_timeout_s=config.router.request_timeout_seconds,
        request_idle_timeout_s=config.router.request_idle_timeout_seconds,
        kv_transfer_backend=config.kv_transfer.backend,
        speculative=config.decode.speculative.summary(),
        peer_sharing=config.kv_cache.peer_sharing,
        peer_min_blocks=config.router.peer_min_blocks,
        peer_export_timeout_s=config.router.peer_export_timeout_seconds,
        # The workers inherit this process's environment (Ray starts them from it).
        fault_injection=config.kv_transfer.allow_fault_injection
        and bool(os.environ.get("BATON_KV_FAULTS", "").strip()),
    )


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
    return WorkerSpec(
        name=worker,
        role=role,
        model_id=name,
        engine=engine_config(config, pool, model=model_dir, device=device),
        kv_transfer=transfer_config(config),
        num_threads=threads if device == "cpu" else 0,
        tensor_parallel=pool.tensor_parallel,
        pipeline_parallel=pool.pipeline_parallel,
        dst_tensor_parallel=config.decode.tensor_parallel,
        dst_pipeline_parallel=config.decode.pipeline_parallel,
        data_parallel=config.decode.data_parallel if role == "decode" else 1,
    )
