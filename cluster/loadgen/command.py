"""``baton bench --target HOST:PORT`` (gRPC) or ``baton bench --backend openai --base-url
http://HOST:PORT`` (the OpenAI-compatible HTTP API): arguments, the run over one or more request rates,
the printed summary, the JSON result and the charts."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_DATASETS = ("random", "shared-prefix", "trace", "multi-turn")


def _rate(text: str) -> float:
    value = float(text)  # "inf" parses
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 req/s (inf = all at once), got {text!r}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="grpc: the router, HOST:PORT")
    parser.add_argument(
        "--backend", choices=("grpc", "openai"), default="grpc", help="the API to drive (grpc)"
    )
    parser.add_argument(
        "--base-url", help="openai: the server, http://HOST:PORT (the /v1 is optional)"
    )
    parser.add_argument(
        "--api-key", default=None, help="openai: bearer token (default: $OPENAI_API_KEY)"
    )
    parser.add_argument("--dataset", choices=_DATASETS, default="random", help="(random)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests per rate (100)")
    parser.add_argument(
        "--input-len", type=int, default=256, help="prompt tokens; multi-turn: per user message"
    )
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens (64)")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random, multi-turn: lengths in len×[1-r, 1+r] (0)",
    )
    parser.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix: tokens of each group's prefix"
    )
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups (4)")
    parser.add_argument(
        "--trace", type=Path, help="trace: JSONL of timestamp/input_length/output_length"
    )
    parser.add_argument("--num-sessions", type=int, default=16, help="multi-turn: sessions (16)")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns each (4)")
    parser.add_argument(
        "--system-prompt-len", type=int, default=256, help="multi-turn: shared system prompt (256)"
    )
    parser.add_argument(
        "--think-time", type=float, default=1.0, help="multi-turn: mean pause between turns, s (1)"
    )
    parser.add_argument(
        "--max-sessions", type=int, default=None, help="multi-turn: most sessions in progress"
    )
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        help="req/s (default inf; trace: its timestamps; multi-turn: new sessions/s)",
    )
    rate.add_argument("--rates", type=_rates, help="a sweep, e.g. 1,2,4: one run per rate")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    parser.add_argument(
        "--slo", default="", help="goodput objectives in ms: ttft=500,tpot=50,e2el=..."
    )
    parser.add_argument("--disaggregation", choices=("always", "never", "auto"), default=None)
    parser.add_argument("--seed", type=int, default=0, help="of lengths, token ids, arrivals (0)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each request, s")
    parser.add_argument(
        "--wait", type=float, default=60.0, help="wait this long for readiness (60)"
    )
    parser.add_argument(
        "--result-json", type=Path, help="write the results (with per-request records)"
    )
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts to DIR")


_SWEEP_SEED_STEP = 1000  # rate i of a sweep draws its prompts with seed + 1000 i


@dataclass(frozen=True)
class _Model:
    name: str
    max_model_len: int
    vocab_size: int


def run(args: argparse.Namespace) -> int:
    from cluster.loadgen.metrics import Slo, summarize, turn_summary
    from cluster.loadgen.session_command import run_session_workload, session_workload

    slo = Slo.parse(args.slo)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("max_concurrency", "max_sessions"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.dataset == "multi-turn" and args.backend != "grpc":
        raise ValueError(
            "--dataset multi-turn: gRPC only (each turn re-sends the model's earlier replies "
            "as token ids; the HTTP API streams text)"
        )
    target = _target(args)
    try:
        info = _model_info(args, target)
    except ConnectionError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 1
    multi_turn = args.dataset == "multi-turn"
    if multi_turn:
        session_workload(args, info.max_model_len, info.vocab_size, args.seed)  # fails early
    else:
        requests = _dataset(args, info.vocab_size, args.seed)
        too_long = [r for r in requests if len(r.prompt_ids) + r.max_tokens > info.max_model_len]
        if too_long:
            raise ValueError(
                f"{len(too_long)} requests exceed the model's max_model_len ({info.max_model_len}) "
                "with prompt + output tokens: shorten --input-len / --output-len / --prefix-len"
            )
    if args.warmup:
        warm = _warmup_requests(args, info.vocab_size)
        _run_once(args, target, info.name, warm, [0.0] * len(warm), "warm-up")
    # No rate: a trace keeps its timestamps, anything else goes all at once.
    unset = None if args.dataset == "trace" else math.inf
    rates = args.rates or [args.request_rate if args.request_rate is not None else unset]
    results, runs = [], []
    for index, rate in enumerate(rates):
        if multi_turn:
            # Each rate of a sweep: sessions of its own (seed + 1000 i), as below.
            seed = args.seed + _SWEEP_SEED_STEP * index
            workload = session_workload(args, info.max_model_len, info.vocab_size, seed)
            records, duration = run_session_workload(args, target, workload, rate)
        else:
            if index:
                # Fresh prompts for each later rate of a sweep (lengths from the same
                # distribution, the trace's own): the earlier rates' prompts are in the
                # workers' prefix caches and would be served from there.
                requests = _dataset(args, info.vocab_size, args.seed + _SWEEP_SEED_STEP * index)
            offsets = _offsets(args, requests, rate)
            records, duration = _run_once(args, target, info.name, requests, offsets, _label(rate))
        summary = {
            "request_rate": _rate_value(rate),
            **summarize(records, duration, slo),
        }
        if multi_turn:
            summary["multi_turn"] = turn_summary(records)
        print(format_summary(summary))
        results.append({**summary, "requests": [asdict(r) for r in records]})
        runs.append((_label(rate, "sessions/s" if multi_turn else "req/s"), records))
    if args.result_json:
        document = {
            "target": target,
            "model": info.name,
            "dataset": args.dataset,
            "arguments": {
                k: _plain(v)
                for k, v in vars(args).items()
                if k not in ("run", "command", "api_key")  # no secret in a result file
            },
            "runs": results,
        }
        args.result_json.write_text(json.dumps(document, indent=1, allow_nan=False))
        print(f"wrote {args.result_json}")
    if args.plot:
        _plot(args.plot, runs, results)
    failed = sum(r["failed"] for r in results)
    return 1 if failed == sum(r["num_requests"] for r in results) else 0


def _target(args: argparse.Namespace):
    """The gRPC target "HOST:PORT", or the OpenAI backend's base URL ending in /v1."""
    from cluster.client import parse_target
    from cluster.loadgen.openai_runner import normalise_base_url

    if args.backend == "openai":
        if not args.base_url:
            raise ValueError("--base-url: required with --backend openai")
        if args.target:
            raise ValueError("--target: gRPC only; with --backend openai use --base-url")
        if args.api_key is None:
            args.api_key = os.environ.get("OPENAI_API_KEY")
        return normalise_base_url(args.base_url)
    if not args.target:
        raise ValueError("--target: required (or --backend openai --base-url URL)")
    if args.base_url:
        raise ValueError("--base-url: only with --backend openai")
    return parse_target(args.target)


