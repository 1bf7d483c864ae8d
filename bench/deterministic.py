"""What ``model.deterministic`` costs: the same workload with the mode off and on.

On SmolLM2-135M-Instruct (a real trained Llama; its Hugging Face conversion, see
bench/peers.py), in ``--dtypes`` (bfloat16 and float32), each configuration in a fresh
process, the order alternating between rounds (off, on / on, off), medians over rounds:

- **batched**: bench/peers.py's 32 chat prompts (~40 tokens) at once, greedy, 128 new
  tokens, EOS suppressed, prefix caching off: output tokens / second;
- **single stream**: decode tok/s of one request at a time, ``(128 - 1) / (T(128) -
  T(1))`` (bench/peers.py ``_measure``); TPOT is its inverse;
- **long prefill**: one prompt of ~1,500 tokens (the 32 prompts 4 times in one message),
  one token out: seconds (every query token of a prefill goes through the per-token
  attention in the mode, kernels/batch_invariant.py).

The mode's goal (issue "Deterministic serving"): at most 1.3x slower. Also reported: how
many of the 32 greedy outputs the two modes agree on (they may differ: the mode changes
roundings, not the model).

    python -m bench.deterministic --rounds 3 --json bench/deterministic.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import PROMPTS, _measure, chat_token_ids, read_bandwidth


def _run(job: dict) -> dict:
    from workers import LLM, SamplingParams

    llm = LLM(
        job["hf_dir"],
        dtype=job["dtype"],
        device="cpu",
        deterministic=job["deterministic"],
        enable_prefix_caching=False,
        max_num_seqs=len(job["prompts"]),
        detokenize=False,
    )

    def generate(prompts, n):
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
        return [list(o.token_ids) for o in llm.generate(prompts, [params] * len(prompts))]

    result = _measure(job, generate)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        generate([job["long_prompt"]], 1)
        times.append(time.perf_counter() - t0)
    result["long_prefill_s"] = statistics.median(times)
    return result


def _long_prompt(hf_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    # The 32 prompts four times over (~1,500 tokens): a long prompt made of text this
    # benchmark already uses; its content does not matter to a prefill's time.
    message = {"role": "user", "content": " ".join(PROMPTS * 4)}
    return list(
        tok.apply_chat_template([message], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )


def _first_divergence(one: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(one, other, strict=True)) if a != b), len(one))


def run_one(job: dict, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.deterministic", "--runner", fh.name],
        env=dict(env, PYTHONPATH=str(root)), cwd=root, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    os.unlink(fh.name)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", default="/work/models/smollm2-135m")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single", type=int, default=4, help="single-stream prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.runner:
        print("RESULT " + json.dumps(_run(json.loads(Path(args.runner).read_text()))))
        return
    prompts = chat_token_ids(args.hf_dir)
    base = {"hf_dir": args.hf_dir, "prompts": prompts, "single": args.single,
            "long_prompt": _long_prompt(args.hf_dir)}  # fmt: skip
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for dtype in args.dtypes.split(","):
            order = (False, True) if r % 2 == 0 else (True, False)
            for det in order:
                key = f"{dtype} deterministic={'on' if det else 'off'}"
                res = run_one({**base, "dtype": dtype, "deterministic": det}, args.threads)
                runs.setdefault(key, []).append(res)
                print(f"round {r} {key}: batched {res['batched_tok_s']:.1f} tok/s, single "
                      f"{res['single_decode_tok_s']:.1f} tok/s, long prefill "
                      f"{res['long_prefill_s']:.3f} s", flush=True)  # fmt: skip
    summary = {}
    for dtype in args.dtypes.split(","):
        off, on = runs[f"{dtype} deterministic=off"], runs[f"{dtype} deterministic=on"]

        def med(rs, k):
            return statistics.median(x[k] for x in rs)

        same = sum(a == b for a, b in zip(off[0]["outputs"], on[0]["outputs"], strict=True))
        # Against float32 without the mode (the closest to the trained model here): where
        # each mode's greedy outputs first leave it, median over prompts (128 = never).
        fp32 = runs.get("float32 deterministic=off")
        agree = {}
        if fp32 is not None:
            for mode, rs in (("off", off), ("on", on)):
                agree[mode] = statistics.median(
                    _first_divergence(a, b)
                    for a, b in zip(rs[0]["outputs"], fp32[0]["outputs"], strict=True)
                )
        summary[dtype] = {
            "batched_tok_s": {"off": med(off, "batched_tok_s"), "on": med(on, "batched_tok_s")},
            "single_decode_tok_s": {
                "off": med(off, "single_decode_tok_s"), "on": med(on, "single_decode_tok_s"),
            },
            "long_prefill_s": {"off": med(off, "long_prefill_s"), "on": med(on, "long_prefill_s")},
            "slowdown_batched": med(off, "batched_tok_s") / med(on, "batched_tok_s"),
            "slowdown_tpot": med(off, "single_decode_tok_s") / med(on, "single_decode_tok_s"),
            "slowdown_long_prefill": med(on, "long_prefill_s") / med(off, "long_prefill_s"),
            "greedy_outputs_equal_off_vs_on": f"{same}/{len(prompts)}",
            "median_first_divergence_from_float32_off": agree,
        }  # fmt: skip
        print(dtype, json.dumps(summary[dtype], indent=1))
    record = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "threads": args.threads,
        "read_bandwidth_gb_s": read_bandwidth(args.threads),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "long_prompt_tokens": len(base["long_prompt"]),
        "summary": summary,
        "runs": {
            k: [{kk: vv for kk, vv in x.items() if kk != "outputs"} for x in v]
            for k, v in runs.items()
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
