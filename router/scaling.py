"""Live scaling of the prefill and decode pools: add workers, drain and retire them.

``Scaling.scale_to(prefill, decode)`` (the admin route ``POST /admin/scale``, ``baton scale``,
later the planner: ``cluster/planner/actuator.py``'s ``Scaler``) moves each pool to its
target while the router serves. The cluster's :class:`Provisioner` does the placing and
stopping (``cluster/scaling.py`` on Ray, an in-process one in tests); the router never calls
Ray. One scaling runs at a time.

**Adding** a worker: the provisioner places and starts a replica, checks it agrees with the
cluster and introduces its ranks to every rank of the other pool, both ways (the code a
restart uses); the router opens its event channel and listens; the policy routes to it
after its first healthy report (a view without a report is not healthy).

**Removing** one: the least loaded worker of the pool (a dead one that is not being
restarted first) drains: the policy skips it, its running requests finish, and a prefill
worker's leases end with the decode workers' notices. Past ``router.scale_down_grace_seconds``
the requests still on it migrate (``router/migration.py``: aborted there, resent with the
tokens the client has). Then it is retired: out of the router, its replica stopped.

Each scaled worker's lifecycle has one owner, :class:`WorkerLifecycle` driven by
:class:`Scaling`; a worker neither joining nor draining is the router's (and a death is
recovery's: ``router/recovery.py``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from router.workers import WorkerClient, WorkerView

if TYPE_CHECKING:
    from router.router import Router

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
JOIN_TIMEOUT_S = 60.0  # a started replica's first report (it answered describe already)
MIGRATE_SETTLE_S = 10.0  # for the migrated requests to leave a worker past its grace
_POLL_S = 0.05


class Phase(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"
    RETIRED = "retired"


class InvalidTransition(RuntimeError):
    """A lifecycle step its phase does not allow (a bug in the caller)."""


class WorkerLifecycle:
    """One scaled worker's phase: joining -> serving -> draining -> retired.

    ``Scaling`` alone moves it, and does each phase's side effects; who frees what:

    | phase | routed to | who frees what |
    |---|---|---|
    | joining | nothing (no healthy report yet) | a join that fails (no report within ``JOIN_TIMEOUT_S``, death, channel) is retired at once: the router forgets the view, the provisioner stops the replica, which held nothing yet |
    | serving | by the policy | each request's blocks, as always (docs/serving.md): the worker at the request's end, a prefill lease by the decode worker's notice; a death is recovery's (a restart) |
    | draining | nothing new (``WorkerView.is_draining``) | running requests end and free as when serving; past the grace the router aborts each here (the worker frees its blocks) and resends it elsewhere; a death here is not restarted: its requests migrate and it is retired |
    | retired | nothing | the router closes the event channel and drops the view; the provisioner stops the replica: the worker's shutdown aborts what is left, releases its leases, frees the pool and its host and disk tiers and closes its KV agent; then its resources are freed |
    """

    _NEXT: ClassVar[dict[str, tuple[tuple[Phase, ...], Phase]]] = {
        "joined": ((Phase.JOINING,), Phase.SERVING),
        "drain": ((Phase.SERVING,), Phase.DRAINING),
        "retire": ((Phase.JOINING, Phase.DRAINING), Phase.RETIRED),
    }

    def __init__(self, name: str, phase: Phase = Phase.JOINING):
        self.name = name
        self.phase = phase

    def joined(self) -> None:
        """Its first healthy report came: routable."""
        self._step("joined")

    def drain(self) -> None:
        """Chosen for removal: takes nothing new."""
        self._step("drain")

    def retire(self) -> None:
        """Drained (or its join failed, or it died draining): to be stopped."""
        self._step("retire")

    def _step(self, step: str) -> None:
        allowed, to = self._NEXT[step]
        if self.phase not in allowed:
            raise InvalidTransition(f"worker {self.name}: cannot {step} when {self.phase.value}")
        self.phase = to


class ScaleError(Exception):
    """A scaling refused or failed; ``kind``: ``invalid`` (a bad target), ``no_room`` (the
    cluster cannot hold it), ``unavailable`` (the router drains), ``failed`` (a worker did
    not join)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Provisioner(Protocol):
    """The cluster's side of scaling (``cluster/scaling.py``); called by the router."""

    async def check_room(self, num_prefill: int, num_decode: int) -> None:
        """Raise ScaleError("no_room", ...) naming what is short when the cluster cannot
        hold that many more replicas of each pool."""

    async def add(self, role: str) -> WorkerClient:
        """Place and start a new replica of pool ``role``, check that it agrees with the
        cluster and introduce it to its KV peers; its client, not yet started. Raises,
        leaving nothing of the attempt running. Must not block the event loop."""

    async def remove(self, name: str) -> None:
        """Stop replica ``name`` (its shutdown releases its leases and frees every KV tier)
        and free its resources. Idempotent; must not block the event loop."""