def _model_info(args: argparse.Namespace, target: str) -> _Model:
    """Raises ConnectionError when the server cannot be reached or refuses."""
    if args.backend == "openai":
        from cluster.loadgen.openai_runner import model_info

        return _Model(*model_info(target, args.api_key, args.wait))
    import grpc

    from cluster.client import call_metadata, wait_ready
    from proto.baton.v1 import inference_pb2 as pb
    from proto.baton.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            wait_ready(channel, args.wait)
            stub = pb_grpc.InferenceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=call_metadata())
        except grpc.RpcError as exc:
            raise ConnectionError(f"{target}: {exc.code().name}: {exc.details()}") from None
    return _Model(info.name, info.max_model_len, info.vocab_size)


def _dataset(args: argparse.Namespace, vocab_size: int, seed: int):
    from cluster.loadgen import datasets

    if args.dataset == "random":
        return datasets.random_dataset(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, seed
        )
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(
            args.num_prompts, args.num_groups, args.prefix_len, args.input_len,
            args.output_len, vocab_size, seed,
        )  # fmt: skip
    if args.trace is None:
        raise ValueError("--dataset trace needs --trace FILE")
    return datasets.trace_dataset(args.trace, args.num_prompts, vocab_size, seed)


def _warmup_requests(args: argparse.Namespace, vocab_size: int):
    if args.dataset != "multi-turn":
        return _dataset(args, vocab_size, args.seed + 1)[: args.warmup]
    from cluster.loadgen.datasets import random_dataset

    # Single requests of a user message's length: they share no prefix with the sessions.
    return random_dataset(
        args.warmup, args.input_len, args.output_len, 0.0, vocab_size, args.seed + 1
    )


