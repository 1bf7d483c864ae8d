"""Typed messages of the KV hand-off and their msgpack encoding (never pickle).

- :class:`HandshakeMetadata`: what a worker publishes so that peers can reach its KV
  (agent name and incarnation, the transport's agent metadata, the layout). Travels
  over the control plane (router / Ray) as bytes.
- :class:`KVHandle`: the prefill side's answer for one request on one rank: where the
  KV is and under which lease. Travels prefill → router → decode.
- :class:`CompletionNotice` and :class:`PushRequest`: the data-plane control messages,
  sent as transport notifications between the two agents.

Every message encodes as ``[kind, version, fields...]``; decoding checks both and the
field types, so a malformed or foreign message raises ``ValueError`` instead of
producing half-filled objects.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import msgpack

from kvtransfer.layout import KVLayout

PROTOCOL_VERSION = 1


def agent_name_for(worker_id: str, incarnation: str) -> str:
    """Transport agent name: unique per incarnation, so a restarted worker is a new peer."""
    return f"{worker_id}#{incarnation}"


@dataclass(frozen=True)
class HandshakeMetadata:
    worker_id: str
    incarnation: str
    agent_metadata: bytes  # the transport's own connection info (NIXL agent metadata)
    layout: KVLayout
    kind: ClassVar[str] = "hello"

    @property
    def agent_name(self) -> str:
        return agent_name_for(self.worker_id, self.incarnation)


@dataclass(frozen=True)
class KVHandle:
    """One prefill rank's KV of one request, held under a lease until notice or expiry."""

    agent_name: str  # the owner's agent (incarnation included)
    req_id: str
    lease_id: int  # unique within the owner's incarnation
    block_ids: tuple[int, ...]
    fingerprint: str  # KVLayout.fingerprint of the owner
    num_tokens: int  # tokens whose KV the blocks hold
    first_token_id: int  # sampled by prefill
    lease_seconds: float
    issued_unix: float  # owner's wall clock at issue (the reader checks the lease is not stale)
    # The lease's blocks from this index on: ``block_ids`` are the lease's
    # ``[first_block:first_block + len(block_ids)]``. A decode worker that holds the
    # prompt's first blocks itself receives only the rest (``from_block``); the owner
    # always issues 0.
    first_block: int = 0
    kind: ClassVar[str] = "handle"

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")

    def from_block(self, first_block: int, end_block: int | None = None) -> KVHandle:
        """The same lease, read from its block ``first_block`` on (a partial receive: the
        reader holds the blocks before it), up to ``end_block`` (exclusive; None: to the
        end; a peer pull reads only a prefix). At least one block must remain."""
        end = self.first_block + len(self.block_ids)
        end_block = end if end_block is None else end_block
        if not self.first_block <= first_block < end_block <= end:
            raise ValueError(
                f"cannot read blocks {first_block}..{end_block - 1}: the handle holds "
                f"blocks {self.first_block}..{end - 1}"
            )
        ids = self.block_ids[first_block - self.first_block : end_block - self.first_block]
        return replace(self, block_ids=ids, first_block=first_block)


@dataclass(frozen=True)
class CompletionNotice:
    """The end of one side's part in one lease's transfer.

    Pull: reader → owner ("done" rides on the READ itself, so it arrives after the
    data; "aborted"/"skipped" when nothing was or will be read). Push: owner → reader
    ("done" rides on the WRITE; "failed"/"aborted" otherwise), and reader → owner
    ("aborted", "skipped").
    """

    owner: str  # agent name that owns the lease
    lease_id: int
    req_id: str
    status: str  # one of STATUSES
    error_code: str = ""  # errors.KVTransferError.code when status is "failed"
    message: str = ""
    kind: ClassVar[str] = "notice"

    STATUSES: ClassVar[tuple[str, ...]] = ("done", "aborted", "skipped", "failed")

    def __post_init__(self) -> None:
        if self.status not in self.STATUSES:
            raise ValueError(f"unknown notice status {self.status!r}")


@dataclass(frozen=True)
class PushRequest:
    """Reader → owner (push direction): write lease ``lease_id`` into my ``block_ids``."""

    lease_id: int
    req_id: str
    block_ids: tuple[int, ...]
    timeout_s: float  # the owner gives up writing before the reader stops waiting
    first_block: int = 0  # write the lease's blocks from this index on (partial receive)
    # (as many as ``block_ids``: a peer pull reads a prefix of the lease)
    kind: ClassVar[str] = "push"

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")


_SCALARS = {"str": str, "bytes": bytes, "int": int, "float": (int, float)}
_TYPES = {cls.kind: cls for cls in (HandshakeMetadata, KVHandle, CompletionNotice, PushRequest)}


def encode(msg: HandshakeMetadata | KVHandle | CompletionNotice | PushRequest) -> bytes:
    values = []
    for f in fields(msg):
        value = getattr(msg, f.name)
        values.append(value.to_msg() if isinstance(value, KVLayout) else value)
    return msgpack.packb([msg.kind, PROTOCOL_VERSION, *values], use_bin_type=True)


def decode(data: bytes):
    """Inverse of :func:`encode`; raises ``ValueError`` on anything malformed."""
    try:
        items = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:
        raise ValueError(f"not a kvtransfer message: {exc}") from exc
    if not isinstance(items, list) or len(items) < 2 or items[0] not in _TYPES:
        raise ValueError("not a kvtransfer message")
    if items[1] != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {items[1]} != {PROTOCOL_VERSION}")
    cls = _TYPES[items[0]]
    cls_fields = fields(cls)
    values = items[2:]
    if len(values) != len(cls_fields):
        raise ValueError(f"{cls.__name__}: expected {len(cls_fields)} fields, got {len(values)}")
    kwargs = {}
    for f, value in zip(cls_fields, values, strict=True):
        if f.name == "layout":
            if not isinstance(value, dict):
                raise ValueError("layout must be a map")
            try:
                value = KVLayout.from_msg(value)
            except TypeError as exc:
                raise ValueError(f"bad layout: {exc}") from exc
        elif f.name == "block_ids":
            if not isinstance(value, list) or not all(isinstance(b, int) for b in value):
                raise ValueError("block_ids must be a list of ints")
            value = tuple(value)
        elif f.type in _SCALARS and (
            not isinstance(value, _SCALARS[f.type]) or isinstance(value, bool)
        ):
            raise ValueError(
                f"{cls.__name__}.{f.name}: expected {f.type}, got {type(value).__name__}"
            )
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from exc


def decode_as(data: bytes, cls):
    """Decode and check the message is a ``cls``."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise ValueError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
