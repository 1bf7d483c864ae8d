"""Benchmark metrics from per-request records, with ``vllm bench serve``'s definitions.

- TTFT: send → first token. TPOT: ``(e2e - ttft) / (output_len - 1)`` per request with
  more than one output token. ITL: every gap between token-carrying messages, pooled over
  requests. E2E: send → final message. Each as mean, median, p90, p99 (``numpy.percentile``,
  linear interpolation) and standard deviation, in milliseconds, over the completed requests.
- Throughput over the run's duration: completed requests/s, output tokens/s, and
  input + output tokens/s.
- Goodput: completed requests/s that met every SLO given (``ttft``, ``tpot``, ``e2el``,
  in ms; a request with one output token has no TPOT and meets any TPOT SLO).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cluster.loadgen.runner import RequestRecord

PERCENTILES = (90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Slo:
    """Latency objectives in milliseconds; None = no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @staticmethod
    def parse(text: str) -> Slo:
        """``ttft=500,tpot=50`` → Slo(ttft_ms=500, tpot_ms=50)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in SLO_KEYS:
                raise ValueError(
                    f"--slo: expected KEY=MS with KEY in {'/'.join(SLO_KEYS)}, got {part!r}"
                )
            try:
                values[f"{key}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--slo: {key} must be a number of ms, got {value!r}") from None
            if not values[f"{key}_ms"] > 0:
                raise ValueError(f"--slo: {key} must be > 0 ms, got {value}")
        return Slo(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = (
            (self.ttft_ms, record.ttft_s),
            (self.tpot_ms, tpot_s(record)),
            (self.e2el_ms, record.e2e_s),
        )
        return all(
            limit is None or value is None or value * 1e3 <= limit for limit, value in checks
        )


def tpot_s(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.e2e_s is None or record.output_len < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_len - 1)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "std": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s) * 1e3
    out: dict[str, float | None] = {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
    }
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(ms, q))
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, object]:
    done = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    good = sum(slo.met_by(r) for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_ms": _slo_dict(slo),
        "num_good": good,
        "goodput": good / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for r in done if (t := tpot_s(r)) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": distribution_ms([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def _slo_dict(slo: Slo) -> Mapping[str, float]:
    pairs = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2el": slo.e2el_ms}
    return {k: v for k, v in pairs.items() if v is not None}


def turn_summary(records: list[RequestRecord]) -> dict[str, object]:
    """Multi-turn: TTFT and prompt-cache figures of the first turns and of the later ones
    (whose prompts repeat an earlier turn's prompt and reply), over completed requests;
    the requests each decode worker served, and the sessions whose turns ran on more than
    one worker."""
    done = [r for r in records if r.ok]

    def part(rs: list[RequestRecord]) -> dict[str, object]:
        prompt = sum(r.prompt_len for r in rs)
        cached = sum(r.cached_prompt_tokens for r in rs)
        return {
            "completed": len(rs),
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "cached_share": cached / prompt if prompt else None,
            "ttft_ms": distribution_ms([r.ttft_s for r in rs if r.ttft_s is not None]),
        }

    workers: dict[str, int] = {}
    per_session: dict[int, set[str]] = {}
    for r in done:
        workers[r.decode_worker] = workers.get(r.decode_worker, 0) + 1
        per_session.setdefault(r.session if r.session is not None else -1, set()).add(
            r.decode_worker
        )
    return {
        "first_turn": part([r for r in done if r.turn == 0]),
        "later_turns": part([r for r in done if r.turn]),
        "requests_per_worker": dict(sorted(workers.items())),
        "sessions_moved": sum(len(w) > 1 for w in per_session.values()),
    }
