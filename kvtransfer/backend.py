"""The transport interface under the connector, its config and result types.

A :class:`KVBackend` moves bytes between registered KV caches and carries small
notifications; it knows nothing about requests or leases (``connector.py`` does).
The connector calls every backend method from its single dedicated thread, so a
backend needs no locking of its own (NIXL agents are not thread-safe by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.layout import KVLayout
from kvtransfer.tp_mapping import Segment

DIRECTIONS = ("auto", "pull", "push")
BACKENDS = ("nixl", "local")


@dataclass(frozen=True)
class KVTransferConfig:
    """Knobs of the KV hand-off (the cluster YAML's ``kv_transfer`` section maps onto this)."""

    backend: str = "nixl"
    """Transport: "nixl" (UCX: RDMA/NVLink/shared memory/TCP) or "local" (in-process, tests)."""
    direction: str = "auto"
    """How the decode side gets the KV: "pull" (it READs), "push" (prefill WRITEs into
    blocks decode reserved) or "auto" (the faster for the backend, resolved at start-up)."""
    lease_seconds: float = 30.0
    """Prefill frees un-read blocks after this."""
    transfer_timeout_s: float = 10.0
    """Deadline of one request's transfer (decode side); must be well below lease_seconds."""
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
    ) -> object:
        """Start one transfer ("READ" or "WRITE") of whole segment lists; the peer gets
        ``notif`` after the data. Returns an opaque transfer reference."""
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
