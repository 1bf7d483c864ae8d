"""Typed messages of the KV hand-off and their msgpack encoding (never pickle).

- :class:`HandshakeMetadata`: what a worker publishes so that peers can reach its KV
  (agent name and incarnation, the transport's agent metadata, the layout). Travels
  over the control plane (router / Ray) as bytes.
- :class:`KVHandle`: the prefill side's answer for one request on one rank: where the
  KV is and under which lease. Travels prefill → router → decode.
- :class:`CompletionNotice` and :class:`PushRequest`: the data-plane control messages,
  sent as transport notifications between the two agents.

The messages are frozen msgspec structs (change one with ``msgspec.structs.replace``).
Every message encodes as ``[kind, version, [fields...]]``: the struct's fields in order
(msgspec ``array_like``; the :class:`KVLayout`, a dataclass, as a map of its fields).
Decoding is typed (msgspec): it checks the kind, the version, the field count and every
field's type and runs the ``__post_init__`` checks (the layout's too), so a malformed,
stale or foreign message raises ``ValueError`` naming the message class instead of
producing half-filled objects.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar, Literal

import msgspec

from kvtransfer.layout import KVLayout

PROTOCOL_VERSION = 2  # 2: msgspec structs, ``[kind, version, [fields...]]``


def agent_name_for(worker_id: str, incarnation: str) -> str:
    """Transport agent name: unique per incarnation, so a restarted worker is a new peer."""
    return f"{worker_id}#{incarnation}"


class _Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The hand-off's structs: immutable, encoded as arrays of exactly their fields, in order."""


class HandshakeMetadata(_Message):
    worker_id: str
    incarnation: str
    agent_metadata: bytes  # the transport's own connection info (NIXL agent metadata)
    layout: KVLayout
    kind: ClassVar[str] = "hello"

    @property
    def agent_name(self) -> str:
        return agent_name_for(self.worker_id, self.incarnation)


class KVHandle(_Message):
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
        return msgspec.structs.replace(self, block_ids=ids, first_block=first_block)


class CompletionNotice(_Message):
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


class PushRequest(_Message):
    """Reader → owner (push direction): write lease ``lease_id`` into my ``block_ids``."""

    lease_id: int
    req_id: str
    block_ids: tuple[int, ...]
    timeout_s: float  # the owner gives up writing before the reader stops waiting
    first_block: int = 0  # write the lease's blocks from this index on (partial receive)
    # (as many as ``block_ids``: a peer pull reads a prefix of the lease)
    # The lease's block indices to write, one per ``block_ids`` (a latent cache's round-robin
    # share, kvtransfer/tp_mapping.py); empty: ``first_block`` on, consecutively.
    block_indices: tuple[int, ...] = ()
    kind: ClassVar[str] = "push"

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")
        if self.block_indices and len(self.block_indices) != len(self.block_ids):
            raise ValueError(
                f"{len(self.block_indices)} block indices for {len(self.block_ids)} blocks"
            )


class StreamReservation(_Message):
    """Decode rank → prefill ranks (layer-wise hand-off): blocks reserved at admission
    for ``req_id``; write the prompt's KV into them as its layers are computed."""

    agent_name: str  # the decode rank's agent (the writes' destination)
    req_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks from first_block on, in order
    timeout_s: float  # the writer gives up before the reader stops waiting
    first_block: int = 0  # prompt blocks the reader holds already (partial receive)
    kind: ClassVar[str] = "reserve"

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")


class StreamNotice(_Message):
    """One request's layer-wise stream between a prefill and a decode rank: O(1) per
    request. Prefill → decode: "done" rides on the stream's last WRITE, posted once
    every earlier write of the stream had completed, so it arrives after all the data;
    "failed" / "aborted" are sent alone once no write of the stream is in flight.
    Decode → prefill: "abort" (stop writing, then answer "aborted")."""

    req_id: str
    status: str  # one of STATUSES
    num_writes: int = 0  # "done": how many writes the stream made
    layers_ready: int = 0  # monotonic: model layers whose KV of every sent block is in place
    error_code: str = ""
    message: str = ""
    kind: ClassVar[str] = "stream"

    STATUSES: ClassVar[tuple[str, ...]] = ("done", "failed", "aborted", "abort")

    def __post_init__(self) -> None:
        if self.status not in self.STATUSES:
            raise ValueError(f"unknown stream status {self.status!r}")


def _enc_hook(obj: Any) -> Any:
    """numpy scalars (and other number types) where a plain int or float belongs."""
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class _Head(msgspec.Struct, array_like=True):
    """Any message's kind and version, read leniently to pick its class or say why not."""

    kind: Any = None
    version: Any = None


_TYPES = {
    cls.kind: cls
    for cls in (
        HandshakeMetadata,
        KVHandle,
        CompletionNotice,
        PushRequest,
        StreamReservation,
        StreamNotice,
    )
}
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
# One per class, typed ``[kind, version, fields]``: the kind and version are literals, so
# anything else fails in msgspec (and :func:`_refusal` says why).
_DECODERS = {
    cls: msgspec.msgpack.Decoder(tuple[Literal[kind], Literal[PROTOCOL_VERSION], cls])
    for kind, cls in _TYPES.items()
}
_HEAD = msgspec.msgpack.Decoder(_Head)


def encode(msg: _Message) -> bytes:
    return _ENCODER.encode((msg.kind, PROTOCOL_VERSION, msg))


def decode(data: bytes):
    """Inverse of :func:`encode`, whatever the message; raises ``ValueError`` on anything
    malformed."""
    try:
        kind = _HEAD.decode(data).kind
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a kvtransfer message: {exc}") from None
    if not isinstance(kind, str) or kind not in _TYPES:
        raise ValueError(f"not a kvtransfer message (kind {kind!r})")
    return decode_as(data, _TYPES[kind])


def decode_as(data: bytes, cls):
    """Decode and check the message is a ``cls``; raises ``ValueError`` otherwise."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        raise TypeError(f"{cls.__name__} is not a kvtransfer message")
    try:
        return decoder.decode(data)[2]
    except msgspec.DecodeError as exc:  # ValidationError included; both are ValueErrors
        raise ValueError(_refusal(data, cls, exc)) from None


def _refusal(data: bytes, cls: Any, exc: Exception) -> str:
    """Why ``data`` is not a ``cls`` of this version: foreign, stale or malformed."""
    name = cls.__name__
    try:
        head = _HEAD.decode(data)
    except msgspec.DecodeError:
        return f"{name}: not a kvtransfer message: {exc}"
    if head.kind != cls.kind:
        other = _TYPES.get(head.kind) if isinstance(head.kind, str) else None
        return f"expected {name}, got {other.__name__ if other else f'kind {head.kind!r}'}"
    if head.version != PROTOCOL_VERSION:
        return f"{name}: protocol version {head.version} != {PROTOCOL_VERSION}"
    return f"malformed {name}: {exc}"
