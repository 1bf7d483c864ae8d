"""lm-evaluation-harness against ``baton serve`` and against ``transformers`` on the same
weights (issue 41): the same scores, request for request.

    python -m bench.lm_eval_check --lm-eval-python /work/lmeval/bin/python \\
        --model /work/models/smollm2-135m --json bench/lm_eval_check.json

Two tasks of our own, written to a temporary directory (the harness's usual datasets come
from the Hugging Face Hub, which this machine cannot reach; these are generated here from
a fixed seed, so they tune nothing):

- ``baton_arith_mc`` (``multiple_choice``, a loglikelihood task): "Question: What is 17 +
  25?\\nAnswer:" with four numbers to choose from. Against Baton through
  ``local-completions`` (the prompt and each continuation as token ids, ``echo`` with
  ``logprobs``: the prompt logprobs), against ``transformers`` through the harness's ``hf``
  model.
- ``baton_arith_gen`` (``generate_until``, greedy, until a newline): the same questions to
  answer in words, through the chat template: ``local-chat-completions`` against
  ``hf`` with ``--apply_chat_template``.

Both sides run in the harness's own environment (``--lm-eval-python``: lm-eval, its
``api`` extra, transformers and accelerate; see below) with ``--log_samples``, and the
report compares the metrics and every sample: the loglikelihoods (largest difference) and
the greedy answers (how many equal). Baton serves the model directory as a disaggregated
cluster (one prefill and one decode worker, float32): what it answers crossed the KV
hand-off.

The harness's environment (not Baton's: lm-eval brings datasets, pandas, scikit-learn
and more): ``python3 -m venv /work/lmeval && /work/lmeval/bin/pip install torch==2.13.0
&& /work/lmeval/bin/pip install "lm-eval[api]" transformers==5.24.0 accelerate``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cluster_proc import ServedCluster, free_port

NUM_QUESTIONS = 100
SEED = 2026


def questions(n: int = NUM_QUESTIONS, seed: int = SEED) -> list[dict]:
    """Sums of two numbers, four choices each (the answer and three near misses)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        answer = a + b
        wrong = set()
        while len(wrong) < 3:
            guess = answer + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])
            if guess > 0 and guess != answer:
                wrong.add(guess)
        choices = [str(c) for c in sorted({answer, *wrong})]
        out.append(
            {
                "question": f"What is {a} + {b}?",
                "choices": [f" {c}" for c in choices],
                "label": choices.index(str(answer)),
                "answer": str(answer),
            }
        )
    return out


def write_tasks(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    data = root / "arith.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions()))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    )
    (root / "baton_arith_mc.yaml").write_text(
        "task: baton_arith_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "baton_arith_gen.yaml").write_text(
        "task: baton_arith_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "{{question}} Answer with the number only."\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n"]\n  max_gen_toks: 32\n  do_sample: false\n  temperature: 0\n'
        # The model answers in words ("48 + 23 = 71"): its last number is its answer.
        "filter_list:\n  - name: last_number\n    filter:\n      - function: regex\n"
        '        regex_pattern: "(\\\\d+)"\n        group_select: -1\n'
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


def run_harness(python: str, args: list[str], out: Path, env: dict[str, str]) -> dict:
    """One ``lm_eval`` run; its results and samples (task -> list of sample records)."""
    cmd = [python, "-m", "lm_eval", *args, "--output_path", str(out), "--log_samples"]
    started = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        "seconds": time.perf_counter() - started,
        "results": results["results"],
        "samples": samples,
    }


