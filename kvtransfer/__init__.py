"""KV-cache hand-off between workers (the baton): layout, leases, NIXL transfers.

A worker describes its cache with :class:`KVLayout`, makes one :class:`KVConnector`
(:func:`create_connector`), exchanges ``metadata()`` with its peers over the control
plane, and then offers (prefill) or receives (decode) requests' blocks. See
docs/kvtransfer.md for the lifetimes and the knobs.
"""

from __future__ import annotations

import logging
import os
import uuid

from kvtransfer.backend import KVBackend, KVTransferConfig, TransferResult
from kvtransfer.connector import ConnectorStats, KVConnector
from kvtransfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerLostError,
    TransferAbortedError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvtransfer.layout import KVLayout, check_compatible
from kvtransfer.leases import ReleaseCallback
from kvtransfer.messages import (
    CompletionNotice,
    HandshakeMetadata,
    KVHandle,
    PushRequest,
    StreamNotice,
    StreamReservation,
)
from kvtransfer.messages import agent_name_for as _agent_name_for


def new_incarnation() -> str:
    """A fresh incarnation id: a restarted worker is a new, distinguishable peer."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def create_connector(
    config: KVTransferConfig,
    layout: KVLayout,
    kv_cache,
    worker_id: str,
    on_release: ReleaseCallback,
    *,
    incarnation: str | None = None,
    fabric=None,
) -> KVConnector:
    """Build the connector for one worker rank (called once, at start-up, by the worker).

    ``kv_cache`` is the tensor ``layout`` describes; it must outlive the connector.
    ``fabric`` (a :class:`~kvtransfer.local_backend.LocalFabric`) is required for
    ``backend="local"``. ``on_release(req_id, reason)`` runs on the connector thread.
    With ``BATON_KV_FAULTS`` set in the environment and ``config.allow_fault_injection``
    the backend is wrapped in a fault injector (``kvtransfer/faults.py``; tests and soak
    runs only); the variable alone is ignored, with an error in the log.
    """
    incarnation = incarnation or new_incarnation()
    name = _agent_name_for(worker_id, incarnation)
    if config.backend == "local":
        from kvtransfer.local_backend import LocalBackend

        if fabric is None:
            raise ValueError("backend 'local' needs a LocalFabric")
        backend: KVBackend = LocalBackend(name, kv_cache, layout, fabric)
    else:
        from kvtransfer.nixl_backend import NixlBackend

        backend = NixlBackend(name, kv_cache, layout, config)
    if os.environ.get("BATON_KV_FAULTS"):  # tests and soak runs only (kvtransfer/faults.py)
        if not config.allow_fault_injection:
            logging.getLogger(__name__).error(
                "%s: BATON_KV_FAULTS is set but kv_transfer.allow_fault_injection is off: "
                "ignored, no fault is injected",
                worker_id,
            )
        else:
            from kvtransfer.faults import FaultConfig, FaultyBackend

            faults = FaultConfig.from_env()
            if faults is not None and faults.is_active:
                backend = FaultyBackend(backend, faults, worker_id)
    return KVConnector(backend, layout, config, worker_id, incarnation, on_release)


__all__ = [
    "CompletionNotice",
    "ConnectorStats",
    "HandshakeMetadata",
    "KVBackend",
    "KVConnector",
    "KVHandle",
    "KVLayout",
    "KVTransferConfig",
    "KVTransferError",
    "LayoutMismatchError",
    "LeaseExpiredError",
    "PeerLostError",
    "PushRequest",
    "ReleaseCallback",
    "StreamNotice",
    "StreamReservation",
    "TransferAbortedError",
    "TransferFailedError",
    "TransferResult",
    "TransferTimeoutError",
    "check_compatible",
    "create_connector",
    "new_incarnation",
]
