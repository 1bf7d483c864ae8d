"""``baton bench --dataset multi-turn``: the command's parts for multi-turn sessions (the
workload from the arguments, the run over gRPC, the summary lines of first and later turns);
``command.py`` calls them."""

from __future__ import annotations

import argparse
import asyncio
import sys

from cluster.loadgen.multiturn import MultiTurnWorkload, multi_turn_workload
from cluster.loadgen.runner import RequestRecord


def session_workload(
    args: argparse.Namespace, max_model_len: int, vocab_size: int, seed: int
) -> MultiTurnWorkload:
    """The sessions of one run, refused when the last turns overflow ``max_model_len``."""
    workload = multi_turn_workload(
        args.num_sessions, args.num_turns, args.system_prompt_len, args.input_len,
        args.output_len, args.range_ratio, args.think_time, vocab_size, seed,
    )  # fmt: skip
    if workload.longest_request() > max_model_len:
        raise ValueError(
            f"multi-turn: the last turns need up to {workload.longest_request()} tokens "
            f"(history + reply), over the model's max_model_len ({max_model_len}): "
            "lower --num-turns / --system-prompt-len / --input-len / --output-len"
        )
    return workload


def run_session_workload(
    args: argparse.Namespace, target: str, workload: MultiTurnWorkload, rate: float
) -> tuple[list[RequestRecord], float]:
    """Send ``workload`` to ``target`` over gRPC, sessions arriving at ``rate`` per second."""
    from tqdm import tqdm

    from cluster.loadgen.arrivals import arrival_offsets
    from cluster.loadgen.sessions import run_sessions

    offsets = arrival_offsets(len(workload.sessions), rate, args.burstiness, args.seed)
    label = f"{rate:g} sessions/s"
    total = workload.num_requests
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=None) as bar:
        return asyncio.run(
            run_sessions(
                target, workload, offsets, max_concurrency=args.max_concurrency,
                max_sessions=args.max_sessions, ignore_eos=args.ignore_eos,
                disaggregation=args.disaggregation, timeout_s=args.timeout,
                on_done=lambda _: bar.update(1),
            )
        )  # fmt: skip


def format_turns(m: dict) -> list[str]:
    """The summary's lines of a multi-turn run's first and later turns."""
    lines = [f"{'turns':<8}{'done':>6}{'cached':>9}{'TTFT p50':>11}{'p90':>10}{'p99':>10}"]
    for key, name in (("first_turn", "first"), ("later_turns", "later")):
        part, ttft = m[key], m[key]["ttft_ms"]
        share = f"{part['cached_share']:.0%}" if part["cached_share"] is not None else "-"
        cells = "".join(
            f"{ttft[k]:>{w}.2f}" if ttft[k] is not None else f"{'-':>{w}}"
            for k, w in (("median", 11), ("p90", 10), ("p99", 10))
        )
        lines.append(f"{name:<8}{part['completed']:>6}{share:>9}{cells}")
    lines.append(
        f"requests per worker: {m['requests_per_worker']}; "
        f"sessions on more than one worker: {m['sessions_moved']}"
    )
    return lines
