"""Typed errors of the KV hand-off.

Every failure the worker has to act on is one of these; the worker's reaction
(recompute the prompt or fail the request, see ``kv_transfer.on_failure``) does not
depend on which backend raised it. Each class has a stable ``code`` so that an error
can cross a process boundary as a msgpack field and be rebuilt on the other side.
"""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """Base class: the hand-off of a request's KV failed; nothing is left held."""

    code = "error"


class LayoutMismatchError(KVTransferError):
    """The peer's KV-cache layout is incompatible with ours (the message names the fields)."""

    code = "layout_mismatch"


class PeerLostError(KVTransferError):
    """The peer died, was dropped, or is an incarnation known to be dead."""

    code = "peer_lost"


class TransferTimeoutError(KVTransferError):
    """A transfer, handshake or wait did not finish before its deadline."""

    code = "timeout"


class TransferFailedError(KVTransferError):
    """The transport reported an error, or the peer reported one for this transfer."""

    code = "failed"


class TransferAbortedError(KVTransferError):
    """The request was aborted (by this side or the peer) before its KV arrived."""

    code = "aborted"


class LeaseExpiredError(KVTransferError):
    """The source side's lease on the blocks ended before they were read."""

    code = "lease_expired"


_BY_CODE = {
    cls.code: cls
    for cls in (
        KVTransferError,
        LayoutMismatchError,
        PeerLostError,
        TransferTimeoutError,
        TransferFailedError,
        TransferAbortedError,
        LeaseExpiredError,
    )
}


def error_from_code(code: str, message: str) -> KVTransferError:
    """Rebuild a typed error from its ``code`` (unknown codes give the base class)."""
    return _BY_CODE.get(code, KVTransferError)(message)
