"""Transfer fault injection, for tests and soak runs only: a wrapper around a real backend.

:class:`FaultyBackend` sits between the connector and a real :class:`KVBackend` (NIXL in
the cluster) and, on a deterministic schedule, makes the transport misbehave the ways a
real one does, so that the connector's and the worker's reactions (``kv_transfer.on_failure``,
leases, deadlines) run against real transfers:

- ``fail_every=N``: every Nth transfer fails at ``post`` with :class:`TransferFailedError`
  and moves nothing (no data, no notification), like a transport error;
- ``delay_ms=D`` (with ``delay_every=K``, default every transfer): the transfer is posted
  to the real backend D ms late, so its data and its riding notification arrive late
  (past ``transfer_timeout_s`` it ends as a timeout);
- ``drop_notify_every=N``: every Nth notification is lost: the one riding on a transfer
  (the transfer moves its data, the peer never hears) or one sent alone (a completion
  notice, a push request). The peer's lease then expires, or its receive times out.

Turned on only by the ``BATON_KV_FAULTS`` environment variable of the worker processes
(``fail_every=7,delay_ms=50,drop_notify_every=11``), never by the cluster config, so a
production YAML cannot enable it; every connector that has it logs a warning saying so.
Each injected fault counts in ``baton_kv_faults_injected_total{instance,kind}``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvtransfer.backend import KVBackend
from kvtransfer.errors import TransferFailedError
from kvtransfer.layout import KVLayout
from kvtransfer.tp_mapping import Segment

logger = logging.getLogger(__name__)

FAULTS_ENV = "BATON_KV_FAULTS"
KINDS = ("fail", "delay", "drop_notify")


@dataclass(frozen=True)
class FaultConfig:
    """Which faults to inject; every count is per backend (one worker rank), 0 = never."""

    fail_every: int = 0
    """Every Nth transfer fails at post, moving nothing."""
    delay_ms: float = 0.0
    """Post the delayed transfers this late (their data and notification arrive late)."""
    delay_every: int = 1
    """Which transfers ``delay_ms`` delays: every Kth (1 = all)."""
    drop_notify_every: int = 0
    """Every Nth notification (riding on a transfer or sent alone) is never delivered."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(
                    f"{FAULTS_ENV}: {f.name} must be >= 0, got {getattr(self, f.name)}"
                )
        if self.delay_every < 1:
            raise ValueError(f"{FAULTS_ENV}: delay_every must be >= 1, got {self.delay_every}")

    @property
    def is_active(self) -> bool:
        return bool(self.fail_every or self.delay_ms or self.drop_notify_every)

    @classmethod
    def parse(cls, text: str) -> FaultConfig:
        """``"fail_every=7,delay_ms=50,drop_notify_every=11"``; unknown keys are errors."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise ValueError(
                    f"{FAULTS_ENV}: {item!r} is not KEY=VALUE with KEY one of {sorted(types)}"
                )
            try:
                values[key] = float(value) if types[key] == "float" else int(value)
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: {key}={value!r} is not a number") from None
        return cls(**values)

    @classmethod
    def from_env(cls, environ=None) -> FaultConfig | None:
        """The config ``BATON_KV_FAULTS`` asks for, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(FAULTS_ENV, "").strip()
        return cls.parse(text) if text else None


_COUNTER = None
_COUNTER_LOCK = threading.Lock()


