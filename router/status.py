"""What ``GetModelInfo`` and ``GetClusterStatus`` answer, built from the router's state.

Pure functions of the router's config and the workers' last reports (no I/O) into frozen
snapshots; the front end converts them to its wire format. The flow in ``router.py``
never needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.recovery import Recovery
from router.router import Router
from router.workers import WorkerView
from workers.protocol.wire import TierStatus


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # sorted


@dataclass(frozen=True)
class TierUsage:
    """One KV tier below a worker's pool, from its last report's ``TierStatus``."""

    name: str  # host | disk
    blocks: int
    bytes: int
    capacity_blocks: int
    capacity_bytes: int
    hits: int
    misses: int


@dataclass(frozen=True)
class ExpertLoadStatus:
    """One MoE layer's pairs routed to each expert, from the worker's last report."""

    layer: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    role: str  # prefill | decode
    healthy: bool
    state: str  # serving | draining | starting | stopping | restarting | failed | down
    restarts: int  # replicas that replaced a dead one under this name
    tensor_parallel: int
    pipeline_parallel: int
    num_running: int
    num_waiting: int
    num_incoming: int  # routed here and not yet arrived (decode: still in prefill)
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    # Speculative decoding since the worker's engine started (0 when off): verify steps,
    # tokens proposed, proposed tokens accepted.
    spec_num_steps: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    kv_tiers: tuple[TierUsage, ...] = ()  # lookup order; () when no tier is configured
    expert_load: tuple[ExpertLoadStatus, ...] = ()  # MoE models, by layer; () when dense


@dataclass(frozen=True)
class PoolStatus:
    role: str
    replicas: int
    healthy_replicas: int
    workers: tuple[WorkerStatus, ...]


@dataclass(frozen=True)
class ClusterStatus:
    model: str
    pools: tuple[PoolStatus, ...]  # prefill, then decode
    kv_transfer_backend: str
    policy: str
    disaggregation: str
    draining: bool
    speculative: str  # the decode pool's speculative decoding ("ngram, 4 tokens"); "" = off
    fault_injection: bool = False  # KV transfer faults injected on purpose (testing)


def model_info(router: Router) -> ModelInfo:
    cfg = router.config
    return ModelInfo(
        name=cfg.model_name,
        architecture=cfg.architecture,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=tuple(sorted(router.tokenizer.eos_token_ids)),
    )


def cluster_status(
    router: Router, tp_pp: dict[str, tuple[int, int]] | None = None
) -> ClusterStatus:
    """Pools, workers (health, TP/PP, load, KV blocks, KV tiers, speculative-decoding
    counts), transfer backend, policy, draining."""
    cfg = router.config
    pools = []
    for role, views in (("prefill", router.prefill), ("decode", router.decode)):
        tp, pp = (tp_pp or {}).get(role, (1, 1))
        pools.append(_pool(router.recovery, role, views, tp, pp))
    return ClusterStatus(
        model=cfg.model_name,
        pools=tuple(pools),
        kv_transfer_backend=cfg.kv_transfer_backend,
        policy=cfg.policy,
        disaggregation=cfg.disaggregation,
        draining=router.is_draining,
        speculative=cfg.speculative,
        fault_injection=cfg.fault_injection,
    )


def _state(view: WorkerView, recovery: Recovery | None) -> str:
    """``WorkerStatus.state``: serving | draining | starting | stopping | restarting |
    failed | down."""
    if view.is_alive:
        if view.is_draining:  # being removed (live scaling): takes nothing new
            return "draining"
        if view.is_healthy:
            return "serving"
        return "starting" if view.report is None else "stopping"
    if recovery is not None and recovery.is_restarting(view.name):
        return "restarting"
    if recovery is not None and view.name in recovery.failed:
        return "failed"
    return "down"


def _pool(
    recovery: Recovery | None, role: str, views: Sequence[WorkerView], tp: int, pp: int
) -> PoolStatus:
    workers = []
    for view in views:
        report = view.report
        workers.append(
            WorkerStatus(
                name=view.name,
                role=role,
                healthy=view.is_healthy,
                state=_state(view, recovery),
                restarts=recovery.num_restarts.get(view.name, 0) if recovery else 0,
                tensor_parallel=tp,
                pipeline_parallel=pp,
                num_running=report.num_running if report else 0,
                num_waiting=report.num_waiting if report else 0,
                num_incoming=view.num_incoming,
                kv_blocks_total=report.kv_blocks_total if report else 0,
                kv_blocks_used=report.kv_blocks_used if report else 0,
                kv_blocks_cached=report.kv_blocks_cached if report else 0,
                spec_num_steps=report.spec_num_steps if report else 0,
                spec_num_draft_tokens=report.spec_num_draft_tokens if report else 0,
                spec_num_accepted_tokens=report.spec_num_accepted_tokens if report else 0,
                kv_tiers=tuple(_tier_usage(t) for t in report.kv_tiers) if report else (),
                expert_load=tuple(ExpertLoadStatus(e.layer, e.tokens) for e in report.expert_load)
                if report
                else (),
            )
        )
    return PoolStatus(
        role=role,
        replicas=len(views),
        healthy_replicas=sum(v.is_healthy for v in views),
        workers=tuple(workers),
    )


def _tier_usage(tier: TierStatus) -> TierUsage:
    return TierUsage(
        name=tier.name,
        blocks=tier.blocks,
        bytes=tier.bytes,
        capacity_blocks=tier.capacity_blocks,
        capacity_bytes=tier.capacity_bytes,
        hits=tier.hits,
        misses=tier.misses,
    )
