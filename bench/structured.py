"""What structured outputs cost: decode steps with and without a JSON-schema constraint.

On the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF file as ``baton serve`` loads
it; ``--model`` for another), one engine, greedy, prefix caching off:

- **per-token decode cost** at batch 1 and 32: two engines on the same model, each given
  B requests of the same chat prompt, prefilled; then ``--steps`` decode-only steps of
  each, in turn, the order alternating step by step (each step gives every request one
  token; its time is the per-token cost at that batch). ``plain``: no constraint, EOS
  ignored; ``json``: every request under ``SCHEMA`` (a list of 40+ people, so that nobody
  completes within the steps and the batch stays whole). Median step time per round (wall
  and this process's CPU time: the machine may be shared), median over ``--rounds``
  rounds. The goal (issue 41): json at most 1.10x plain. Also the mean time of the two
  stages the constraint adds work to (``engine.step_times``): ``sample`` (the masks) and
  ``update`` (the matchers' advance), which a shared machine's noise does not swamp.
- **compile**: the tokenizer's vocabulary for llguidance (once per engine), a schema's
  first compile (cold: a fresh compiler) and a cached one (the engine's LRU: a copy of
  the compiled matcher), each with its first mask; and the router's
  ``check_structured_output`` (no tokenizer), cold.

    python -m bench.structured --json bench/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from workers.engine.config import EngineConfig
from workers.engine.grammar import GrammarCompiler
from workers.engine.llm_engine import LLMEngine
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.structured_output import StructuredOutput, check_structured_output

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0},
                    "email": {"type": "string", "format": "email"},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["name", "age", "role"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = "List the people of a small team as JSON: name, age, email and role of each."


def default_model() -> tuple[str, str]:
    """(model path, what it is): the default GGUF file, else a random tiny model."""
    try:
        from cluster.default_model import default_gguf
        from workers.models.gguf.derive import default_cache_dir

        return str(default_gguf(default_cache_dir())), "SmolLM2-135M-Instruct Q4_1 (GGUF)"
    except (RuntimeError, OSError) as exc:
        from cluster.tools.make_model import make_model

        path = Path("/tmp/baton-bench-structured-model")
        make_model(path, "llama", "small", overwrite=True)
        return str(path), f"random llama 'small' (make_model; the GGUF failed: {exc})"


def prompt_ids(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")


def start_batch(engine: LLMEngine, batch: int, params: SamplingParams) -> list[str]:
    """``batch`` requests of the chat prompt, prefilled (each has its first token)."""
    ids = [engine.add_request(prompt_ids(engine), params) for _ in range(batch)]
    while any(not engine.scheduler.requests[i].output_token_ids for i in ids):
        engine.step()
    return ids


def end_batch(engine: LLMEngine, ids: list[str]) -> str:
    """Abort the batch; returns its first request's output so far."""
    text = engine.tokenizer.decode(engine.scheduler.requests[ids[0]].output_token_ids)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return text


