"""Client side of the ``baton.v1.Inference`` gRPC API (proto/baton/v1/inference.proto).

Small typed helpers over a ``grpc.Channel`` / ``InferenceStub``, used by ``baton generate
--target`` and ``baton status`` and by tests and benchmarks that talk to a running
router. They build requests and present answers; they never retry or hide a gRPC error:
callers see ``grpc.RpcError`` with the server's status code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

SERVICE_NAME = "baton.v1.Inference"  # the readiness name in grpc.health.v1 (§2.3)
DISAGGREGATION_CHOICES = ("always", "never", "auto")

_DISAGGREGATION = {
    "always": pb.DISAGGREGATION_ALWAYS,
    "never": pb.DISAGGREGATION_NEVER,
    "auto": pb.DISAGGREGATION_AUTO,
}
_UINT32_END = 1 << 32
_UINT64_END = 1 << 64
_HEALTH_POLL_S = 0.1


class GenerateStream(Protocol):
    """What ``Generate`` returns: an iterator of responses that is also a gRPC call."""

    def __iter__(self) -> Iterator[pb.GenerateResponse]: ...

    def __next__(self) -> pb.GenerateResponse: ...

    def cancel(self) -> bool:
        """Cancel the call; the server aborts the request (same as ``Abort``)."""
        ...


def call_metadata() -> tuple[tuple[str, str], ...]:
    """The API key of ``$BATON_API_KEY`` as gRPC call metadata (``authorization: Bearer
    KEY``), for a router that requires one (docs/security.md); () when unset. From the
    environment, never a flag: a process's arguments are readable by any local user."""
    key = os.environ.get("BATON_API_KEY", "").strip()
    return (("authorization", f"Bearer {key}"),) if key else ()


def parse_target(target: str) -> str:
    """Check that ``target`` is ``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) and return it.

    Raises ``ValueError`` naming what is wrong, so a typo fails before any connection is
    attempted instead of as a vague UNAVAILABLE after a timeout.
    """
    if "://" in target:
        raise ValueError(f"target {target!r}: expected HOST:PORT, without a scheme")
    host, sep, port = target.rpartition(":")
    if not sep:
        raise ValueError(f"target {target!r}: missing ':PORT' (expected HOST:PORT)")
    if host.startswith("["):
        if not host.endswith("]") or len(host) == 2:
            raise ValueError(f"target {target!r}: bad IPv6 host (expected [ADDR]:PORT)")
    elif ":" in host:
        raise ValueError(f"target {target!r}: an IPv6 host needs brackets: [ADDR]:PORT")
    if not host:
        raise ValueError(f"target {target!r}: missing HOST (expected HOST:PORT)")
    if any(c.isspace() for c in host):
        raise ValueError(f"target {target!r}: HOST contains whitespace")
    # isascii: str.isdigit also accepts digits like '²' that int() rejects.
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"target {target!r}: PORT {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"target {target!r}: PORT {port} is outside 1-65535")
    return target


