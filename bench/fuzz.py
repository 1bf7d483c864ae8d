"""The front-end fuzz campaign (issue 25): run every fuzzer with N examples and count the
inputs tried.

    python -m bench.fuzz --examples 2000 [--json out.json]

Runs tests/router/test_fuzz_grpc.py and tests/router/test_fuzz_http.py under the
``campaign`` hypothesis profile (tests/conftest.py) with ``FUZZ_EXAMPLES=N``; each fuzzer
writes how many inputs it tried to a count file, read back here. Hypothesis may try more
inputs than N (its explicit ``@example`` cases, replays of saved failures). Exit status is
pytest's: non-zero when a property failed (the report then names the failing input).
:func:`run_fuzzers` is the same as a function, for the chaos campaign.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

FUZZ_TESTS = (
    "tests/router/test_fuzz_grpc.py",
    "tests/router/test_fuzz_http.py",
    "tests/router/test_fuzz_headers.py",
)


@dataclass(frozen=True)
class FuzzResult:
    examples: int  # asked for, per fuzzer
    inputs_tried: dict[str, int]  # fuzzer -> inputs it tried
    total_inputs_tried: int
    passed: bool
    seconds: float
    output_tail: str  # pytest's last lines (the failing input, when one failed)


def run_fuzzers(examples: int, timeout_s: float = 3600.0) -> FuzzResult:
    """Run both front ends' fuzzers with ``examples`` examples each (a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        counts = os.path.join(tmp, "counts")
        env = {
            **os.environ,
            "HYPOTHESIS_PROFILE": "campaign",
            "FUZZ_EXAMPLES": str(examples),
            "FUZZ_COUNT_FILE": counts,
        }
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FUZZ_TESTS],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        seconds = time.monotonic() - start
        tried: dict[str, int] = {}
        if os.path.exists(counts):
            with open(counts) as f:
                for line in f:
                    name, count = line.split()
                    tried[name] = tried.get(name, 0) + int(count)
    return FuzzResult(
        examples=examples,
        inputs_tried=tried,
        total_inputs_tried=sum(tried.values()),
        passed=proc.returncode == 0,
        seconds=round(seconds, 1),
        output_tail=(proc.stdout + proc.stderr)[-4000:],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per fuzzer")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    result = run_fuzzers(args.examples)
    summary = {k: v for k, v in asdict(result).items() if k != "output_tail"}
    print(json.dumps(summary, indent=2))
    if not result.passed:
        print(result.output_tail, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
