"""Typed messages inside one tensor-parallel replica: rank 0 -> the other ranks, and back.

Rank 0 runs the scheduler, the sampler and the router's work; the other ranks hold
their shards of the weights and the KV cache and do what a :class:`RankCommand` says,
in order: end transfers (``aborts``, ``declines``, ``stream_aborts``, ``withdraws``), offer held
blocks (``offers``), start receives (``receives``), reserve blocks for a layer-wise
stream (``reserves``), open streams (``stream_opens``), run a forward pass (``step``,
with its streamed chunks: ``stream_chunks``). The other ranks send their news back on
their own, as it happens, in :class:`RankReply` messages: handles of their offers,
leases that ended, receives that completed, reservations made, streams that ended
(``workers/parallel/rank_link.py``).

The messages are frozen msgspec structs. Each encodes as ``[kind, version, [fields...]]``
(msgpack; the struct's fields in order, a command's step as a
:class:`~workers.engine.step_inputs.StepMsg`) and decodes typed: the kind, the version
and every field's type are checked, so anything else raises ``ValueError`` naming the
message class. No pickle, no method names.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar, Literal

import msgspec

from workers.engine.step_inputs import StepInputs, StepMsg

# 3: msgspec structs, ``[kind, version, [fields...]]``; 4: StepMsg.prompt_logprob_indices;
# 5: StepMsg.expert_rebalance.
REPLICA_WIRE_VERSION = 5


class _Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The replica's structs: immutable, encoded as arrays of exactly their fields, in order."""


class OfferOp(_Message):
    """Prefill: put this rank's copy of a held request's blocks under a lease."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int


class ReceiveOp(_Message):
    """Decode: pull this rank's heads of the request's KV into ``block_ids``."""

    request_id: str
    handles: tuple[bytes, ...]  # msgpack KVHandle, one per prefill rank
    block_ids: tuple[int, ...]


class ReserveOp(_Message):
    """Decode, layer-wise: reserve ``block_ids`` for the stream from every rank of the
    prefill replica ``source`` (answered with a :class:`Reserved`, then a ``Received``)."""

    request_id: str
    source: str
    block_ids: tuple[int, ...]
    first_block: int


class StreamOpenOp(_Message):
    """Prefill, layer-wise: write the request's KV into these reservations (msgpack
    StreamReservation, one per decode rank; each rank writes to the ones its heads and
    layers reach) in groups of ``group_size`` layers (answered with a :class:`Streamed`)."""

    request_id: str
    reservations: tuple[bytes, ...]
    group_size: int


class StreamChunkOp(_Message):
    """A streamed request's prefill chunk of the step (``workers/engine/layerwise.py``)."""

    request_id: str
    start_pos: int
    num_tokens: int
    num_prompt_tokens: int
    block_ids: tuple[int, ...]


class RankCommand(_Message):
    seq: int  # rank 0 numbers its commands; a rank that sees a gap stops
    step: StepInputs | None = None  # travels as a StepMsg (see _CommandMsg)
    offers: tuple[OfferOp, ...] = ()
    receives: tuple[ReceiveOp, ...] = ()
    aborts: tuple[str, ...] = ()  # decode: stop these receives (and stream receives)
    declines: tuple[tuple[bytes, ...], ...] = ()  # decode: nothing will be read from these
    stop: bool = False
    reserves: tuple[ReserveOp, ...] = ()
    stream_opens: tuple[StreamOpenOp, ...] = ()
    stream_aborts: tuple[str, ...] = ()  # prefill: abandon these streams
    stream_chunks: tuple[StreamChunkOp, ...] = ()  # the step's streamed chunks
    withdraws: tuple[str, ...] = ()  # decode: reservations that never went out
    kind: ClassVar[str] = "cmd"


class _CommandMsg(_Message):
    """A :class:`RankCommand` on the wire: the same fields, the step as its StepMsg."""

    seq: int
    step: StepMsg | None
    offers: tuple[OfferOp, ...]
    receives: tuple[ReceiveOp, ...]
    aborts: tuple[str, ...]
    declines: tuple[tuple[bytes, ...], ...]
    stop: bool
    reserves: tuple[ReserveOp, ...] = ()
    stream_opens: tuple[StreamOpenOp, ...] = ()
    stream_aborts: tuple[str, ...] = ()
    stream_chunks: tuple[StreamChunkOp, ...] = ()
    withdraws: tuple[str, ...] = ()