def timed_step(engine: LLMEngine, batch: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of one decode-only step of ``batch`` requests."""
    t0, c0 = time.perf_counter(), time.process_time()
    deltas = engine.step()
    seconds = (time.perf_counter() - t0, time.process_time() - c0)
    assert len(deltas) == batch and not any(d.finished for d in deltas), "the batch shrank"
    return seconds


def one_round(
    engines: dict[str, LLMEngine], batch: int, structured: StructuredOutput, steps: int, r: int
) -> tuple[dict[str, dict[str, float]], str]:
    """Both engines decode the same batch, one step each in turn (the order alternating
    step by step, and between rounds): median step seconds per engine, wall and CPU."""
    ids = {}
    for name, engine in engines.items():
        params = SamplingParams(
            max_tokens=steps + 8,
            ignore_eos=True,
            temperature=0.0,
            structured=structured if name == "json" else None,
        )
        ids[name] = start_batch(engine, batch, params)
        engine.step_times.reset()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for step in range(steps):
        order = ["plain", "json"] if (step + r) % 2 == 0 else ["json", "plain"]
        for name in order:
            times[name].append(timed_step(engines[name], batch))
    sample = ""
    for name, engine in engines.items():
        text = end_batch(engine, ids[name])
        sample = text if name == "json" else sample
    medians = {
        name: {
            "wall": statistics.median(w for w, _ in ts),
            "cpu": statistics.median(c for _, c in ts),
            # The stages the constraint adds work to (mean wall seconds): the mask in the
            # sampler, the matchers' advance in the update.
            "sample": engines[name].step_times.overhead_share(batch)["sample"],
            "update": engines[name].step_times.overhead_share(batch)["update"],
        }
        for name, ts in times.items()
    }
    return medians, sample


def compile_seconds(engine: LLMEngine, structured: StructuredOutput) -> dict[str, float]:
    def first_mask(compiler: GrammarCompiler) -> float:
        t0 = time.perf_counter()
        matcher = compiler.matcher(structured)
        matcher.fill_mask(np.empty(matcher.mask_words, dtype=np.int32))
        return time.perf_counter() - t0

    fresh = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    t0 = time.perf_counter()
    _ = fresh.ll_tokenizer
    vocabulary = time.perf_counter() - t0
    cold = first_mask(fresh)
    cached = statistics.median(first_mask(fresh) for _ in range(20))
    check_structured_output.cache_clear()
    t0 = time.perf_counter()
    check_structured_output(structured)
    check = time.perf_counter() - t0
    return {
        "vocabulary_s": vocabulary,
        "schema_cold_s": cold,
        "schema_cached_s": cached,
        "router_check_cold_s": check,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2's GGUF file")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    model, what = (args.model, args.model) if args.model else default_model()
    config = EngineConfig(
        model=model,
        device="cpu",
        enable_prefix_caching=False,
        max_num_seqs=max(args.batches),
        max_model_len=1024,
        num_kv_blocks=1024,
        detokenize=False,
    )
    # Two engines on the same weights' file: one decodes plain, the other constrained,
    # a step each in turn, so that the machine's load varies alike for both.
    engines = {"plain": LLMEngine(config), "json": LLMEngine(config)}
    structured = StructuredOutput.json_schema(SCHEMA)
    results: dict = {
        "model": what,
        "dtype": str(engines["plain"].dtype),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(),
        "steps": args.steps,
        "rounds": args.rounds,
        "compile": compile_seconds(engines["json"], structured),
        "decode": {},
    }
    one_round(engines, 1, structured, 4, 0)  # warm-up
    for batch in args.batches:
        rounds = [one_round(engines, batch, structured, args.steps, r) for r in range(args.rounds)]
        out: dict = {"json_sample": rounds[-1][1]}
        for clock in ("wall", "cpu"):
            plain = statistics.median(m["plain"][clock] for m, _ in rounds)
            constrained = statistics.median(m["json"][clock] for m, _ in rounds)
            out[clock] = {
                "plain_step_ms": plain * 1e3,
                "json_step_ms": constrained * 1e3,
                "ratio": constrained / plain,
                "rounds_ms": {
                    name: [m[name][clock] * 1e3 for m, _ in rounds] for name in ("plain", "json")
                },
            }
            print(f"batch {batch} ({clock}): plain {plain * 1e3:.2f} ms/step, json "
                  f"{constrained * 1e3:.2f} ms/step, {constrained / plain:.3f}x")  # fmt: skip
        for stage in ("sample", "update"):
            out[f"{stage}_ms"] = {
                name: statistics.median(m[name][stage] for m, _ in rounds) * 1e3
                for name in ("plain", "json")
            }
        print(f"batch {batch}: sample {out['sample_ms']}, update {out['update_ms']} (ms/step)")
        results["decode"][str(batch)] = out
    results["load_after"] = os.getloadavg()
    print(json.dumps(results["compile"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
