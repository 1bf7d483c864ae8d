"""What every ``baton`` subcommand shares with the terminal: the program name in error
lines, the exit codes, the prompt read from an argument or stdin, and the streamed-text
line endings and summary of ``baton generate`` (offline and ``--target``).

Standard library only: ``cluster/cli.py`` imports it to build the parser, and
``cluster/cli_client.py`` (grpc) imports it when a gRPC subcommand runs; neither imports
the other's private names.
"""

from __future__ import annotations

import sys

PROG = "baton"
EXIT_FAILURE = 1  # at run time: I/O, a gRPC error, a server that is not there
EXIT_USAGE = 2  # bad arguments or configuration (argparse's own code)
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT


def print_error(message: str) -> None:
    """``baton: error: MESSAGE`` on stderr, the form of argparse's own errors."""
    print(f"{PROG}: error: {message}", file=sys.stderr)


def read_prompt(prompt: str) -> str:
    """The prompt argument, or all of stdin when it is ``-``."""
    return sys.stdin.read() if prompt == "-" else prompt


def end_line(has_text: bool) -> None:
    """Finish a line of streamed text so that the error or the shell prompt starts clean."""
    if has_text:
        sys.stdout.write("\n")
        sys.stdout.flush()


def print_generation_summary(
    num_tokens: int, finish_reason: object, elapsed_s: float, ttft_s: float | None
) -> None:
    """``[N tokens, finish: REASON, R tokens/s, ttft T ms]`` on stderr after a generation
    (``ttft_s`` None: no token came)."""
    ttft = "" if ttft_s is None else f", ttft {1e3 * ttft_s:.0f} ms"
    rate = num_tokens / elapsed_s if elapsed_s > 0 else 0.0
    print(
        f"[{num_tokens} tokens, finish: {finish_reason}, {rate:.1f} tokens/s{ttft}]",
        file=sys.stderr,
    )
