"""How well a ``baton profile`` predicts another: fit the planner's step model on one
profile's records and predict the other's, both ways.

    baton profile --out a.json && baton profile --out b.json
    python -m bench.profile_fit a.json b.json

Prints each profile's duration and, per pool, the median and p90 of |predicted -
measured| / measured over the other profile's records (each record's own prediction from
the fitted ``a + b*tokens + c*work`` or ``a + b*batch + c*kv/1000``). Two runs on the same
machine bound what a profile can promise: the fit's error on steps it did not see, plus
the machine's run-to-run drift.
"""

from __future__ import annotations

import argparse

from cluster.planner.profile import StepProfile, load_profile
from cluster.planner.simulator import percentile
from cluster.planner.step_model import StepModel


def errors(fitted: StepProfile, measured: StepProfile) -> dict[str, tuple[float, float]]:
    model = StepModel(warmup_steps=0)
    model.seed(fitted.steps())
    pre = [
        abs(model.prefill_seconds(r.tokens, r.attention_work) - r.seconds) / r.seconds
        for r in measured.prefill
    ]
    dec = [
        abs(model.decode_seconds(r.batch, r.kv_tokens) - r.seconds) / r.seconds
        for r in measured.decode
    ]
    return {
        "prefill": (percentile(pre, 0.5), percentile(pre, 0.9)),
        "decode": (percentile(dec, 0.5), percentile(dec, 0.9)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args(argv)
    a, b = load_profile(args.first), load_profile(args.second)
    for name, p in ((args.first, a), (args.second, b)):
        print(
            f"{name}: {p.model}, {p.threads} thread(s), {p.seconds:.0f} s, "
            f"{len(p.prefill)} prefill + {len(p.decode)} decode records"
        )
    for label, fitted, measured in (("a -> b", a, b), ("b -> a", b, a)):
        for pool, (p50, p90) in errors(fitted, measured).items():
            print(f"{label} {pool:7s}: median error {p50:6.1%}, p90 {p90:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
