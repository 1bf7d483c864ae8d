"""Speculative decoding against decoding without it, on the trained target/draft pair.

Two workloads, greedy, EOS ignored, ``--max-tokens`` output tokens per request:

- ``code`` (n-gram prompt lookup): editing code the prompt contains. Each prompt is a
  function from a held-out standard-library file, then a comment asking for it again with
  the function renamed, then the new ``def`` line's start; a model that learned Python
  copies the body, and the lookup finds it in the prompt.
- ``text`` (draft model): windows of held-out standard-library source (files the pair
  never trained on).

Each batch size B runs all the prompts (as many as the largest B), B at a time, so batch 1
is sixteen requests one after another rather than one prompt's luck; three engines
alternate within each repeat: ``off`` (no speculation), ``forced`` (speculating at every step) and ``auto``
(the default settings: the engine measures what a speculating step costs per batch size
and lets each request speculate while its acceptance pays for it, up to
``speculative_max_batch_size``: workers/engine/speculative/gate.py). Reported per engine and B: the
median over repeats of tokens/s per request (each request's tokens over its own latency,
mean over the batch), output tokens per CPU-second of this process, the acceptance rate
and mean accepted length (accepted per verify step + 1), and the ratios against ``off``
in the same repeat, of both rates (medians of the per-repeat ratios). Outputs are checked token for
token against ``off``.

    python -m bench.speculative --repeats 3 --json bench/speculative.json
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from workers import LLM, SamplingParams

MAX_PROMPT_TOKENS = 384


def code_edit_prompts(texts: tuple[str, ...], num: int, tokenizer, seed: int) -> list[str]:
    """Functions of 8..40 lines from ``texts``, each asked for again under a new name."""
    functions = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if 8 <= body.count("\n") <= 40 and len(tokenizer.encode(body)) < 300:
                    functions.append((node.name, body))
    rng = random.Random(seed)
    rng.shuffle(functions)
    prompts = []
    for name, body in functions[:num]:
        new = f"{name}_v2"
        prompts.append(f"{body}\n\n\n# The same function as above, renamed to {new}.\ndef {new}(")
    if len(prompts) < num:
        raise ValueError(f"only {len(prompts)} functions of the right size found")
    return prompts


def text_prompts(texts: tuple[str, ...], num: int, tokenizer, seed: int) -> list[list[int]]:
    """Windows of 256 tokens from ``texts`` (one per file of at least 1024 tokens, from a
    random offset): the trainer's ``continuation_probe`` prompts, chosen by the same code."""
    from cluster.tools.train_onpolicy import continuation_prompts

    prompts = continuation_prompts([tokenizer.encode(t) for t in texts], num, 256, seed).tolist()
    if len(prompts) < num:
        raise ValueError(f"only {len(prompts)} held-out files are long enough")
    return prompts


def run_once(
    llm: LLM, prompts: list, max_tokens: int, params: list[SamplingParams] | None = None
) -> dict:
    """One batch to completion: per-request tok/s, CPU time, tokens, speculation counters.
    ``params``: one per prompt (default: greedy, ``max_tokens``, EOS ignored)."""
    engine = llm.engine
    engine.block_manager.evict()  # every run starts cold: no prefix-cache hits across runs
    before = engine.spec_stats
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = params or [greedy] * len(prompts)
    tokens: dict[str, list[int]] = defaultdict(list)
    done: dict[str, float] = {}
    start, start_cpu = time.perf_counter(), time.process_time()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                done[delta.request_id] = time.perf_counter() - start
    cpu = time.process_time() - start_cpu
    after = engine.spec_stats
    steps = after.num_steps - before.num_steps
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "rates": [len(tokens[i]) / done[i] for i in ids],
        "produced": sum(len(tokens[i]) for i in ids),
        "cpu_s": cpu,
        "tokens": [tokens[i] for i in ids],
        "verify_steps": steps,
        "drafted": drafted,
        "accepted": accepted,
    }


