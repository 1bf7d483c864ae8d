"""What ``GetModelInfo`` and ``GetClusterStatus`` answer, built from the router's state.

Pure functions of the router's config and the workers' last reports (no I/O): the
servicer calls them; the flow in ``router.py`` never needs them.
"""

from __future__ import annotations

from collections.abc import Sequence

from proto.baton.v1 import inference_pb2 as pb
from router.recovery import Recovery
from router.router import Router
from router.workers import WorkerView


def model_info(router: Router) -> pb.ModelInfo:
    cfg = router.config
    return pb.ModelInfo(
        name=cfg.model_name,
        architecture=cfg.architecture,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=sorted(router.tokenizer.eos_token_ids),
    )


def cluster_status(
    router: Router, tp_pp: dict[str, tuple[int, int]] | None = None
) -> pb.ClusterStatus:
    """Pools, workers (health, TP/PP, load, KV blocks), transfer backend, policy, draining."""
    cfg = router.config
    status = pb.ClusterStatus(
        model=cfg.model_name,
        kv_transfer_backend=cfg.kv_transfer_backend,
        policy=cfg.policy,
        disaggregation=cfg.disaggregation,
        draining=router.is_draining,
    )
    for role, views in (("prefill", router.prefill), ("decode", router.decode)):
        tp, pp = (tp_pp or {}).get(role, (1, 1))
        _add_pool(status, router.recovery, role, views, tp, pp)
    return status


def _state(view: WorkerView, recovery: Recovery | None) -> str:
    """``WorkerStatus.state``: serving | starting | stopping | restarting | failed | down."""
    if view.is_alive:
        if view.is_healthy:
            return "serving"
        return "starting" if view.report is None else "stopping"
    if recovery is not None and recovery.is_restarting(view.name):
        return "restarting"
    if recovery is not None and view.name in recovery.failed:
        return "failed"
    return "down"


def _add_pool(
    status: pb.ClusterStatus,
    recovery: Recovery | None,
    role: str,
    views: Sequence[WorkerView],
    tp: int,
    pp: int,
) -> None:
    pool = status.pools.add(role=role, replicas=len(views))
    for view in views:
        report = view.report
        pool.workers.add(
            name=view.name,
            role=role,
            healthy=view.is_healthy,
            state=_state(view, recovery),
            restarts=recovery.num_restarts.get(view.name, 0) if recovery else 0,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            num_running=report.num_running if report else 0,
            num_waiting=report.num_waiting if report else 0,
            kv_blocks_total=report.kv_blocks_total if report else 0,
            kv_blocks_used=report.kv_blocks_used if report else 0,
            kv_blocks_cached=report.kv_blocks_cached if report else 0,
        )
    pool.healthy_replicas = sum(v.is_healthy for v in views)