def _offsets(args: argparse.Namespace, requests, rate: float | None) -> list[float]:
    from cluster.loadgen.arrivals import arrival_offsets

    if rate is None and args.dataset == "trace":
        return [r.arrival_s for r in requests]
    return arrival_offsets(len(requests), rate or math.inf, args.burstiness, args.seed)


def _label(rate: float | None, unit: str = "req/s") -> str:
    return "trace timing" if rate is None else f"{rate:g} {unit}"


def _run_once(args, target: str, model: str, requests, offsets: list[float], label: str):
    from tqdm import tqdm

    from cluster.loadgen.openai_runner import OpenAITarget, run_requests_openai
    from cluster.loadgen.runner import run_requests

    # disable=None: a bar on a terminal, nothing in logs and CI.
    with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, disable=None) as bar:
        options = dict(
            max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
            disaggregation=args.disaggregation, timeout_s=args.timeout,
            on_done=lambda _: bar.update(1),
        )  # fmt: skip
        if args.backend == "openai":
            http = OpenAITarget(target, model, args.api_key)
            return asyncio.run(run_requests_openai(http, requests, offsets, **options))
        return asyncio.run(run_requests(target, requests, offsets, **options))


def _plot(directory: Path, runs, results) -> None:
    from cluster.loadgen.plots import plot_latency_cdfs, plot_rate_sweep

    directory.mkdir(parents=True, exist_ok=True)
    plot_latency_cdfs(runs, directory / "latency_cdf.png")
    written = ["latency_cdf.png"]
    if len(results) > 1:
        plot_rate_sweep(results, directory / "rate_sweep.png")
        written.append("rate_sweep.png")
    print(f"wrote {', '.join(str(directory / w) for w in written)}")


def _rate_value(rate: float | None) -> float | str:
    """A rate as JSON can hold it: a number, "inf" (all at once) or "trace"."""
    if rate is None:
        return "trace"
    return rate if math.isfinite(rate) else "inf"


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _number(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def format_summary(s: dict) -> str:
    rate = s["request_rate"]
    unit = "sessions/s" if "multi_turn" in s else "req/s"
    lines = [
        f"==== rate {'trace' if rate == 'trace' else f'{_number(rate)} {unit}'} ====",
        f"requests: {s['completed']} completed, {s['failed']} failed {s['errors'] or ''}",
        f"duration: {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
    ]
    if s["slo_ms"]:
        lines.append(f"goodput: {s['goodput']:.2f} req/s ({s['num_good']} within {s['slo_ms']})")
    lines.append(f"{'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = s[key]
        cells = "".join(
            f"{d[k]:>10.2f}" if d[k] is not None else f"{'-':>10}"
            for k in ("mean", "median", "p90", "p99")
        )
        lines.append(f"{key[:-3].upper():<6}{cells}")
    if "multi_turn" in s:
        from cluster.loadgen.session_command import format_turns

        lines += format_turns(s["multi_turn"])
    return "\n".join(lines)