def make_request(
    prompt: str | list[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    ignore_eos: bool = False,
    disaggregation: str | None = None,
    return_timing: bool = False,
    speculative: bool | None = None,
) -> pb.GenerateRequest:
    """Build a ``GenerateRequest`` holding only the options that are given.

    ``None`` leaves an ``optional`` field unset, so the server's default applies (unset
    temperature is not 0: an explicit 0 is sent as greedy). Values the wire cannot carry
    (negative ``max_tokens`` or ``seed``, an unknown ``disaggregation``) raise ``ValueError``
    naming the option; range checks beyond that are the server's (INVALID_ARGUMENT).
    """
    req = pb.GenerateRequest()
    if isinstance(prompt, str):
        req.text = prompt
    else:
        for token_id in prompt:
            _check_unsigned("prompt token id", token_id, _UINT32_END)
        req.token_ids.ids.extend(prompt)

    if seed is not None:
        _check_unsigned("seed", seed, _UINT64_END)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    sampling["speculative"] = speculative  # False: no speculative decoding for this one
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if sampling:
        req.sampling.CopyFrom(pb.SamplingParams(**sampling))

    if max_tokens is not None:
        _check_unsigned("max_tokens", max_tokens, _UINT32_END)
        req.stopping.max_tokens = max_tokens
    if stop:
        req.stopping.stop.extend(stop)
    if ignore_eos:
        req.stopping.ignore_eos = True

    if return_timing:
        req.output.return_timing = True
    if disaggregation is not None:
        if disaggregation not in _DISAGGREGATION:
            choices = "|".join(DISAGGREGATION_CHOICES)
            raise ValueError(f"disaggregation: expected {choices}, got {disaggregation!r}")
        req.disaggregation = _DISAGGREGATION[disaggregation]
    return req


def stream_generate(
    stub: pb_grpc.InferenceStub,
    prompt: str | list[int],
    *,
    timeout_s: float | None = None,
    **options: Any,
) -> GenerateStream:
    """Start one ``Generate`` call; iterate the result for Deltas, then one Final.

    ``options`` are :func:`make_request`'s keywords; ``timeout_s`` is the call's deadline
    (None: none). Iterating raises ``grpc.RpcError`` with the server's status code;
    ``cancel()`` on the returned stream aborts the request on the server.
    """
    return stub.Generate(
        make_request(prompt, **options), timeout=timeout_s, metadata=call_metadata()
    )


def get_status(stub: pb_grpc.InferenceStub, timeout_s: float | None) -> pb.ClusterStatus:
    """Fetch the cluster's pools, workers and KV usage; raises ``grpc.RpcError``.

    Fails fast (UNAVAILABLE) when nothing listens at the target, rather than waiting
    for ``timeout_s``: a status probe should say "unreachable" at once.
    """
    return stub.GetClusterStatus(
        pb.GetClusterStatusRequest(), timeout=timeout_s, metadata=call_metadata()
    )


def wait_ready(channel: grpc.Channel, timeout_s: float) -> None:
    """Block until the server's health service reports ``baton.v1.Inference`` SERVING.

    Polls ``grpc.health.v1.Health/Check``, waiting for the connection while the server
    starts. Raises ``TimeoutError`` (with the last answer seen) after ``timeout_s``, and
    ``grpc.RpcError`` at once for an answer that cannot change with time (e.g. a server
    with no health service: UNIMPLEMENTED).
    """
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # NOT_FOUND: the router registers the service's status only once it is up.
    retryable = {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.NOT_FOUND,
    }
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            response = stub.Check(request, timeout=remaining, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() not in retryable:
                raise
            last = f"{exc.code().name}: {exc.details()}"
        else:
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        time.sleep(max(0.0, min(_HEALTH_POLL_S, deadline - time.monotonic())))
    raise TimeoutError(f"{SERVICE_NAME} not SERVING after {timeout_s:g} s (last: {last})")


def format_status(status: pb.ClusterStatus) -> str:
    """Render a ``ClusterStatus`` as a header and one table of workers per pool."""
    lines = [
        f"model:           {status.model or '-'}",
        f"policy:          {status.policy or '-'}",
        f"disaggregation:  {status.disaggregation or '-'}",
        f"kv transfer:     {status.kv_transfer_backend or '-'}",
        f"draining:        {'yes' if status.draining else 'no'}",
        f"speculative:     {status.speculative or 'off'}",
    ]
    if status.fault_injection:
        lines.append("fault injection: ON (KV transfers fail on purpose: testing only)")
    if not status.pools:
        lines += ["", "(no pools)"]
    # INCOMING: routed here by the router and not yet arrived (a decode worker's requests
    # still in prefill); the policy already counts them.
    header = ("WORKER", "ROLE", "HEALTHY", "TP", "PP", "RUNNING", "WAITING", "INCOMING")
    header += ("KV USED", "KV CACHED", "KV TOTAL")
    for pool in status.pools:
        lines += ["", f"{pool.role} pool: {pool.healthy_replicas}/{pool.replicas} healthy"]
        if not pool.workers:
            lines.append("  (no workers)")
            continue
        # Only decode workers speculate (prefill samples one token per request).
        spec = bool(status.speculative) and pool.role == "decode"
        rows = [header + (_SPEC_HEADER if spec else ())]
        rows += [_worker_row(w) + (_spec_cells(w) if spec else ()) for w in pool.workers]
        lines += ["  " + line for line in _table(rows, num_left=3)]
        lines += _tier_lines(pool)
        lines += _expert_lines(pool)
    return "\n".join(lines)


# MoE models (docs/moe.md, "Expert load"): how evenly each worker's routers spread the
# pairs over the experts, since it started: the busiest expert over the mean one, for the
# most and least skewed layer (1.00 = even).
_EXPERT_HEADER = ("WORKER", "MOE LAYERS", "PAIRS PER LAYER", "MAX/MEAN: WORST LAYER", "BEST")


def _expert_lines(pool: pb.PoolStatus) -> list[str]:
    """A table of the pool's workers' expert load; none for a dense model."""
    rows = []
    for worker in pool.workers:
        ratios = []
        for load in worker.expert_load:
            mean = sum(load.tokens) / len(load.tokens) if load.tokens else 0.0
            ratios.append((max(load.tokens) / mean if mean else 0.0, load.layer))
        if ratios:
            (worst, worst_layer), (best, best_layer) = max(ratios), min(ratios)
            pairs = sum(worker.expert_load[0].tokens)
            rows.append((worker.name, str(len(ratios)), str(pairs),
                         f"{worst:.2f} (layer {worst_layer})",
                         f"{best:.2f} (layer {best_layer})"))  # fmt: skip
    if not rows:
        return []
    return ["", "  MoE expert load:"] + ["  " + line for line in _table([_EXPERT_HEADER, *rows], 1)]


# The KV tiers below each worker's pool (docs/kv-tiers.md): blocks and bytes held of the
# tier's capacity, and the share of block lookups it answered since the worker started.
_TIER_HEADER = ("WORKER", "TIER", "BLOCKS", "BYTES", "HIT RATE")


def _tier_lines(pool: pb.PoolStatus) -> list[str]:
    """A table of the pool's workers' KV tiers; none when no worker has one."""
    rows = [(w.name, t.name, *_tier_cells(t)) for w in pool.workers for t in w.kv_tiers]
    if not rows:
        return []
    return ["", "  KV tiers:"] + ["  " + line for line in _table([_TIER_HEADER, *rows], 2)]


def _tier_cells(tier: pb.KVTierStatus) -> tuple[str, str, str]:
    blocks = _of(str(tier.blocks), str(tier.capacity_blocks), tier.blocks, tier.capacity_blocks)
    capacity = _format_bytes(tier.capacity_bytes)
    size = _of(_format_bytes(tier.bytes), capacity, tier.bytes, tier.capacity_bytes)
    return blocks, size, _hit_rate(tier.hits, tier.misses)


def _of(used: str, capacity: str, num: int, total: int) -> str:
    percent = f" ({100 * num / total:.1f}%)" if total else ""
    return f"{used} / {capacity}{percent}"


def _hit_rate(hits: int, misses: int) -> str:
    lookups = hits + misses
    return f"{100 * hits / lookups:.1f}% of {lookups}" if lookups else "-"


def format_usage_and_timing(final: pb.Final) -> str:
    """Render a Final's usage and (when the server sent one) its ``Timing`` as three lines."""
    usage = final.usage
    lines = [
        f"usage: {usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} cached), "
        f"{usage.completion_tokens} completion tokens"
    ]
    if not final.HasField("timing"):
        return "\n".join([*lines, "timing: not returned by the server"])
    t = final.timing
    lines.append(
        f"timing: queue {_ms(t.queue_seconds)}, prefill {_ms(t.prefill_seconds)}, "
        f"kv transfer {_ms(t.kv_transfer_seconds)} ({_format_bytes(t.kv_transfer_bytes)}), "
        f"ttft {_ms(t.ttft_seconds)}, e2e {_ms(t.e2e_seconds)}"
    )
    # An empty prefill_worker means the decode worker prefilled locally (no hand-off).
    prefill = t.prefill_worker or "local (on the decode worker)"
    lines.append(f"workers: prefill {prefill}, decode {t.decode_worker or '-'}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


def _format_bytes(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    size = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _worker_row(worker: pb.WorkerStatus) -> tuple[str, ...]:
    total = worker.kv_blocks_total
    return (
        worker.name,
        worker.role,
        _health(worker),
        str(worker.tensor_parallel),
        str(worker.pipeline_parallel),
        str(worker.num_running),
        str(worker.num_waiting),
        str(worker.num_incoming),
        _blocks(worker.kv_blocks_used, total),
        _blocks(worker.kv_blocks_cached, total),
        str(total),
    )


# ACCEPTED: proposed tokens the target accepted / proposed; LEN: tokens a verify step
# emits on average (accepted / steps + 1, the target's own token counted).
_SPEC_HEADER = ("SPEC ACCEPTED", "SPEC LEN")


def _spec_cells(worker: pb.WorkerStatus) -> tuple[str, str]:
    """The worker's acceptance rate and mean accepted length; ``-`` before a verify step."""
    steps, proposed = worker.spec_num_steps, worker.spec_num_draft_tokens
    if not steps:
        return ("-", "-")
    rate = worker.spec_num_accepted_tokens / proposed if proposed else 0.0
    return (f"{100 * rate:.1f}%", f"{worker.spec_num_accepted_tokens / steps + 1:.2f}")


def _health(worker: pb.WorkerStatus) -> str:
    if worker.healthy:
        return "yes"
    # Capitals: a sick worker should stand out; the state says whether it is coming back.
    if worker.state in ("restarting", "failed"):
        return f"NO ({worker.state})"
    return "NO"


def _blocks(num_blocks: int, total: int) -> str:
    percent = f"{100 * num_blocks / total:.1f}%" if total else "-"
    return f"{num_blocks} ({percent})"


def _table(rows: list[tuple[str, ...]], num_left: int) -> list[str]:
    """Align columns: the first ``num_left`` (names) to the left, numbers to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i < num_left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _check_unsigned(name: str, value: int, end: int) -> None:
    # protobuf's own error ("Value out of range") would not say which option was wrong.
    if not 0 <= value < end:
        raise ValueError(f"{name}: must be in [0, {end}), got {value}")
