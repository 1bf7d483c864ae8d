"""The planner on Ray: its actuator, and its wiring into the router at bring-up.

:class:`RayActuator` is the planner's ``Scaler`` (``cluster/planner/actuator.py``) on a Ray
cluster: the router's live scaling (``router/scaling.py``, whose ``RayProvisioner`` places
and stops replicas), preceded by ``ray.autoscaler.sdk.request_resources`` with the
bundles of the target pools, so that a Ray autoscaler (or KubeRay's) adds the nodes a
scale-up needs, and may take back those a scale-down freed. Ray reads the request as the
cluster's whole demand (it replaces the previous one). On a Ray instance Baton started
itself there is no autoscaler: the call is skipped, and the log says so once.
"""

from __future__ import annotations

import logging

import ray

from cluster.config import ClusterConfig
from cluster.planner.policy import Planner
from cluster.planner.profile import StepProfile, load_profile
from cluster.planner.simulator import PoolLimits
from cluster.planner.step_model import StepModel
from cluster.planner_feed import LoadFeed
from cluster.planner_loop import PlannerLoop
from cluster.planner_metrics import PlannerMetrics
from router.router import Router
from router.scaling import Scaling
from workers.serving.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

Templates = dict[str, tuple[WorkerSpec, dict[str, float]]]  # role -> (spec, bundle per rank)


def pool_bundles(templates: Templates, prefill: int, decode: int) -> list[dict[str, float]]:
    """One bundle per rank of ``prefill`` and ``decode`` replicas of the pools."""
    bundles: list[dict[str, float]] = []
    for role, count in (("prefill", prefill), ("decode", decode)):
        spec, bundle = templates[role]
        bundles += [dict(bundle) for _ in range(spec.num_ranks * count)]
    return bundles


class RayActuator:
    """The planner's Scaler on Ray: ask the autoscaler for room, then scale."""

    def __init__(self, scaling: Scaling, templates: Templates, has_autoscaler: bool) -> None:
        """``has_autoscaler``: False on a Ray instance Baton started (no autoscaler)."""
        self.scaling = scaling
        self.templates = templates
        self.has_autoscaler = has_autoscaler
        self._said_none = False

    def current(self) -> tuple[int, int]:
        return self.scaling.current()

    async def scale_to(self, prefill: int, decode: int):
        self.request_nodes(prefill, decode)
        return await self.scaling.scale_to(prefill, decode)

    def request_nodes(self, prefill: int, decode: int) -> bool:
        """Tell the autoscaler the pools' whole demand; False when nobody is asked."""
        if not self.has_autoscaler or not ray.is_initialized():
            if not self._said_none:
                logger.info("planner: no Ray autoscaler here; the nodes are what they are")
                self._said_none = True
            return False
        bundles = pool_bundles(self.templates, prefill, decode)
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception as exc:  # an old Ray, or a cluster without its GCS client
            logger.warning("planner: request_resources failed (%s); scaling anyway", exc)
            return False
        logger.info("planner: asked the autoscaler for %d bundles", len(bundles))
        return True


def seed_from_profile(model: StepModel, profile: StepProfile, templates: Templates) -> int:
    """Seed the fits with ``baton profile``'s records; a profile of another model or of
    other step-shaping settings is still used (serving corrects it), with a warning
    naming what differs."""
    added = model.seed(profile.steps())
    spec = templates["decode"][0]
    differs = [
        key
        for key, value in profile.engine.items()
        if key not in ("dtype", "max_model_len")  # resolved at load: "auto" is not a value
        and hasattr(spec.engine, key)
        and str(getattr(spec.engine, key)) != str(value)
    ]
    if profile.model != spec.model_id:
        differs.insert(0, f"model ({profile.model!r}, serving {spec.model_id!r})")
    if differs:
        logger.warning(
            "planner.profile: measured with other settings (%s); the fits start from it "
            "and follow the served steps",
            ", ".join(differs),
        )
    logger.info("planner: %d step records from the profile of %s", added, profile.created)
    return added


def attach_planner(
    router: Router, config: ClusterConfig, templates: Templates, has_autoscaler: bool
) -> PlannerLoop:
    """Wire the planner into ``router`` (its observer and its background loop, started and
    stopped with it); the router must have live scaling (a provisioner)."""
    if router.scaling is None:
        raise RuntimeError("planner.enabled needs live scaling (a provisioner)")
    section = config.planner
    limits = PoolLimits(
        max_batched_tokens=config.prefill.max_num_batched_tokens,
        max_num_seqs=config.decode.max_num_seqs,
    )
    model = StepModel(section.warmup_steps, spread_records=section.spread_records)
    if section.profile is not None:
        seed_from_profile(model, load_profile(section.profile), templates)
    planner = Planner(section.policy_config(limits), model)
    feed = LoadFeed(section.interval_seconds)
    actuator = RayActuator(router.scaling, templates, has_autoscaler)
    metrics = PlannerMetrics(router.config.model_name)
    loop = PlannerLoop(planner, feed, actuator, section.interval_seconds, metrics)
    router.observer, router.planner = feed, loop
    logger.warning(
        "planner on: every %g s, p90 TTFT <= %g ms and ITL <= %g ms, at most %d workers",
        section.interval_seconds,
        section.ttft_p90_ms,
        section.itl_p90_ms,
        section.max_workers,
    )
    return loop