def _metric():
    """The Prometheus counter, created on first use (only processes that inject have it)."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            from prometheus_client import Counter as PromCounter

            _COUNTER = PromCounter(
                "baton_kv_faults_injected",
                f"KV transfer faults injected by {FAULTS_ENV} (testing only)",
                ("instance", "kind"),
            )
        return _COUNTER


@dataclass
class _Delayed:
    """A transfer waiting for its delayed post (``inner`` is the real one once posted)."""

    peer: str
    op: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    notif: bytes
    due: float
    layers: tuple[int, int] | None = None  # a layer group (layer-wise hand-off)
    inner: object | None = None


class FaultyBackend:
    """A :class:`KVBackend` that forwards to ``inner`` and injects ``config``'s faults.

    Like every backend it is called from the connector's thread only. ``instance`` labels
    the metric (the worker id).
    """

    def __init__(self, inner: KVBackend, config: FaultConfig, instance: str):
        self._inner = inner
        self.config = config
        self.name = inner.name
        self.preferred_direction = inner.preferred_direction
        self._instance = instance
        self._num_posts = 0
        self._num_notifs = 0
        self.injected: Counter[str] = Counter()
        logger.warning(
            "KV TRANSFER FAULT INJECTION IS ON for %s (%s=%r): transfers will fail, be "
            "delayed or lose notifications on purpose. Testing only: never in production.",
            inner.name,
            FAULTS_ENV,
            config,
        )

    def _inject(self, kind: str) -> None:
        self.injected[kind] += 1
        _metric().labels(self._instance, kind).inc()

    # ---- pass-through ---------------------------------------------------------------
    def open(self) -> bytes:
        return self._inner.open()

    def connect(
        self,
        peer: str,
        agent_metadata: bytes,
        remote: KVLayout,
        read_segments: Sequence[Segment],
        write_segments: Sequence[Segment],
    ) -> None:
        self._inner.connect(peer, agent_metadata, remote, read_segments, write_segments)

    def disconnect(self, peer: str) -> None:
        self._inner.disconnect(peer)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        return self._inner.get_notifs()

    def close(self) -> None:
        self._inner.close()

    # ---- faulty paths -----------------------------------------------------------------
    def _drops_notif(self) -> bool:
        self._num_notifs += 1
        every = self.config.drop_notify_every
        if every and self._num_notifs % every == 0:
            self._inject("drop_notify")
            return True
        return False

    def post(
        self,
        peer: str,
        op: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        layers: tuple[int, int] | None = None,
    ) -> object:
        self._num_posts += 1
        cfg = self.config
        if cfg.fail_every and self._num_posts % cfg.fail_every == 0:
            self._inject("fail")
            raise TransferFailedError(f"injected fault: {op} with {peer} failed ({FAULTS_ENV})")
        if notif and self._drops_notif():
            notif = b""  # NIXL sends no notification for an empty message
        if cfg.delay_ms and self._num_posts % cfg.delay_every == 0:
            self._inject("delay")
            due = time.monotonic() + cfg.delay_ms / 1000.0
            local, remote = tuple(local_block_ids), tuple(remote_block_ids)
            return _Delayed(peer, op, local, remote, notif, due, layers)
        return self._post(peer, op, local_block_ids, remote_block_ids, notif, layers)

    def _post(self, peer, op, local_block_ids, remote_block_ids, notif, layers) -> object:
        if layers is None:  # the backend's plain call, as before layer groups existed
            return self._inner.post(peer, op, local_block_ids, remote_block_ids, notif)
        return self._inner.post(peer, op, local_block_ids, remote_block_ids, notif, layers)

    def check(self, xfer: object) -> bool:
        if not isinstance(xfer, _Delayed):
            return self._inner.check(xfer)
        if xfer.inner is None:
            if time.monotonic() < xfer.due:
                return False
            # Errors of the late post surface here, as errors of the transfer.
            xfer.inner = self._post(
                xfer.peer,
                xfer.op,
                xfer.local_block_ids,
                xfer.remote_block_ids,
                xfer.notif,
                xfer.layers,
            )
        return self._inner.check(xfer.inner)

    def cancel(self, xfer: object) -> bool:
        if not isinstance(xfer, _Delayed):
            return self._inner.cancel(xfer)
        if xfer.inner is None:
            xfer.due = float("inf")  # never posted: nothing to stop, and never will be
            return True
        return self._inner.cancel(xfer.inner)

    def send_notif(self, peer: str, data: bytes) -> None:
        if self._drops_notif():
            return
        self._inner.send_notif(peer, data)
