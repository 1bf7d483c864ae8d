"""Typed messages between the router and a worker, and their msgpack encoding (never pickle).

- :class:`WorkItem` (router → worker): one request for one role. ``mode`` says what the
  worker does with it: ``full`` (prefill and decode here), ``prefill`` (compute the prompt,
  sample the first token, hold the KV under a lease and answer with a handle) or
  ``decode`` (receive the KV through the handles, then continue from the first token).
- :class:`TokenEvent` (worker → router): new tokens of one request, batched per engine
  step in an :class:`OutputBatch` together with the worker's :class:`WorkerReport`, and
  pushed over the worker's event channel (``workers/serving/channel.py``), not one call per token.

Every message encodes as ``[kind, version, fields...]``; decoding checks the kind, the
version and the field count, so a foreign or stale message raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams

# 4: WorkerReport carries the speculative-decoding counters; 5: the KV tiers' events and stats
WIRE_VERSION = 5
MODES = ("full", "prefill", "decode")
T = TypeVar("T")


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    mode: str  # one of MODES
    kv_handles: tuple[bytes, ...] = ()  # decode: msgpack KVHandle per prefill rank
    first_token_id: int | None = None  # decode: the token the prefill worker sampled
    # full / prefill: output already streamed by a worker that died (request migration);
    # the request resumes after it (LLMEngine.add_request's prior_output_token_ids).
    output_token_ids: tuple[int, ...] = ()
    kind: ClassVar[str] = "work"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "decode" and (not self.kv_handles or self.first_token_id is None):
            raise ValueError("decode work needs kv_handles and first_token_id")
        if self.mode == "decode" and self.output_token_ids:
            raise ValueError("decode work resumes after first_token_id, not output_token_ids")


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request since its previous event (possibly its end)."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_token_id: int | None = None  # the stop token id that ended it (not EOS)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    kv_handles: tuple[bytes, ...] = ()  # prefill: the request's KV is held; one per rank
    kv_transfer_seconds: float = 0.0  # decode: the hand-off of this request's KV
    kv_transfer_bytes: int = 0
    error: str = ""  # non-empty: the request failed on the worker (INTERNAL)
    # With error: it failed through no fault of its own (the worker's engine loop died, a
    # KV transfer failed), so the router may migrate it to another worker.
    is_retryable: bool = False
    kind: ClassVar[str] = "event"


@dataclass(frozen=True)
class KVEvents:
    """Block hashes one KV tier below the pool started (``stored``) and stopped
    (``removed``) holding since the previous report that carried events; in a snapshot
    report, ``stored`` is everything the tier holds (Dynamo-style KV events)."""

    tier: str  # "host" | "disk" (workers/engine/kv_tiers/tier.py TierStats.name)
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    kind: ClassVar[str] = "kv_events"


@dataclass(frozen=True)
class TierStatus:
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


@dataclass(frozen=True)
class WorkerReport:
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
    hashes_version: int  # changes whenever the cached block hashes change
    cached_hashes: tuple[int, ...] | None  # None: unchanged since the channel's last batch
    error: str = ""  # the engine loop died of this: the worker is gone for good
    # Speculative decoding since the engine started (LLMEngine.spec_stats; 0 while off).
    # Totals rather than increments: any one report is the whole truth, for the status
    # and for the worker's counters, which add the difference to the previous report.
    spec_num_steps: int = 0  # verify steps
    spec_num_draft_tokens: int = 0  # tokens proposed
    spec_num_accepted_tokens: int = 0  # proposed tokens the target accepted
    # The KV tiers below the pool, in lookup order (docs/kv-tiers.md, "Events, routing and
    # metrics"). ``kv_events_seq`` numbers the reports that carry ``kv_events`` (1, 2, ...
    # per worker process); a report without events repeats the last number, so a receiver
    # that missed one sees a gap. A snapshot (the first report on a new channel, and one
    # every ``SNAPSHOT_EVERY_S``) replaces what the receiver knew, gap or not.
    kv_events_seq: int = 0
    kv_events_snapshot: bool = False
    kv_events: tuple[KVEvents, ...] = ()
    kv_tiers: tuple[TierStatus, ...] = ()  # latest stats; () when no tier is configured
    kind: ClassVar[str] = "report"


@dataclass(frozen=True)
class WorkerInfo:
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


@dataclass(frozen=True)
class OutputBatch:
    events: tuple[TokenEvent, ...]
    report: WorkerReport
    kind: ClassVar[str] = "batch"


# ---- encoding ---------------------------------------------------------------------------


def _logprobs_out(lps: tuple[TokenLogprobs, ...] | None) -> list | None:
    if lps is None:
        return None
    return [
        [t.token_id, t.logprob, t.rank, list(t.top_token_ids), list(t.top_logprobs)] for t in lps
    ]


def _logprobs_in(raw: list | None) -> tuple[TokenLogprobs, ...] | None:
    if raw is None:
        return None
    return tuple(
        TokenLogprobs(int(a), float(b), int(c), tuple(d), tuple(e)) for a, b, c, d, e in raw
    )


# Fields that hold a tuple of messages, by name: each element travels as its field list.
_NESTED: dict[str, type] = {"events": TokenEvent, "kv_events": KVEvents, "kv_tiers": TierStatus}


def _fields(msg: Any) -> list:
    out = []
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, SamplingParams):
            value = dataclasses.asdict(value)
        elif f.name == "logprobs":
            value = _logprobs_out(value)
        elif f.name in _NESTED:
            value = [_fields(e) for e in value]
        elif f.name == "report":
            value = _fields(value)
        elif isinstance(value, tuple):
            value = list(value)
        out.append(value)
    return out


def encode(msg: WorkItem | TokenEvent | WorkerReport | WorkerInfo | OutputBatch) -> bytes:
    return msgpack.packb([msg.kind, WIRE_VERSION, *_fields(msg)], use_bin_type=True)


def _build(cls: type[T], values: list) -> T:
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if len(values) != len(names):
        raise ValueError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    kwargs: dict[str, Any] = {}
    for name, value in zip(names, values, strict=True):
        if name == "params":
            value = SamplingParams(**value)
        elif name == "logprobs":
            value = _logprobs_in(value)
        elif name in _NESTED:
            if not isinstance(value, list):
                raise ValueError(f"{cls.__name__}.{name}: expected a list")
            value = tuple(_build(_NESTED[name], e) for e in value)
        elif name == "report":
            value = _build(WorkerReport, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def decode_as(data: bytes, cls: type[T]) -> T:
    """Decode ``data`` as message class ``cls``; ValueError when it is anything else."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed {cls.__name__}: {exc}") from None
    kind: str = cls.kind  # type: ignore[attr-defined]
    if not isinstance(raw, list) or len(raw) < 2 or raw[0] != kind:
        raise ValueError(f"not a {cls.__name__} message")
    if raw[1] != WIRE_VERSION:
        raise ValueError(f"{cls.__name__}: wire version {raw[1]}, expected {WIRE_VERSION}")
    try:
        return _build(cls, raw[2:])
    except TypeError as exc:
        raise ValueError(f"malformed {cls.__name__}: {exc}") from None