def compare(baton: dict, reference: dict) -> dict:
    """Per task: both metrics, and how the samples agree."""
    out = {}
    for task, ref_samples in reference["samples"].items():
        got = {s["doc_id"]: s for s in baton["samples"].get(task, [])}
        ref = {s["doc_id"]: s for s in ref_samples}
        row: dict = {
            "baton": {k: v for k, v in baton["results"][task].items() if "," in k},
            "transformers": {k: v for k, v in reference["results"][task].items() if "," in k},
            "num_samples": len(ref),
        }
        if task.endswith("_mc"):
            diffs = [
                abs(float(a[0][0]) - float(b[0][0]))
                for doc_id in ref
                for a, b in zip(got[doc_id]["resps"], ref[doc_id]["resps"], strict=True)
            ]
            row["max_abs_loglikelihood_diff"] = max(diffs)
            row["mean_abs_loglikelihood_diff"] = sum(diffs) / len(diffs)
            row["same_choice"] = sum(_argmax(got[d]) == _argmax(ref[d]) for d in ref)
        else:
            row["same_answer"] = sum(
                got[d]["filtered_resps"] == ref[d]["filtered_resps"] for d in ref
            )
            row["differing"] = [
                {"doc": d, "baton": got[d]["filtered_resps"], "hf": ref[d]["filtered_resps"]}
                for d in ref
                if got[d]["filtered_resps"] != ref[d]["filtered_resps"]
            ][:5]
        out[task] = row
    return out


def _argmax(sample: dict) -> int:
    values = [float(r[0][0]) for r in sample["resps"]]
    return values.index(max(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval-python", default="/work/lmeval/bin/python")
    parser.add_argument("--model", default="/work/models/smollm2-135m")
    parser.add_argument("--tasks", default="baton_arith_mc,baton_arith_gen")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--tree",
        default=str(Path(__file__).resolve().parents[1]),
        help="the Baton checkout to serve",
    )
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    work = Path(tempfile.mkdtemp(prefix="lmeval"))
    include = write_tasks(work / "tasks")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    report: dict = {
        "command": "python -m bench.lm_eval_check "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(),
        "model": args.model,
    }
    # transformers first, then Baton (alternating is moot: scores, not times).
    mc = [t for t in tasks if t.endswith("_mc")]
    gen = [t for t in tasks if not t.endswith("_mc")]
    hf_args = f"pretrained={args.model},dtype=float32"
    reference = {"results": {}, "samples": {}, "seconds": 0.0}
    for names, chat in ((mc, False), (gen, True)):
        if not names:
            continue
        extra = ["--apply_chat_template"] if chat else []
        got = run_harness(
            args.lm_eval_python,
            ["--model", "hf", "--model_args", hf_args, "--tasks", ",".join(names),
             "--include_path", str(include), "--batch_size", "8", "--device", "cpu", *extra],
            work / ("hf-chat" if chat else "hf"),
            env,
        )  # fmt: skip
        _merge(reference, got)
    config = {
        "model": {"path": args.model, "name": "smollm2", "dtype": "float32", "max_model_len": 1024},
        "prefill": {"replicas": 1, "max_num_seqs": 16, "max_num_batched_tokens": 1024},
        "decode": {"replicas": 1, "max_num_seqs": 16, "max_num_batched_tokens": 1024},
        "kv_cache": {"block_size": 16, "num_blocks": 1024},
        "kv_transfer": {"backend": "nixl"},
        "router": {"port": 0, "http_port": free_port(), "disaggregation": "always"},
        "metrics": {"port": 0},
    }
    served = ServedCluster(config, work, tree=Path(args.tree))
    baton = {"results": {}, "samples": {}, "seconds": 0.0}
    try:
        base = served.http_url + "/v1"
        common = f"model=smollm2,tokenizer_backend=huggingface,tokenizer={args.model}"
        for names, chat in ((mc, False), (gen, True)):
            if not names:
                continue
            model = "local-chat-completions" if chat else "local-completions"
            url = base + ("/chat/completions" if chat else "/completions")
            extra = ["--apply_chat_template"] if chat else []
            got = run_harness(
                args.lm_eval_python,
                ["--model", model,
                 "--model_args", f"{common},base_url={url},num_concurrent=4,max_retries=1",
                 "--tasks", ",".join(names), "--include_path", str(include), *extra],
                work / ("baton-chat" if chat else "baton"),
                env,
            )  # fmt: skip
            _merge(baton, got)
    finally:
        served.stop()
    report["load_after"] = os.getloadavg()
    report["seconds"] = {"transformers": reference["seconds"], "baton": baton["seconds"]}
    report["tasks"] = compare(baton, reference)
    print(json.dumps(report["tasks"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _merge(into: dict, got: dict) -> None:
    into["results"].update(got["results"])
    into["samples"].update(got["samples"])
    into["seconds"] += got["seconds"]


if __name__ == "__main__":
    raise SystemExit(main())
