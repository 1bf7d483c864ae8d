"""Restarting a dead worker replica on Ray (implements ``router.recovery.Restarter``).

The router decides *when* (a worker's event channel closed or its engine loop failed) and
how often to try (``router/recovery.py``); this module does the Ray side of one attempt:

1. kill whatever is left of the replica (a rank 0 whose loop failed, followers whose rank 0
   died) and remove its placement group;
2. place and start a fresh replica with the same spec (``cluster/replicas.py``, the code
   bring-up uses) and check it agrees with the running cluster;
3. introduce each of its ranks to every rank of every replica of the other pool, both
   ways. A peer's connector replaces the dead incarnation's agent with the new one (same
   worker id), so nothing reads from or notifies the dead agents afterwards;
4. hand back a client for the router, which opens the event channel.

Every Ray call blocks, so attempts run on one thread of their own, one at a time: the
event loop keeps serving, and two replicas that restart together cannot miss each other
(the second introduces itself to the first one's new ranks). Live scaling's new and
retired replicas (``cluster/scaling.py``) take the same thread (``run_exclusive``,
``bring_in``). ``close`` (at shutdown) makes an attempt in progress give up and remove
what it placed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from cluster.metrics_exporter import NodeExporters, replica_nodes
from cluster.replicas import (
    Cancelled,
    Replica,
    check_agree,
    dp_group_members,
    introduce,
    kill_replica,
    place_replica,
    start_replicas,
    wait_ready,
)
from workers.protocol.wire import WorkerInfo
from workers.serving.channel import ChannelListener
from workers.serving.ray_worker import RayWorkerClient
from workers.serving.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


class RayRestarter:
    def __init__(
        self,
        replicas: dict[str, Replica],
        listener: ChannelListener,
        reference: WorkerInfo,
        exporters: NodeExporters | None = None,
        peer_sharing: bool = False,
    ):
        """``replicas`` is the cluster's registry (name -> running replica): a restart
        replaces the entry, so that shutdown stops the new ranks. ``reference``: what
        every worker described at bring-up; a replacement must agree with it.
        ``exporters``: the run's metrics endpoints; a replica placed on a node new to the
        run gets one there. ``peer_sharing`` (G4): a new replica is introduced to every
        other worker, of its own pool too."""
        self._replicas = replicas
        self._peer_sharing = peer_sharing
        self._exporters = exporters
        self._listener = listener
        self._reference = reference
        self._generations: Counter[str] = Counter()
        # Data-parallel workers restarted with their group whose router client is not out
        # yet: the router's own ask for them takes the running one (_restart_group).
        self._fresh_members: set[str] = set()
        self._closing = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-restart")

    async def restart(self, name: str) -> RayWorkerClient:
        """Replace replica ``name`` with a fresh one; its client, not yet started."""
        replica = await self.run_exclusive(self._restart, name)
        return self.client(name, replica)

    def client(self, name: str, replica: Replica) -> RayWorkerClient:
        """The router's client of ``replica``'s rank 0 (not yet started)."""
        return RayWorkerClient(name, replica.spec.role, replica.ranks[0], self._listener)

    async def run_exclusive(self, fn, *args):
        """``fn(*args)`` on the restart thread, after what runs there (one at a time)."""
        if self._closing.is_set():
            raise Cancelled("the cluster is shutting down")
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def close(self) -> None:
        """Shutdown: no attempt starts any more; wait for the one in progress, which gives
        up and removes what it placed (or finished, and shutdown stops it with the rest)."""
        self._closing.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _restart(self, name: str) -> Replica:
        old = self._replicas[name]
        spec = old.spec
        if spec.data_parallel > 1:
            return self._restart_group(name)
        logger.warning("restarting %s (%s, %d ranks)", name, spec.role, spec.num_ranks)
        kill_replica(old)  # frees its bundles for the new placement group
        self._generations[name] += 1
        replica = self.bring_in(name, spec, old.bundle, self._generations[name])
        # Registered only now: until here the old (killed) entry stands, and killing it
        # again at shutdown is harmless.
        self._replicas[name] = replica
        return replica

    def _restart_group(self, name: str) -> Replica:
        """A worker of a data-parallel group: the whole group restarts (its workers share
        one process group; a dead rank has failed the others' collectives, so their
        requests ended retryably too). The router asks for each worker in turn: the first
        ask restarts all of them, the others get the fresh worker already running."""
        if name in self._fresh_members:
            self._fresh_members.discard(name)
            return self._replicas[name]
        members = dp_group_members(self._replicas, name)
        logger.warning("restarting data-parallel group %s (%s)", name, ", ".join(members))
        for member in members:
            kill_replica(self._replicas[member])
            self._generations[member] += 1
        cancel, fresh = self._closing, {}
        try:
            for member in members:
                old = self._replicas[member]
                generation = self._generations[member]
                fresh[member] = place_replica(old.spec, old.bundle, generation, cancel)
            start_replicas(fresh, cancel)
            check_agree([self._reference, *wait_ready(fresh, cancel)])
            others = [n for n, r in self._replicas.items() if r.spec.role != "decode"]
            for member in members:
                pairs = [(member, o) for o in others]
                introduce({**self._replicas, **fresh}, pairs, fresh=member)
        except BaseException:
            for replica in fresh.values():
                kill_replica(replica)
            raise
        self._replicas.update(fresh)
        self._fresh_members.update(m for m in members if m != name)
        return fresh[name]

    def bring_in(
        self, name: str, spec: WorkerSpec, bundle: dict[str, float], generation: int = 0
    ) -> Replica:
        """On the restart thread: place and start replica ``name``, check it agrees with
        the cluster, introduce it to its KV peers (steps 2 and 3). Not registered; on
        failure nothing of it is left."""
        cancel = self._closing
        replica = None
        try:
            replica = place_replica(spec, bundle, generation, cancel)
            if self._exporters is not None:
                for address in self._exporters.ensure(replica_nodes(replica.placement_group)):
                    logger.info("metrics of a new node on http://%s/metrics", address)
            start_replicas({name: replica}, cancel)
            check_agree([self._reference, *wait_ready({name: replica}, cancel)])
            others = [
                n
                for n, r in self._replicas.items()
                if n != name and (r.spec.role != spec.role or self._peer_sharing)
            ]
            pairs = [(name, o) if spec.role == "decode" else (o, name) for o in others]
            introduce({**self._replicas, name: replica}, pairs, fresh=name)
            if cancel.is_set():
                raise Cancelled("the cluster is shutting down")
        except BaseException as exc:
            if isinstance(exc, Cancelled):
                logger.warning("restart of %s given up: the cluster is shutting down", name)
            if replica is not None:  # placement cleans up after itself
                kill_replica(replica)
            raise
        return replica
