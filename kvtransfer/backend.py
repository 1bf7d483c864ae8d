"""The transport interface under the connector, its config and result types.

A :class:`KVBackend` moves bytes between registered KV caches and carries small
notifications; it knows nothing about requests or leases (``connector.py`` does).
The connector calls every backend method from its single dedicated thread, so a
backend needs no locking of its own (NIXL agents are not thread-safe by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtransfer.layout import KVLayout
from kvtransfer.tp_mapping import Segment

DIRECTIONS = ("auto", "pull", "push")
BACKENDS = ("nixl", "local")
ON_FAILURE = ("recompute", "fail")
LAYERWISE = ("auto", "on", "off")


def _setting(default: Any, doc: str, *, gt: float | None = None, ge: float | None = None) -> Any:
    """A hand-off setting the cluster YAML exposes: its default and its one-line doc and
    bound, in metadata keyed by the arguments of ``cluster.config_schema.option``
    (kvtransfer/ may not import cluster/), so the YAML edge checks and documents it from here."""
    meta = {"doc": doc, "ge": ge, "le": None, "gt": gt, "lt": None}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class KVTransferConfig:
    """Knobs of the KV hand-off: the one declaration of the cluster YAML's ``kv_transfer``
    settings (the fields made with ``_setting``); the others are internal tuning."""

    backend: str = _setting(
        "nixl", "How KV blocks move from prefill to decode; local = in-process (tests)"
    )
    """Transport: "nixl" (UCX: RDMA/NVLink/shared memory/TCP) or "local" (in-process, tests)."""
    direction: str = _setting(
        "auto", "pull = decode reads, push = prefill writes; auto = the faster for the transport"
    )
    """How the decode side gets the KV: "pull" (it READs), "push" (prefill WRITEs into
    blocks decode reserved) or "auto" (the faster for the backend, resolved at start-up)."""
    lease_seconds: float = _setting(
        30.0, "Prefill frees KV blocks not pulled within this time", gt=0.0
    )
    """Prefill frees un-read blocks after this."""
    transfer_timeout_s: float = _setting(10.0, "Deadline of one request's KV transfer", gt=0.0)
    """Deadline of one request's transfer (decode side); must be well below lease_seconds."""
    on_failure: str = _setting(
        "recompute", "A failed transfer: recompute the prompt on decode, or fail the request"
    )
    """What the decode worker does when a transfer fails (the connector itself never reads
    it): recompute the prompt into the same blocks, or fail the request."""
    allow_fault_injection: bool = _setting(
        False,
        "Let $BATON_KV_FAULTS inject transfer faults (testing only); off, the variable is "
        "ignored with an error in the log, so a stray one cannot break production",
    )
    """Whether ``BATON_KV_FAULTS`` may wrap the backend in the fault injector
    (``kvtransfer/faults.py``): the variable alone does nothing."""
    layerwise: str = _setting(
        "off",
        "Layer-wise KV hand-off (docs/kvtransfer.md): auto = the prefill worker streams a "
        "request's KV layer group by layer group while it computes, when its measured "
        "compute and link numbers predict a gain (any TP/PP layouts on either side); "
        "on = it streams every request whose uncached prompt has at least "
        "layerwise_min_tokens tokens (testing, measuring); off = always the whole-request "
        "hand-off",
    )
    """Whether a prefill worker streams requests' KV layer-wise when its numbers predict a
    gain ("auto"), for every prompt of at least ``layerwise_min_tokens`` ("on": the
    numbers are not asked, so a CPU test or a benchmark streams for sure), or never."""
    layerwise_min_tokens: int = _setting(
        512,
        "With layerwise: on, the shortest uncached prompt (tokens) streamed layer-wise",
        ge=1,
    )
    """``layerwise: on``'s threshold (the router compares a request's uncached prompt)."""
    handshake_timeout_s: float = 10.0
    """Deadline of adding a peer (loading its metadata, preparing descriptor lists)."""
    idle_poll_s: float = 0.01
    """Connector thread's wait between notification polls when nothing is pending."""
    active_poll_s: float = 0.0002
    """... while a transfer is in flight (bounds the latency of completion notices)."""
    lease_poll_s: float = 0.001
    """... while only leases are held (bounds how late a push request is picked up)."""
    progress_delay_us: int = 100
    """NIXL progress thread's delay between polls; 0 busy-spins a core (nixl's default)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kv_transfer.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(
                f"kv_transfer.direction must be one of {DIRECTIONS}, got {self.direction!r}"
            )
        if self.on_failure not in ON_FAILURE:
            raise ValueError(
                f"kv_transfer.on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}"
            )
        if self.layerwise not in LAYERWISE:
            raise ValueError(
                f"kv_transfer.layerwise must be one of {LAYERWISE}, got {self.layerwise!r}"
            )
        for name in (
            "lease_seconds",
            "transfer_timeout_s",
            "handshake_timeout_s",
            "idle_poll_s",
            "active_poll_s",
            "lease_poll_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_transfer.{name} must be positive, got {getattr(self, name)}")
        if self.transfer_timeout_s >= self.lease_seconds:
            raise ValueError(
                f"kv_transfer.transfer_timeout_s ({self.transfer_timeout_s}) must be below "
                f"lease_seconds ({self.lease_seconds}): a pull may not outlive the lease"
            )
        if self.layerwise_min_tokens < 1:
            raise ValueError(
                f"kv_transfer.layerwise_min_tokens must be >= 1, got {self.layerwise_min_tokens}"
            )
        if self.progress_delay_us < 0:
            raise ValueError(
                f"kv_transfer.progress_delay_us must be >= 0, got {self.progress_delay_us}"
            )


@dataclass(frozen=True)
class TransferResult:
    """What the decode side learns when a request's KV has arrived."""

    req_id: str
    direction: str  # "pull" or "push"
    num_bytes: int
    num_descriptors: int  # after merging adjacent ranges (over all source ranks)
    seconds: float


