"""The ``baton`` command line: one subcommand per function, heavy imports inside each.

Each subcommand is a ``_Command``: a function that adds its arguments to a subparser
and a function that runs it, returning the exit code. Adding one (``serve``, ``status``,
``bench``) is adding two functions and a line in ``_COMMANDS``. The commands that talk to
a running router (``generate --target``, ``status``, ``scale``) run in ``cli_client.py``; what both
share with the terminal (program name, exit codes, prompt, summary line) is in
``cli_terminal.py``, so the imports go one way: cli -> cli_client -> cli_terminal. The
commands that write model directories (``make-model``, ``train-model``) are in
``cli_models.py``.

Exit codes: 0 ok, 1 failure at run time (I/O, a gRPC error), 2 bad arguments or
configuration (argparse's own errors, every ``ValueError`` and a server's INVALID_ARGUMENT,
printed as ``baton: error: ...``), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster import cli_models, cli_profile
from cluster.cli_models import DTYPES as _DTYPES
from cluster.cli_terminal import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    print_error,
    print_generation_summary,
    read_prompt,
)
from cluster.loadgen import command as _bench  # its module imports only the standard library

_DISAGGREGATION = ("always", "never", "auto")  # cluster.client.DISAGGREGATION_CHOICES


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _positive_seconds(text: str) -> float:
    value = float(text)  # argparse turns a ValueError into "invalid ... value"
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


# ---- generate -------------------------------------------------------------------------


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt ('-' reads stdin)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="run offline on a Hugging Face model dir")
    where.add_argument(
        "--target", metavar="HOST:PORT", help="send to a running Baton router over gRPC"
    )
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="compute dtype, with --model (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N")
    parser.add_argument("--temperature", type=float, default=None, metavar="T")
    parser.add_argument("--top-p", type=float, default=None, metavar="P")
    parser.add_argument("--top-k", type=int, default=None, metavar="K")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop string, not included in the output (repeat for several)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument(
        "--disaggregation",
        choices=_DISAGGREGATION,
        default=None,
        help="with --target: override the router's prefill/decode split for this request",
    )
    parser.add_argument(
        "--no-speculative",
        action="store_true",
        help="with --target: no speculative decoding for this request (same output)",
    )
    parser.add_argument(
        "--timing",
        action="store_true",
        help="with --target: print the server's usage and timing to stderr",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="with --target: deadline of the whole call (default: none)",
    )
    parser.add_argument(
        "--wait",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="with --target: first wait up to SECONDS for the server to be ready "
        "(a cluster that is still starting)",
    )


def _run_generate(args: argparse.Namespace) -> int:
    if args.target is not None:
        from cluster.cli_client import run_generate_remote

        return run_generate_remote(args)
    remote_only = {
        "--disaggregation": args.disaggregation is not None,
        "--no-speculative": args.no_speculative,
        "--timing": args.timing,
        "--timeout": args.timeout is not None,
        "--wait": args.wait is not None,
    }
    for flag, is_set in remote_only.items():
        if is_set:
            raise ValueError(f"{flag} applies only with --target")
    return _run_generate_local(args)


def _run_generate_local(args: argparse.Namespace) -> int:
    from workers import LLM, SamplingParams

    prompt = read_prompt(args.prompt)
    # Only what the user set: SamplingParams and the engine own the defaults.
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    params = SamplingParams(
        **{k: v for k, v in options.items() if v is not None}, ignore_eos=args.ignore_eos
    )
    engine_args = {} if args.dtype is None else {"dtype": args.dtype}
    llm = LLM(args.model, **engine_args)

    start = time.perf_counter()
    first_token_time: float | None = None
    num_tokens = 0
    finish_reason = None
    for delta in llm.stream(prompt, params):
        if delta.token_ids and first_token_time is None:
            first_token_time = time.perf_counter()
        num_tokens += len(delta.token_ids)
        if delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        if delta.finished:
            finish_reason = delta.finish_reason
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()

    reason = getattr(finish_reason, "value", finish_reason)  # a str enum or a plain str
    ttft_s = None if first_token_time is None else first_token_time - start
    print_generation_summary(num_tokens, reason, elapsed, ttft_s)
    return 0


# ---- status ---------------------------------------------------------------------------


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", required=True, metavar="HOST:PORT", help="a running Baton router"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the ClusterStatus message as JSON (proto field names)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="give up after this long (5)",
    )


def _run_status(args: argparse.Namespace) -> int:
    from cluster.cli_client import run_status

    return run_status(args)


# ---- scale ---------------------------------------------------------------------------


def _add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT",
        help="a running router's HTTP API (router.http_port; https://HOST:PORT for TLS)",
    )
    parser.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers")
    parser.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers")
    parser.add_argument(
        "--admin-key-file",
        default=None,
        metavar="FILE",
        help="file holding the admin key (router.admin_key_file); or $BATON_ADMIN_KEY",
    )
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=900.0,
        metavar="SECONDS",
        help="give up after this long (900: new workers load, removed ones drain)",
    )


def _run_scale(args: argparse.Namespace) -> int:
    from cluster.cli_client import run_scale

    return run_scale(args)


# ---- serve -----------------------------------------------------------------------------


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs="?",
        default=None,
        help="cluster config YAML (default: the embedded default: local Ray, a small "
        "random model, 1 prefill + 1 decode worker)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="YAML file of the API keys gRPC and HTTP require (over router.api_keys_file; "
        "docs/security.md); or $BATON_API_KEYS / $BATON_API_KEY. Never a key itself on the "
        "command line: any local user can read a process's arguments",
    )


def _run_serve(args: argparse.Namespace) -> int:
    import logging

    from cluster.config import load_config
    from cluster.config_schema import replaced
    from cluster.serve import run

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config)  # ConfigError is a ValueError: exit 2, key path named
    if args.api_keys_file:
        config = replaced(config, router=replaced(config.router, api_keys_file=args.api_keys_file))
    try:
        return run(config)
    except RuntimeError as exc:  # bring-up failed (a worker did not start, no resources)
        print_error(str(exc))
        return EXIT_FAILURE


_COMMANDS = (
    _Command(
        "serve",
        "serve a cluster config on Ray over gRPC until SIGTERM, then drain",
        _add_serve_arguments,
        _run_serve,
    ),
    _Command(
        "make-model",
        "write a random-weight Hugging Face model directory (offline)",
        cli_models.add_make_model_arguments,
        cli_models.run_make_model,
    ),
    _Command(
        "train-model",
        "train a small Llama target + draft pair on the Python standard library (CPU)",
        cli_models.add_train_model_arguments,
        cli_models.run_train_model,
    ),
    _Command(
        "generate",
        "generate from a prompt (a local model or a running router), streaming to stdout",
        _add_generate_arguments,
        _run_generate,
    ),
    _Command(
        "bench",
        "load-test a running router: TTFT, TPOT, ITL, E2E, throughput, goodput (JSON, plots)",
        _bench.add_arguments,
        _bench.run,
    ),
    _Command(
        "profile",
        "measure a config's step times on this machine in minutes, for planner.profile",
        cli_profile.add_arguments,
        cli_profile.run,
    ),
    _Command(
        "status",
        "show a running cluster's pools, workers, health and KV usage",
        _add_status_arguments,
        _run_status,
    ),
    _Command(
        "scale",
        "show or change a running cluster's prefill and decode workers (live; admin key)",
        _add_scale_arguments,
        _run_scale,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Baton: disaggregated prefill/decode LLM serving."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        # No abbreviations: `--api-key KEY` must not pass as `--api-keys-file`.
        sub = subparsers.add_parser(
            command.name, help=command.help, description=command.help, allow_abbrev=False
        )
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``baton`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage + the error (or --help)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except ValueError as exc:
        print_error(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        print_error(str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