@dataclass(frozen=True)
class ScaleResult:
    before: tuple[int, int]  # (prefill, decode) workers, draining ones not counted
    after: tuple[int, int]
    added: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()
    num_migrated: int = 0  # requests moved off a worker past its grace


class Scaling:
    """The router's scaler (``cluster/planner/actuator.py``'s ``Scaler``); one per router."""

    def __init__(
        self,
        router: Router,
        provisioner: Provisioner,
        grace_s: float,
        max_replicas: int = 0,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ):
        """``grace_s``: how long a draining worker's requests may take before they migrate;
        ``max_replicas``: most workers of both pools together (0: no bound of its own)."""
        self.router = router
        self.provisioner = provisioner
        self.grace_s = grace_s
        self.max_replicas = max_replicas
        self.join_timeout_s = join_timeout_s
        self.lifecycles: dict[str, WorkerLifecycle] = {}  # joining and draining workers
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def owns(self, name: str) -> bool:
        """Whether ``name`` is joining or draining (a death is then scaling's, not recovery's)."""
        return name in self.lifecycles

    def current(self) -> tuple[int, int]:
        """(prefill, decode): each pool's workers, joining, serving or down; not draining."""
        pools = (self.router.prefill, self.router.decode)
        return tuple(sum(not v.is_draining for v in pool) for pool in pools)  # type: ignore[return-value]

    async def scale_to(self, prefill: int, decode: int) -> ScaleResult:
        """Move the pools to ``prefill`` and ``decode`` workers; returns once every new
        worker is routable and every removed one retired. Raises ScaleError. The work goes
        on if the caller goes away; the router's ``stop`` cancels it."""
        task = asyncio.get_running_loop().create_task(self._scale_to(prefill, decode))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def stop(self) -> None:
        """Router stop: cancel the scaling in progress (the cluster stops what it placed)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _scale_to(self, prefill: int, decode: int) -> ScaleResult:
        targets = {"prefill": prefill, "decode": decode}
        for role, count in targets.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ScaleError("invalid", f"{role}: must be an integer >= 1, got {count!r}")
        if self.max_replicas and prefill + decode > self.max_replicas:
            raise ScaleError(
                "no_room",
                f"{prefill} prefill + {decode} decode workers is above "
                f"router.scale_max_replicas ({self.max_replicas})",
            )
        async with self._lock:
            self._check_open()
            before = self.current()
            now = {"prefill": before[0], "decode": before[1]}
            num_new = {r: max(0, targets[r] - now[r]) for r in ROLES}
            if any(num_new.values()):
                await self.provisioner.check_room(num_new["prefill"], num_new["decode"])
            added = []
            try:
                for role in ROLES:
                    for _ in range(num_new[role]):
                        self._check_open()
                        added.append(await self._add(role))
            except ScaleError as exc:
                if added:  # those stay: say so
                    p, d = self.current()
                    exc.message += f" (added {', '.join(added)}: now {p} prefill, {d} decode)"
                    exc.args = (exc.message,)
                raise
            victims = [v for r in ROLES for v in self._victims(r, now[r] - targets[r])]
            num_migrated = await asyncio.gather(*(self._retire(v) for v in victims))
            result = ScaleResult(
                before,
                self.current(),
                tuple(added),
                tuple(v.name for v in victims),
                sum(num_migrated),
            )
        logger.warning("scaled %s -> %s: %s", before, result.after, result)
        return result

    def _check_open(self) -> None:
        if self.router.is_draining or self.router.is_stopped:
            raise ScaleError("unavailable", "the router is draining")

    async def _add(self, role: str) -> str:
        """One new worker of ``role``, routable once this returns; its name."""
        try:
            client = await self.provisioner.add(role)
        except ScaleError:
            raise
        except Exception as exc:
            raise ScaleError("failed", f"a new {role} worker did not start: {exc}") from exc
        life = self.lifecycles[client.name] = WorkerLifecycle(client.name)
        view = None
        try:
            view = await self.router.add_worker(client)
            deadline = time.monotonic() + self.join_timeout_s
            while not view.is_healthy:
                if not view.is_alive:
                    raise RuntimeError(f"it died while joining: {view.error}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no healthy report within {self.join_timeout_s:g} s")
                await asyncio.sleep(_POLL_S)
            life.joined()
            logger.warning("worker %s joined the %s pool", client.name, role)
            return client.name
        except BaseException as exc:
            life.retire()
            if view is not None:
                self.router.remove_worker(view)
            else:
                client.close()
            await self.provisioner.remove(client.name)
            if isinstance(exc, Exception):
                raise ScaleError("failed", f"worker {client.name} did not join: {exc}") from exc
            raise
        finally:
            if life.phase is not Phase.JOINING:
                del self.lifecycles[client.name]

    def _victims(self, role: str, count: int) -> list[WorkerView]:
        """The ``count`` workers of ``role`` to remove: dead ones no restart is bringing
        back first, then the least loaded (fewest requests, then fewest KV blocks in use),
        the newest of equals."""
        if count <= 0:
            return []
        recovery = self.router.recovery
        pool = self.router.prefill if role == "prefill" else self.router.decode
        candidates = [
            (index, view)
            for index, view in enumerate(pool)
            if not view.is_draining
            and not self.owns(view.name)
            and (view.is_alive or recovery is None or not recovery.is_restarting(view.name))
        ]

        def key(item: tuple[int, WorkerView]) -> tuple:
            index, view = item
            state = view.state()
            return (view.is_alive, state.load, state.kv_blocks_used, -index)

        return [view for _, view in sorted(candidates, key=key)[:count]]

    async def _retire(self, view: WorkerView) -> int:
        """Drain ``view``, then retire it; how many of its requests had to migrate."""
        life = self.lifecycles[view.name] = WorkerLifecycle(view.name, Phase.SERVING)
        try:
            life.drain()
            view.is_draining = True
            logger.warning("draining worker %s (grace %g s)", view.name, self.grace_s)
            num_migrated = await self._drain(view)
            life.retire()
            self.router.remove_worker(view)
            await self.provisioner.remove(view.name)
            logger.warning("worker %s retired (%d requests migrated)", view.name, num_migrated)
            return num_migrated
        finally:
            del self.lifecycles[view.name]

    async def _drain(self, view: WorkerView) -> int:
        """Wait for ``view``'s requests to end (and a prefill worker's leases: its report's
        blocks in use); past the grace, migrate the rest. Returns how many migrated."""
        deadline = time.monotonic() + self.grace_s
        while view.is_alive and not is_drained(view):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(_POLL_S)
        if not view.is_alive or is_drained(view):
            return 0  # a dead worker's requests migrated already (router._worker_died)
        why = f"drained past router.scale_down_grace_seconds ({self.grace_s:g} s)"
        num_migrated = self.router.migrate_away(view, why)
        # Their migrations end them here; requests still in prefill elsewhere (routed, not
        # active) migrate when their hand-off finds this worker retired.
        deadline = time.monotonic() + MIGRATE_SETTLE_S
        while view.active and view.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return num_migrated


def is_drained(view: WorkerView) -> bool:
    """Nothing routed to ``view`` runs or is on its way, and its last report holds no KV
    block (a prefill worker's leases ended; cached prefix blocks count as free)."""
    report = view.report
    return not view.routed and (report is None or report.kv_blocks_used == 0)