class KVBackend(Protocol):
    """Byte mover between registered KV caches, confined to the connector's thread.

    Errors: :class:`~kvtransfer.errors.PeerLostError` when the peer is gone,
    :class:`~kvtransfer.errors.TransferFailedError` for any other transport failure.
    """

    name: str  # this agent's name (worker id + incarnation)
    preferred_direction: str  # "pull" or "push": the faster one for this transport

    def open(self) -> bytes:
        """Create the agent, register the whole cache once; returns the agent metadata."""
        ...

    def connect(
        self,
        peer: str,
        agent_metadata: bytes,
        remote: KVLayout,
        read_segments: Sequence[Segment],
        write_segments: Sequence[Segment],
    ) -> None:
        """Load the peer and prepare descriptor lists for both directions.

        ``read_segments``: peer is the source, we the destination (we READ);
        ``write_segments``: we are the source, the peer the destination (we WRITE).
        Either may be empty (no heads to exchange that way).
        """
        ...

    def disconnect(self, peer: str) -> None:
        """Forget the peer (idempotent); outstanding transfers to it are released."""
        ...

    def post(
        self,
        peer: str,
        op: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        layers: tuple[int, int] | None = None,
    ) -> object:
        """Start one transfer ("READ" or "WRITE") of whole segment lists; the peer gets
        ``notif`` after the data. Returns an opaque transfer reference. ``layers``: only
        model layers ``[start, end)`` of each block (a layer group of a layer-wise
        hand-off; ``tp_mapping.segments_for_layers``)."""
        ...

    def check(self, xfer: object) -> bool:
        """True once the transfer is complete (then it is released); raises on failure."""
        ...

    def cancel(self, xfer: object) -> bool:
        """Try to abort and release; False if the transport could not stop it yet."""
        ...

    def send_notif(self, peer: str, data: bytes) -> None: ...

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender agent, message)."""
        ...

    def close(self) -> None: ...
