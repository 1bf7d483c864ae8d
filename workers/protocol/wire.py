"""Typed messages between the router and a worker, and their msgpack encoding (never pickle).

- :class:`WorkItem` (router → worker): one request for one role. ``mode`` says what the
  worker does with it: ``full`` (prefill and decode here), ``prefill`` (compute the prompt,
  sample the first token, hold the KV under a lease and answer with a handle) or
  ``decode`` (receive the KV through the handles, then continue from the first token).
- :class:`TokenEvent` (worker → router): new tokens of one request, batched per engine
  step in an :class:`OutputBatch` together with the worker's :class:`WorkerReport`, and
  pushed over the worker's event channel (``workers/serving/channel.py``), not one call per token.

The messages are frozen msgspec structs (change one with ``msgspec.structs.replace``).
Every message encodes as ``[kind, version, [fields...]]``: the struct's fields in order
(msgspec ``array_like``; nested messages likewise, :class:`SamplingParams` as a map of
its fields). Decoding is typed (msgspec): it checks the kind, the version, the field
count and every field's type and runs the ``__post_init__`` checks, so a foreign, stale
or malformed message raises ``ValueError`` naming the message class.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.trace import SpanRecord

# 4: WorkerReport carries the speculative-decoding counters; 5: the KV tiers' events and
# stats; 6: msgspec structs, ``[kind, version, [fields...]]`` and typed fields; 7: trace
# context in the work item, span records in the final event (workers/protocol/trace.py);
# 8: SamplingParams.cache_salt; 9: SamplingParams.structured (structured outputs);
# 10: SamplingParams.prompt_logprobs and logit_bias, TokenEvent.prompt_logprobs;
# 11: the pool's hashes as KV events ("pool"), not a whole set per change;
# 12: the layer-wise hand-off (WorkItem.kv_stream_from / kv_reservations,
# TokenEvent.kv_reservations / kv_streamed, WorkerReport.layerwise_min_tokens).
WIRE_VERSION = 12
MODES = ("full", "prefill", "decode")
T = TypeVar("T")


class _Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The wire's structs: immutable, encoded as arrays of exactly their fields, in order."""


class WorkItem(_Message):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    mode: str  # one of MODES
    kv_handles: tuple[bytes, ...] = ()  # decode: msgpack KVHandle per prefill rank
    first_token_id: int | None = None  # decode: the token the prefill worker sampled
    # full / prefill: output already streamed by a worker that died (request migration);
    # the request resumes after it (LLMEngine.add_request's prior_output_token_ids).
    output_token_ids: tuple[int, ...] = ()
    # W3C traceparent of the router's span this part of the request hangs under; empty:
    # not traced (tracing off), and the worker records nothing for it.
    traceparent: str = ""
    # Layer-wise hand-off (docs/kvtransfer.md). decode: the prefill worker (its name)
    # that will stream the KV into blocks this worker reserves and answers with
    # (TokenEvent.kv_reservations); without first_token_id the request waits for it, a
    # second item with the same id and first_token_id brings it.
    kv_stream_from: str = ""
    # prefill: the decode worker's reservations (msgpack StreamReservation, one per
    # decode rank): write the KV into them as it is computed, instead of a lease.
    kv_reservations: tuple[bytes, ...] = ()
    kind: ClassVar[str] = "work"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.kv_stream_from:
            if self.mode != "decode" or self.kv_handles or self.output_token_ids:
                raise ValueError("kv_stream_from is for decode work without kv_handles")
        elif self.mode == "decode" and (not self.kv_handles or self.first_token_id is None):
            raise ValueError("decode work needs kv_handles and first_token_id")
        if self.kv_reservations and (self.mode != "prefill" or self.kv_handles):
            raise ValueError("kv_reservations are for prefill work without kv_handles")
        if self.mode == "decode" and self.output_token_ids:
            raise ValueError("decode work resumes after first_token_id, not output_token_ids")


