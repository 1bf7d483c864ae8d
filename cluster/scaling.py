"""Live scaling on Ray: the cluster's side of ``router/scaling.py`` (its ``Provisioner``).

The router decides which worker joins or leaves and when (a new one is routed to after
its first healthy report; a leaving one drains first); this module places and stops
replicas, with the code bring-up and restarts use (``cluster/replicas.py``):

- **add**: a new replica of the pool, with the pool's spec under a name never used in
  this run (``prefill-2``, ...; Ray may still hold a stopped actor's name), placed and
  started, checked against what every worker described at bring-up, and introduced rank
  by rank to every replica of the other pool, both ways (``RayRestarter.bring_in``);
  registered in the cluster's registry so that shutdown stops it;
- **remove**: stop the replica (its shutdown aborts what is left, releases its leases,
  frees every KV tier and closes its KV agents), remove its placement group, forget it;
- **check_room**: whether the cluster's free resources hold the new replicas' bundles.

Every step runs on the restart thread (``RayRestarter.run_exclusive``): a replica that
restarts while another joins cannot miss it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import replace

import ray

from cluster.replicas import Replica, stop_replicas
from cluster.restart import RayRestarter
from router.scaling import ScaleError
from workers.serving.ray_worker import RayWorkerClient
from workers.serving.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


class RayProvisioner:
    def __init__(
        self,
        restarter: RayRestarter,
        replicas: dict[str, Replica],
        templates: dict[str, tuple[WorkerSpec, dict[str, float]]],
    ):
        """``replicas``: the cluster's registry (shared with the restarter and shutdown);
        ``templates``: each pool's spec and per-rank bundle, as bring-up made them."""
        self._restarter = restarter
        self._replicas = replicas
        self._templates = templates
        self._next_index = Counter(
            {role: sum(r.spec.role == role for r in replicas.values()) for role in templates}
        )

    async def check_room(self, num_prefill: int, num_decode: int) -> None:
        need: Counter[str] = Counter()
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            spec, bundle = self._templates[role]
            for key, value in bundle.items():
                need[key] += value * spec.num_ranks * count
        free = await asyncio.to_thread(ray.available_resources)
        short = {k: v for k, v in need.items() if v > free.get(k, 0.0) + 1e-9}
        if short:
            have = {k: round(free.get(k, 0.0), 3) for k in short}
            raise ScaleError(
                "no_room",
                f"the cluster has no room for {num_prefill} more prefill and {num_decode} "
                f"more decode workers: they need {dict(need)}, free: {have}",
            )

    async def add(self, role: str) -> RayWorkerClient:
        name = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        replica = await self._restarter.run_exclusive(self._add, name, role)
        return self._restarter.client(name, replica)

    def _add(self, name: str, role: str) -> Replica:
        spec, bundle = self._templates[role]
        logger.warning("adding %s (%s, %d ranks)", name, role, spec.num_ranks)
        replica = self._restarter.bring_in(name, replace(spec, name=name), bundle)
        self._replicas[name] = replica
        return replica

    async def remove(self, name: str) -> None:
        await self._restarter.run_exclusive(self._remove, name)

    def _remove(self, name: str) -> None:
        replica = self._replicas.pop(name, None)
        if replica is not None:
            stop_replicas([replica])
            logger.warning("stopped %s", name)
