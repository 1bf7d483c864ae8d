"""The chaos campaign's figures (bench/chaos.py): the cluster's metrics, the report
written to ``--json``, and its Markdown table (docs/reliability.md, bench/RESULTS.md)."""

from __future__ import annotations

import os
import platform
import re
import sys
import urllib.request
from collections import Counter
from pathlib import Path

# The codes a request may end with (docs/reliability.md); anything else is a finding.
DOCUMENTED = {
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
    "DEADLINE_EXCEEDED",
}

# A hostile request must be refused as the client's fault (or end as the client asked).
HOSTILE_OK = {
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
    "400",
    "404",
    "413",
    "422",
    "429",
}


def scrape(urls: list[str]) -> dict[str, float]:
    """Sum of every sample per ``name{labels}`` over the metrics endpoints."""
    totals: Counter = Counter()
    for url in urls:
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\deE.naNInf]+)$", line)
            if m:
                totals[m.group(1) + (m.group(2) or "")] += float(m.group(3))
    return dict(totals)


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Total of ``name``'s samples with ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: Counter = Counter()
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        m = re.search(rf'{label}="([^"]*)"', rest)
        if base == name and m:
            out[m.group(1)] += value
    return dict(out)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} (shared with other sessions)"


def diagnose_wrong(model_dir: str, engine_args: dict, wrong: list[dict]) -> list[dict]:
    """Each WRONG answer as JSON, with where it left the reference and by how much, from
    the reference model's logits after ``prompt + expected[:i]`` (``i``: the first
    differing token; transformers' float32 forward of the same weights, whose own
    rounding is far below the margins that matter here):

    - greedy: ``logit_margin``, the expected token's logit minus the returned one's (a
      flip by rounding needs a margin of a few ulps; a defect shows as a large one);
    - sampled: each token's probability under the request's temperature and the
      ``mass_between`` them in the vocabulary's order, which inverse-CDF sampling walks: a
      seeded draw lands on a neighbour by a rounding of the CDF only if that mass is ~0
      (``tokens_between`` is then 0); a defect shows as a token far away.

    Over HTTP only the text is known: no diagnosis. ``engine_args``: recorded, the
    reference being the cluster's dtype and mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = None
    out = []
    for w in wrong:
        case = w.get("case")
        entry = {k: v for k, v in w.items() if k != "case"}
        if case is None:
            out.append(entry)
            continue
        entry.update(prompt_len=len(case.prompt), temperature=case.temperature, seed=case.seed)
        expected, got = w["expected"], w["got"]
        i = next((j for j, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
        entry["first_difference"] = i if i is not None else min(len(expected), len(got))
        if i is None:
            out.append(entry)
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            ids = torch.tensor([[*case.prompt, *expected[:i]]])
            logits = model(ids).logits[0, -1].double()
        e, g = expected[i], got[i]
        diag = {"expected_token": e, "returned_token": g, "reference": engine_args}
        if case.temperature == 0:
            diag["logit_margin"] = float(logits[e] - logits[g])
        else:
            probs = torch.softmax(logits / case.temperature, dim=-1)
            lo, hi = min(e, g), max(e, g)
            diag.update(
                p_expected=float(probs[e]),
                p_returned=float(probs[g]),
                tokens_between=hi - lo - 1,
                mass_between=float(probs[lo + 1 : hi].sum()),
            )
        entry["diagnosis"] = diag
        out.append(entry)
    return out


def summarize(args, campaign, load, settled, after, samples, survived, rc, cluster) -> dict:
    outcomes = load.outcomes.by_outcome()
    restarts = sum(settled.get("restarts", {}).values())
    leaked = sum(settled.get("kv_blocks_used", {}).values()) if settled else None
    tracebacks = sum("Traceback" in line for line in cluster.lines)
    hostile_outcomes = Counter()
    for (frontend, _name, outcome), n in campaign.hostile.items():
        hostile_outcomes[f"{frontend}:{outcome}"] += n
    crashes = {
        "serving_process_died": not survived,
        "unexpected_worker_restarts": max(0, restarts - len(campaign.kills)),
        "workers_not_serving_at_end": sum(
            s != "serving" for s in settled.get("states", {}).values()
        ),
    }
    refusal_p99 = percentile(campaign.probe_s, 0.99)
    report = {
        "command": "python -m bench.chaos " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "minutes": args.minutes,
        "cluster": f"{args.prefill} prefill + {args.decode} decode, tiny llama, CPU, NIXL "
        f"(direction {args.direction})",
        "faults_env": args.faults,
        "requests": {
            "sent": sum(outcomes.values()),
            "completed_equal": outcomes.get("equal", 0),
            "completed_wrong": outcomes.get("WRONG", 0),
            "errors": {
                k.removeprefix("error:"): v for k, v in outcomes.items() if k.startswith("error:")
            },
            "by_frontend": {f"{f}:{o}": n for (f, o), n in sorted(load.outcomes.counts.items())},
            "error_examples": load.outcomes.errors,
            "wrong": campaign.wrong,  # every one (up to 200), diagnosed
            "latency_p50_s": percentile(load.latencies, 0.5),
            "latency_p99_s": percentile(load.latencies, 0.99),
        },
        "model": {
            "dtype": args.dtype,
            "deterministic": args.deterministic,
            "distinct_prompts": args.num_prompts,
        },
        # What the workload made the cluster do (each a path a wrong answer could come from).
        "handoffs": metric_sum(samples, "baton_kv_transfer_seconds_count"),
        "prefix_cache_hit_tokens": metric_sum(samples, "baton_prefix_cache_hit_tokens_total"),
        "prefix_cache_queried_tokens": metric_sum(
            samples, "baton_prefix_cache_queried_tokens_total"
        ),
        "migrations": metric_sum(samples, "baton_router_migrations_total"),
        "migrations_by_cause": by_label(samples, "baton_router_migrations_total", "cause"),
        "workers_killed": len(campaign.kills),
        "kills": campaign.kills,
        "faults_injected": by_label(samples, "baton_kv_faults_injected_total", "kind"),
        "kv_transfer_failures": by_label(samples, "baton_kv_transfer_failures_total", "stage"),
        "kv_lease_expiries": metric_sum(samples, "baton_kv_lease_expiries_total"),
        "hostile": {
            "inputs_tried": sum(campaign.hostile.values()),
            "outcomes": dict(sorted(hostile_outcomes.items())),
            "by_case": {f"{f}:{n}:{o}": c for (f, n, o), c in sorted(campaign.hostile.items())},
        },
        "fuzz": campaign.fuzz,
        "overload": {
            "bursts": len(campaign.overload_admitted),
            "admitted_per_burst": campaign.overload_admitted,
            "burst_refusals": len(campaign.refusal_s),
            "burst_refuse_p50_ms": ms(percentile(campaign.refusal_s, 0.5)),
            "burst_refuse_p99_ms": ms(percentile(campaign.refusal_s, 0.99)),
            "probe_refusals": len(campaign.probe_s),
            "probe_refuse_p50_ms": ms(percentile(campaign.probe_s, 0.5)),
            "probe_refuse_p99_ms": ms(refusal_p99),
        },
        "crashes": crashes,
        "traceback_lines_in_cluster_output": tracebacks,
        "settled": settled,
        "after_chaos": after,
        "cluster_exit_status": rc,
    }
    after_total = sum(after.values())
    report["goals"] = {
        "no_wrong_tokens": outcomes.get("WRONG", 0) == 0,
        "only_documented_errors": all(
            k.removeprefix("error:") in DOCUMENTED for k in outcomes if k.startswith("error:")
        ),
        "no_crash": not any(crashes.values()),
        "no_leaked_blocks": leaked == 0,
        "still_serves": after_total > 0
        and sum(n for k, n in after.items() if k.endswith(":equal")) == after_total,
        "refuse_p99_under_50ms": refusal_p99 is None or refusal_p99 < 0.05,
        "fuzzers_passed": campaign.fuzz is None or campaign.fuzz["passed"],
        "hostile_refused_as_client_errors": all(
            outcome in HOSTILE_OK for (_, _, outcome) in campaign.hostile
        ),
    }
    return report


def after_chaos(after: dict[str, int]) -> str:
    """``{"grpc:equal": 24, ...}`` as "grpc 24/24, http 6/6"."""
    parts = []
    for frontend in ("grpc", "http"):
        total = sum(n for k, n in after.items() if k.startswith(frontend + ":"))
        if total:
            parts.append(f"{frontend} {after.get(frontend + ':equal', 0)}/{total}")
    return ", ".join(parts) or "none answered"


def figures_table(report: dict) -> str:
    """The campaign's figures as a Markdown table (docs/reliability.md, bench/RESULTS.md)."""
    req, over = report["requests"], report["overload"]
    errors = ", ".join(f"{code} {n}" for code, n in sorted(req["errors"].items())) or "none"
    faults = report["faults_injected"]
    hostile = report["hostile"]
    rows = [
        ("requests sent (steady load)", req["sent"]),
        ("completed, equal to the reference", req["completed_equal"]),
        ("completed with WRONG output (goal 0)", req["completed_wrong"]),
        ("failed, by code", errors),
        (
            "model, distinct prompts",
            f"{report['model']['dtype']}, deterministic "
            f"{'on' if report['model']['deterministic'] else 'off'}, "
            f"{report['model']['distinct_prompts']} prompts",
        ),
        ("KV hand-offs received (decode)", int(report["handoffs"])),
        (
            "prefix-cache hits, tokens (of queried)",
            f"{int(report['prefix_cache_hit_tokens'])} "
            f"(of {int(report['prefix_cache_queried_tokens'])})",
        ),
        ("migrated (router)", int(report["migrations"])),
        ("worker processes killed (SIGKILL)", report["workers_killed"]),
        (
            "transfer faults injected",
            ", ".join(f"{k} {int(v)}" for k, v in sorted(faults.items())) or "none",
        ),
        (
            "failed transfers recomputed on decode",
            int(report["kv_transfer_failures"].get("receive", 0)),
        ),
        ("prefill leases expired", int(report["kv_lease_expiries"])),
        ("hostile inputs tried", hostile["inputs_tried"]),
        ("hostile outcomes", ", ".join(f"{k} {n}" for k, n in hostile["outcomes"].items())),
        (
            "fuzzed inputs tried (bench/fuzz.py, meanwhile)",
            "not run"
            if not report.get("fuzz")
            else f"{report['fuzz']['total_inputs_tried']} "
            f"({'passed' if report['fuzz']['passed'] else 'a property FAILED'})",
        ),
        ("crashes (goal 0)", sum(int(v) for v in report["crashes"].values())),
        (
            "KV blocks in use once idle (goal 0)",
            sum(report["settled"].get("kv_blocks_used", {}).values()),
        ),
        ("after the chaos, answers equal to the reference", after_chaos(report["after_chaos"])),
        (
            "time to refuse under overload, p50 / p99 (goal p99 < 50 ms)",
            f"{over['probe_refuse_p50_ms']} / {over['probe_refuse_p99_ms']} ms "
            f"({over['probe_refusals']} refusals)",
        ),
        (
            "... refusals within a burst, p50 / p99 (client-side)",
            f"{over['burst_refuse_p50_ms']} / {over['burst_refuse_p99_ms']} ms "
            f"({over['burst_refusals']} refusals)",
        ),
        ("request latency p50 / p99", f"{req['latency_p50_s']:.2f} / {req['latency_p99_s']:.2f} s"),
    ]
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)
