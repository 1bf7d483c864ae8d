"""Engine throughput against Hugging Face transformers, and the engine's per-step overhead.

Workload: N requests, prompt lengths uniform in [16, 512], output lengths uniform in
[8, 256] (EOS ignored, greedy), random token ids, on one model directory (default: a
`small` Llama made on the spot), float32, same process, same torch threads.

- Baton: ``LLM.generate`` over all requests (continuous batching, max_num_seqs=B).
- transformers: ``generate`` in padded static batches of B requests in arrival order
  (left padding, each batch runs until its longest output); only each request's own
  output tokens count as useful.
- With ``--transformers-onednn``, also transformers with every ``nn.Linear`` sent through
  oneDNN over a packed weight, as Baton does on CPU (``kernels/cpu_linear.py``): not the
  reference, but it shows what Baton gains apart from its matmul library.
- Overhead: B requests decoding together; mean time per stage of steps at batch B, and
  the share of the step that is not the model (schedule + input prep + sample + update).

    python -m bench.engine --repeats 3 --json bench/engine.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from cluster.tools.make_model import make_model
from kernels import cpu_linear
from workers import LLM, SamplingParams


def make_workload(num: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))]
        work.append((prompt, rng.randint(8, 256)))
    return work


def run_baton(llm: LLM, work: list[tuple[list[int], int]]) -> tuple[float, int, float]:
    """(wall seconds, tokens produced, CPU seconds of this process) of one repeat."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    # Every repeat starts cold: the prompts are the same each time, and a prefix-cache hit
    # would skip prefill work that transformers has to do.
    llm.engine.block_manager.evict()
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(n for _, n in work), "engine produced the wrong number of tokens"
    assert all(o.num_cached_tokens == 0 for o in outs), "a prompt was served from the cache"
    return elapsed, produced, cpu


def run_transformers(model, work: list[tuple[list[int], int]], batch: int, pad_id: int):
    useful = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            group = work[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(group):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            longest = max(n for _, n in group)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            assert out.shape[1] == width + longest
            useful += sum(n for _, n in group)
    return time.perf_counter() - start, useful


def pack_hf_linears(model) -> int:
    """Send every ``nn.Linear`` of a transformers model through oneDNN over a packed weight
    (mutates the model; returns how many)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        packed = cpu_linear.pack(m.weight.detach())
        m.forward = functools.partial(cpu_linear.linear, packed=packed, bias=m.bias)
    return len(linears)


def measure_overhead(llm: LLM, batch: int, vocab: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(batch)]
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.evict()
    llm.engine.step_times.reset()
    llm.generate(prompts, params)
    return llm.engine.step_times.overhead_share(batch)  # decode-only steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model directory (default: make a small llama)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--transformers-onednn",
        action="store_true",
        help="also time transformers with its linears through oneDNN (not the reference)",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    model_dir = Path(args.model) if args.model else Path(".models/bench-small-llama")
    if not args.model and not (model_dir / "config.json").exists():
        make_model(model_dir, "llama", "small", seed=args.seed)

    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    vocab = llm.engine.vocab_size
    work = make_workload(args.num_requests, vocab, args.seed)
    num_params = sum(p.numel() for p in llm.engine.model.parameters())
    head, embed = llm.engine.model.lm_head, llm.engine.model.model.embed_tokens
    if llm.engine.arch.tie_word_embeddings and head.weight is not embed.weight:
        num_params -= head.weight.numel()  # a tied head's packed copy is no parameter
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4))  # warm-up

    hf_model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_model.generation_config.eos_token_id = None
        run_transformers(hf_model, [([11, 12, 13], 4)], 1, 0)  # warm-up
    hf_onednn = None
    if args.transformers_onednn:
        from transformers import AutoModelForCausalLM

        hf_onednn = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_onednn.generation_config.eos_token_id = None
        pack_hf_linears(hf_onednn)
        if hf_model is not None:  # the same model, through another matmul
            ids = torch.tensor([work[0][0]])
            with torch.inference_mode():
                torch.testing.assert_close(
                    hf_onednn(ids).logits, hf_model(ids).logits, rtol=1e-3, atol=1e-3
                )
        run_transformers(hf_onednn, [([11, 12, 13], 4)], 1, 0)  # warm-up

    baton_tps, hf_tps, ratios, onednn_tps, baton_cpu_tps = [], [], [], [], []
    for r in range(args.repeats):
        seconds, produced, cpu = run_baton(llm, work)
        baton_tps.append(produced / seconds)
        # Tokens per CPU-second of the process: on a shared machine, wall time also counts
        # the time other processes held the cores; CPU time much less so (with one torch
        # thread, none of OpenMP's spin-waiting either).
        baton_cpu_tps.append(produced / cpu)
        line = f"run {r}: baton {produced / seconds:8.1f} tok/s ({seconds:.1f} s"
        line += f", {produced / cpu:.1f} tok per CPU-s)"
        if hf_model is not None:
            hf_seconds, useful = run_transformers(hf_model, work, args.max_num_seqs, 0)
            hf_tps.append(useful / hf_seconds)
            ratios.append(baton_tps[-1] / hf_tps[-1])
            line += f" | transformers {hf_tps[-1]:8.1f} tok/s ({hf_seconds:.1f} s)"
            line += f" | ratio {ratios[-1]:.2f}x"
        if hf_onednn is not None:
            hf_seconds, useful = run_transformers(hf_onednn, work, args.max_num_seqs, 0)
            onednn_tps.append(useful / hf_seconds)
            line += f" | transformers+oneDNN {onednn_tps[-1]:8.1f} tok/s"
            line += f" ({baton_tps[-1] / onednn_tps[-1]:.2f}x)"
        print(line, flush=True)

    overhead = measure_overhead(llm, args.max_num_seqs, vocab, args.seed)
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "model_dir": str(model_dir),
        "num_params": num_params,
        "num_requests": args.num_requests,
        "max_num_seqs": args.max_num_seqs,
        "output_tokens": sum(n for _, n in work),
        "prompt_tokens": sum(len(p) for p, _ in work),
        "baton_tok_s": baton_tps,
        "baton_tok_per_cpu_s": baton_cpu_tps,
        "median_baton_tok_per_cpu_s": statistics.median(baton_cpu_tps),
        "transformers_tok_s": hf_tps,
        "ratio": ratios,
        "median_baton_tok_s": statistics.median(baton_tps),
        "median_transformers_tok_s": statistics.median(hf_tps) if hf_tps else None,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "transformers_onednn_tok_s": onednn_tps,
        "median_ratio_to_transformers_onednn": (
            statistics.median(b / o for b, o in zip(baton_tps, onednn_tps, strict=True))
            if onednn_tps
            else None
        ),
        "overhead_at_batch": {"batch": args.max_num_seqs, **overhead},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
