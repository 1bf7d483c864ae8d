"""Typed messages inside one tensor-parallel replica: rank 0 -> the other ranks, and back.

Rank 0 runs the scheduler, the sampler and the router's work; the other ranks hold
their shards of the weights and the KV cache and do what a :class:`RankCommand` says,
in order: end transfers (``aborts``, ``declines``), offer held blocks (``offers``),
start receives (``receives``), run a forward pass (``step``). The other ranks send their
news back on their own, as it happens, in :class:`RankReply` messages: handles of their
offers, leases that ended, receives that completed (``workers/parallel/rank_link.py``). msgpack,
checked on decode; no pickle, no method names.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from workers.engine.step_inputs import StepInputs

REPLICA_WIRE_VERSION = 2


@dataclass(frozen=True)
class OfferOp:
    """Prefill: put this rank's copy of a held request's blocks under a lease."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int


@dataclass(frozen=True)
class ReceiveOp:
    """Decode: pull this rank's heads of the request's KV into ``block_ids``."""

    request_id: str
    handles: tuple[bytes, ...]  # msgpack KVHandle, one per prefill rank
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RankCommand:
    seq: int  # rank 0 numbers its commands; a rank that sees a gap stops
    step: StepInputs | None = None
    offers: tuple[OfferOp, ...] = ()
    receives: tuple[ReceiveOp, ...] = ()
    aborts: tuple[str, ...] = ()  # decode: stop these receives
    declines: tuple[tuple[bytes, ...], ...] = ()  # decode: nothing will be read from these
    stop: bool = False


@dataclass(frozen=True)
class Offered:
    request_id: str
    handle: bytes  # empty when the offer failed
    error: str = ""


@dataclass(frozen=True)
class Received:
    request_id: str
    error: str = ""  # empty: the rank's part arrived
    seconds: float = 0.0
    num_bytes: int = 0


@dataclass(frozen=True)
class RankReply:
    rank: int
    offered: tuple[Offered, ...] = ()  # offers this rank made (handle or error)
    released: tuple[str, ...] = ()  # request ids whose lease on this rank ended
    received: tuple[Received, ...] = ()  # receives on this rank that completed


def encode_command(cmd: RankCommand) -> bytes:
    return msgpack.packb(
        [
            "cmd",
            REPLICA_WIRE_VERSION,
            cmd.seq,
            cmd.step.to_msg() if cmd.step is not None else None,
            [[o.request_id, list(o.block_ids), o.num_tokens, o.first_token_id] for o in cmd.offers],
            [[r.request_id, list(r.handles), list(r.block_ids)] for r in cmd.receives],
            list(cmd.aborts),
            [list(handles) for handles in cmd.declines],
            cmd.stop,
        ],
        use_bin_type=True,
    )


def decode_command(data: bytes) -> RankCommand:
    """Raises ValueError for anything but a command of this version."""
    msg = _unpack(data, "cmd", 9)
    _, _, seq, step, offers, receives, aborts, declines, stop = msg
    try:
        return RankCommand(
            seq=int(seq),
            step=StepInputs.from_msg(step) if step is not None else None,
            offers=tuple(
                OfferOp(str(rid), tuple(int(b) for b in blocks), int(n), int(tok))
                for rid, blocks, n, tok in offers
            ),
            receives=tuple(
                ReceiveOp(str(rid), tuple(bytes(h) for h in hs), tuple(int(b) for b in blocks))
                for rid, hs, blocks in receives
            ),
            aborts=tuple(str(rid) for rid in aborts),
            declines=tuple(tuple(bytes(h) for h in hs) for hs in declines),
            stop=bool(stop),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed rank command: {exc}") from None


def encode_reply(reply: RankReply) -> bytes:
    return msgpack.packb(
        [
            "reply",
            REPLICA_WIRE_VERSION,
            reply.rank,
            [[o.request_id, o.handle, o.error] for o in reply.offered],
            list(reply.released),
            [[r.request_id, r.error, r.seconds, r.num_bytes] for r in reply.received],
        ],
        use_bin_type=True,
    )


def decode_reply(data: bytes) -> RankReply:
    msg = _unpack(data, "reply", 6)
    _, _, rank, offered, released, received = msg
    try:
        return RankReply(
            rank=int(rank),
            offered=tuple(Offered(str(r), bytes(h), str(e)) for r, h, e in offered),
            released=tuple(str(r) for r in released),
            received=tuple(Received(str(r), str(e), float(s), int(n)) for r, e, s, n in received),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed rank reply: {exc}") from None


def _unpack(data: bytes, kind: str, num_fields: int) -> list:
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ValueError(f"undecodable {kind} message: {exc}") from None
    if not isinstance(msg, list) or len(msg) != num_fields or msg[0] != kind:
        raise ValueError(f"not a {kind} message")
    if msg[1] != REPLICA_WIRE_VERSION:
        raise ValueError(f"{kind} message version {msg[1]}, expected {REPLICA_WIRE_VERSION}")
    return msg