class Offered(_Message):
    request_id: str
    handle: bytes  # empty when the offer failed
    error: str = ""


class Received(_Message):
    request_id: str
    error: str = ""  # empty: the rank's part arrived
    seconds: float = 0.0
    num_bytes: int = 0


class Reserved(_Message):
    request_id: str
    reservation: bytes  # empty when the reservation failed (a Received follows)
    error: str = ""


class Streamed(_Message):
    """A layer-wise stream out of this rank ended: none of its writes is in flight."""

    request_id: str
    error: str = ""  # empty: every write of this rank landed
    num_bytes: int = 0


class RankReply(_Message):
    rank: int
    offered: tuple[Offered, ...] = ()  # offers this rank made (handle or error)
    released: tuple[str, ...] = ()  # request ids whose lease on this rank ended
    received: tuple[Received, ...] = ()  # receives on this rank that completed
    reserved: tuple[Reserved, ...] = ()  # layer-wise reservations this rank made
    streamed: tuple[Streamed, ...] = ()  # layer-wise streams out of this rank that ended
    kind: ClassVar[str] = "reply"


def _enc_hook(obj: Any) -> Any:
    """numpy scalars (and other number types) where a plain int or float belongs."""
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class _Head(msgspec.Struct, array_like=True):
    """Any message's kind and version, read leniently to say why a decode failed."""

    kind: Any = None
    version: Any = None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_COMMAND = msgspec.msgpack.Decoder(
    tuple[Literal["cmd"], Literal[REPLICA_WIRE_VERSION], _CommandMsg]
)
_REPLY = msgspec.msgpack.Decoder(tuple[Literal["reply"], Literal[REPLICA_WIRE_VERSION], RankReply])
_HEAD = msgspec.msgpack.Decoder(_Head)


def encode_command(cmd: RankCommand) -> bytes:
    step = cmd.step.to_msg() if cmd.step is not None else None
    # The fields of a _CommandMsg, as a tuple (the same array, without building the struct).
    fields = (
        cmd.seq, step, cmd.offers, cmd.receives, cmd.aborts, cmd.declines, cmd.stop,
        cmd.reserves, cmd.stream_opens, cmd.stream_aborts, cmd.stream_chunks, cmd.withdraws,
    )  # fmt: skip
    return _ENCODER.encode(("cmd", REPLICA_WIRE_VERSION, fields))


def decode_command(data: bytes) -> RankCommand:
    """Raises ValueError for anything but a command of this version."""
    try:
        msg = _COMMAND.decode(data)[2]
        step = StepInputs.from_msg(msg.step) if msg.step is not None else None
    except ValueError as exc:  # msgspec's errors included
        raise ValueError(_refusal(data, RankCommand, exc)) from None
    return RankCommand(
        msg.seq, step, msg.offers, msg.receives, msg.aborts, msg.declines, msg.stop,
        msg.reserves, msg.stream_opens, msg.stream_aborts, msg.stream_chunks, msg.withdraws,
    )  # fmt: skip


def encode_reply(reply: RankReply) -> bytes:
    return _ENCODER.encode(("reply", REPLICA_WIRE_VERSION, reply))


def decode_reply(data: bytes) -> RankReply:
    """Raises ValueError for anything but a reply of this version."""
    try:
        return _REPLY.decode(data)[2]
    except msgspec.DecodeError as exc:  # ValidationError included; both are ValueErrors
        raise ValueError(_refusal(data, RankReply, exc)) from None


def _refusal(data: bytes, cls: Any, exc: Exception) -> str:
    """Why ``data`` is not a ``cls`` of this version: foreign, stale or malformed."""
    name, kind = cls.__name__, cls.kind
    try:
        head = _HEAD.decode(data)
    except msgspec.ValidationError:  # msgpack, but not an array
        return f"{name}: not a {kind} message"
    except msgspec.DecodeError:
        return f"{name}: undecodable {kind} message: {exc}"
    if head.kind != kind:
        return f"{name}: not a {kind} message (kind {head.kind!r})"
    if head.version != REPLICA_WIRE_VERSION:
        return f"{name}: {kind} message version {head.version}, expected {REPLICA_WIRE_VERSION}"
    return f"{name}: malformed {kind} message: {exc}"