def run_groups(llm: LLM, prompts: list, batch: int, max_tokens: int) -> dict:
    """Every prompt, ``batch`` at a time (so batch 1 is not one prompt's luck): per-request
    tok/s averaged over all requests, tokens per CPU-second and acceptance over all groups."""
    runs = [
        run_once(llm, prompts[i : i + batch], max_tokens) for i in range(0, len(prompts), batch)
    ]
    steps = sum(r["verify_steps"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    return {
        "tok_s_per_request": statistics.mean(rate for r in runs for rate in r["rates"]),
        "tok_per_cpu_s": sum(r["produced"] for r in runs) / sum(r["cpu_s"] for r in runs),
        "tokens": [t for r in runs for t in r["tokens"]],
        "verify_steps": steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / steps + 1 if steps else 0.0,
    }


def prompt_cost(target: str, draft: str, prompts: list, repeats: int) -> dict:
    """What a decode worker pays for the draft's prompt KV (it is never transferred): the
    draft's prefill of a prompt against the target's, medians of ``repeats``."""
    times: dict[str, list[float]] = defaultdict(list)
    llms = {name: LLM(path, dtype="float32", max_model_len=1024) for name, path in
            (("target", target), ("draft", draft))}  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0.0)
    for _ in range(repeats + 1):
        for name, llm in llms.items():
            llm.engine.block_manager.evict()
            start = time.perf_counter()
            llm.generate(prompts, one)
            times[name].append(time.perf_counter() - start)
    target_s = statistics.median(times["target"][1:])
    draft_s = statistics.median(times["draft"][1:])
    return {
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "target_prefill_s": target_s,
        "draft_prefill_s": draft_s,
        "draft_over_target": draft_s / target_s,
    }


def bench_workload(
    target: str, draft: str, method: str, prompts: list, args: argparse.Namespace
) -> dict:
    common = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": max(args.batches)}
    spec = {"speculative_method": method, "speculative_num_tokens": args.k}
    if method == "draft":
        spec["speculative_draft_model"] = draft
    engines = {
        "off": LLM(target, **common),
        "auto": LLM(target, **common, **spec),
    }
    results: dict = {}
    for batch in args.batches:
        forced = LLM(target, **common, **spec, speculative_max_batch_size=batch)
        forced.engine.spec.adaptive = False  # speculate at every step, measured or not
        runs: dict[str, list[dict]] = defaultdict(list)
        for repeat in range(args.repeats + 1):  # the first round warms up, unrecorded
            for name, llm in (
                ("off", engines["off"]),
                ("forced", forced),
                ("auto", engines["auto"]),
            ):
                out = run_groups(llm, prompts, batch, args.max_tokens)
                if repeat:
                    runs[name].append(out)
        want = runs["off"][0]["tokens"]
        row = {}
        for name, outs in runs.items():
            assert all(o["tokens"] == want for o in outs), f"{name} changed the greedy output"
            ratios = [
                o["tok_s_per_request"] / off["tok_s_per_request"]
                for o, off in zip(outs, runs["off"], strict=True)
            ]
            cpu_ratios = [
                o["tok_per_cpu_s"] / off["tok_per_cpu_s"]
                for o, off in zip(outs, runs["off"], strict=True)
            ]
            row[name] = {
                "tok_s_per_request": statistics.median(o["tok_s_per_request"] for o in outs),
                "tok_per_cpu_s": statistics.median(o["tok_per_cpu_s"] for o in outs),
                "acceptance_rate": statistics.median(o["acceptance_rate"] for o in outs),
                "mean_accepted_length": statistics.median(o["mean_accepted_length"] for o in outs),
                "speculated": any(o["verify_steps"] for o in outs),
                "ratio_vs_off": statistics.median(ratios),
                "ratios_vs_off": [round(r, 3) for r in ratios],
                "cpu_ratio_vs_off": statistics.median(cpu_ratios),
                "cpu_ratios_vs_off": [round(r, 3) for r in cpu_ratios],
            }
            print(f"{method:5} B={batch:2} {name:6} " + " ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row[name].items()
                if k not in ("ratios_vs_off", "cpu_ratios_vs_off")
            ), flush=True)  # fmt: skip
        results[str(batch)] = row
        del forced
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target model dir (default: the bench trained pair)")
    parser.add_argument("--draft", help="draft model dir (default: the bench trained pair)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--num-prompts",
        type=int,
        help="prompts per workload (default: the largest batch; 16 makes batch 1 alone "
        "comparable with a run of --batches 1 4 16)",
    )
    parser.add_argument("-k", type=int, default=4, help="speculative_num_tokens")
    parser.add_argument("--workloads", nargs="+", default=["code", "text"])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from cluster.tools.train import trained_pair
    from cluster.tools.train_corpus import stdlib_split

    target, draft = args.target, args.draft
    if target is None or draft is None:
        pair = trained_pair("bench")
        target, draft = target or str(pair[0]), draft or str(pair[1])
    tokenizer = LLM(target, dtype="float32", num_kv_blocks=64, max_model_len=1024).engine.tokenizer
    held_out = stdlib_split(None).held_out
    n = max(max(args.batches), args.num_prompts or 0)
    report: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "target": target,
        "draft": draft,
        "args": {k: v for k, v in vars(args).items() if k != "json"} | {"json": str(args.json)},
    }
    if "code" in args.workloads:
        prompts = code_edit_prompts(held_out, n, tokenizer, seed=0)
        report["ngram_code"] = bench_workload(target, draft, "ngram", prompts, args)
    if "text" in args.workloads:
        prompts = text_prompts(held_out, n, tokenizer, seed=0)
        report["draft_text"] = bench_workload(target, draft, "draft", prompts, args)
        report["draft_prompt_cost"] = prompt_cost(target, draft, prompts, args.repeats)
        print("draft prompt KV on a decode worker:", report["draft_prompt_cost"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