class TokenEvent(_Message):
    """New output of one request since its previous event (possibly its end)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_token_id: int | None = None  # the stop token id that ended it (not EOS)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # On the request's first event with tokens, when its params ask for prompt_logprobs:
    # one per prompt token after the first (entry i scores prompt token i + 1). A prefill
    # worker computes them and its handle event carries them; a decode worker sends none.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    kv_handles: tuple[bytes, ...] = ()  # prefill: the request's KV is held; one per rank
    kv_transfer_seconds: float = 0.0  # decode: the hand-off of this request's KV
    kv_transfer_bytes: int = 0
    error: str = ""  # non-empty: the request failed on the worker (INTERNAL)
    # With error: it failed through no fault of its own (the worker's engine loop died, a
    # KV transfer failed), so the router may migrate it to another worker.
    is_retryable: bool = False
    # On the request's last event from this worker (its end here, or a prefill's handle
    # event) when the work item carried a traceparent: the worker's spans of it.
    spans: tuple[SpanRecord, ...] = ()
    # Layer-wise hand-off. decode: blocks reserved for the stream (msgpack
    # StreamReservation, one per rank), for the router to give the prefill worker.
    kv_reservations: tuple[bytes, ...] = ()
    # prefill: the first token's event of a streamed request (like kv_handles: its part
    # here is over and the request goes on on the decode worker the KV streams to).
    kv_streamed: bool = False
    kind: ClassVar[str] = "event"


class KVEvents(_Message):
    """Block hashes the pool or one KV tier below it started (``stored``) and stopped
    (``removed``) holding since the previous report that carried events; in a snapshot
    report, ``stored`` is everything the tier holds (Dynamo-style KV events)."""

    tier: str  # "pool" (G1, the block manager) | "host" | "disk" (kv_tiers TierStats.name)
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    kind: ClassVar[str] = "kv_events"


class TierStatus(_Message):
    """One KV tier below a worker's pool: what it holds now and its counters since the
    worker started (the engine's ``TierStats``, plus the capacity in bytes)."""

    name: str  # "host" | "disk"
    blocks: int
    bytes: int
    capacity_blocks: int
    capacity_bytes: int
    hits: int
    misses: int  # unusable blocks (``errors``) included
    errors: int
    onboard_bytes: int
    onboard_seconds: float
    offload_bytes: int
    offload_seconds: float
    evictions: int
    rejected: int  # offloads the tier refused (full disk, an I/O error)
    kind: ClassVar[str] = "tier"


class ExpertLoad(_Message):
    """One MoE layer's (token, slot) pairs routed to each of its experts since the worker
    started (docs/moe.md, "Expert load")."""

    layer: int
    tokens: tuple[int, ...]  # by global expert id


class WorkerReport(_Message):
    """A worker's state as the router's policy sees it."""

    name: str
    role: str  # prefill | decode
    healthy: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    num_held: int  # prefill: requests whose KV waits for a decode worker
    error: str = ""  # the engine loop died of this: the worker is gone for good
    # Speculative decoding since the engine started (LLMEngine.spec_stats; 0 while off).
    # Totals rather than increments: any one report is the whole truth, for the status
    # and for the worker's counters, which add the difference to the previous report.
    spec_num_steps: int = 0  # verify steps
    spec_num_draft_tokens: int = 0  # tokens proposed
    spec_num_accepted_tokens: int = 0  # proposed tokens the target accepted
    # The block hashes the worker holds: its pool's ("pool", G1) and the KV tiers' below
    # it, in lookup order (docs/kv-tiers.md, "Events, routing and metrics"), as stored /
    # removed events. ``kv_events_seq`` numbers the reports that carry ``kv_events`` (1, 2, ...
    # per worker process); a report without events repeats the last number, so a receiver
    # that missed one sees a gap. A snapshot (the first report on a new channel, and one
    # every ``SNAPSHOT_EVERY_S``) replaces what the receiver knew, gap or not.
    kv_events_seq: int = 0
    kv_events_snapshot: bool = False
    kv_events: tuple[KVEvents, ...] = ()
    kv_tiers: tuple[TierStatus, ...] = ()  # latest stats; () when no tier is configured
    expert_load: tuple[ExpertLoad, ...] = ()  # MoE models: totals per layer; () when dense
    # Prefill, layer-wise hand-off: the shortest uncached prompt (tokens) its measured
    # numbers predict a gain for (the router reserves decode blocks first then); 0: none.
    layerwise_min_tokens: int = 0
    kind: ClassVar[str] = "report"


class WorkerInfo(_Message):
    """What a worker resolved at start-up (the router checks the pools agree)."""

    name: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_blocks_total: int
    device: str
    kind: ClassVar[str] = "info"


class OutputBatch(_Message):
    events: tuple[TokenEvent, ...]
    report: WorkerReport
    kind: ClassVar[str] = "batch"


# ---- encoding ---------------------------------------------------------------------------


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


_MESSAGES = (WorkItem, TokenEvent, WorkerReport, WorkerInfo, OutputBatch)
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
# One per class, typed ``[kind, version, fields]``: the kind and version are literals, so
# anything else fails in msgspec (and :func:`_refusal` says why).
_DECODERS = {
    cls: msgspec.msgpack.Decoder(tuple[Literal[cls.kind], Literal[WIRE_VERSION], cls])
    for cls in _MESSAGES
}
_HEAD = msgspec.msgpack.Decoder(_Head)


def encode(msg: WorkItem | TokenEvent | WorkerReport | WorkerInfo | OutputBatch) -> bytes:
    return _ENCODER.encode((msg.kind, WIRE_VERSION, msg))


def decode_as(data: bytes, cls: type[T]) -> T:
    """Decode ``data`` as message class ``cls``; ValueError when it is anything else."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        raise TypeError(f"{cls.__name__} is not a wire message")
    try:
        return decoder.decode(data)[2]
    except msgspec.DecodeError as exc:  # ValidationError included; both are ValueErrors
        raise ValueError(_refusal(data, cls, exc)) from None


def _refusal(data: bytes, cls: Any, exc: Exception) -> str:
    """Why ``data`` is not a ``cls`` of this version: foreign, stale or malformed."""
    name = cls.__name__
    try:
        head = _HEAD.decode(data)
    except msgspec.ValidationError:  # msgpack, but not an array
        return f"not a {name} message"
    except msgspec.DecodeError:
        return f"malformed {name}: {exc}"
    if head.kind != cls.kind:
        return f"not a {name} message"
    if head.version != WIRE_VERSION:
        return f"{name}: wire version {head.version}, expected {WIRE_VERSION}"
    return f"malformed {name}: {exc}"
