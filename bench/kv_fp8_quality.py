"""What the FP8 KV cache costs in accuracy, on a model that has learned something.

Model: the target of a trained pair (``cluster.tools.train.trained_pair``: a Llama trained
on the Python standard library's source), or ``--model DIR``. Held-out text: the standard
library files the trainer held out, tokenized with the model's tokenizer and cut into the
trainer's evaluation windows.

Each window is run as the engine runs a request: its first half as one prefill chunk (whose
attention already reads the K/V it just stored), then one token at a time (decodes reading
the cached prefix), all windows batched, through Baton's model and paged KV cache. Every
position's logits are kept. Variants, each against the unquantized KV cache of the same
model dtype:

- ``fp32`` / ``fp8`` (float32 model): float32 KV vs FP8 KV;
- ``bf16`` / ``bf16+fp8`` (bfloat16 model, ``--bf16``): bfloat16 KV vs FP8 KV.

Reported: held-out perplexity (and its ratio to the unquantized KV's) and next-token
agreement (the share of positions whose argmax token is the unquantized KV's).

    python -m bench.kv_fp8_quality --kind test --bf16 --json bench/kv_fp8_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from bench.quant_quality import write_quality_json
from cluster.tools.train import held_out_windows
from kernels.attention_metadata import build_attention_metadata, slot_mapping_for
from workers.engine.kv_cache import allocate_kv_cache
from workers.models import load_model

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype  # the model's (and the unquantized KV's)
    kv_cache_dtype: str
    reference: str  # the variant whose argmax it is compared with


VARIANTS = (
    Variant("fp32", torch.float32, "auto", "fp32"),
    Variant("fp8", torch.float32, "fp8_e4m3", "fp32"),
)
BF16_VARIANTS = (
    Variant("bf16", torch.bfloat16, "auto", "bf16"),
    Variant("bf16+fp8", torch.bfloat16, "fp8_e4m3", "bf16"),
)


def window_logits(model, config, variant: Variant, windows: torch.Tensor) -> torch.Tensor:
    """[num_windows, seq_len, vocab] float32 logits: a prefill of each window's first half,
    then its other tokens one decode step at a time, all windows in each step."""
    n, seq_len = windows.shape[0], windows.shape[1] - 1
    inputs = windows[:, :-1]
    prefill_len = seq_len // 2
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n)]
    kv_cache = allocate_kv_cache(
        n * blocks_per_seq, config.num_hidden_layers, config.num_key_value_heads, BLOCK_SIZE,
        config.head_dim, variant.dtype, torch.device("cpu"), variant.kv_cache_dtype,
    )  # fmt: skip
    out = torch.empty(n, seq_len, config.vocab_size)
    with torch.inference_mode():
        lens = [prefill_len] * n
        slots = slot_mapping_for(lens, lens, tables, BLOCK_SIZE)
        metadata = build_attention_metadata(lens, lens, tables, slots, num_decodes=0)
        positions = torch.arange(prefill_len).repeat(n)
        hidden = model(inputs[:, :prefill_len].flatten(), positions, kv_cache, metadata)
        out[:, :prefill_len] = model.compute_logits(hidden).float().view(n, prefill_len, -1)
        for pos in range(prefill_len, seq_len):
            seq_lens = [pos + 1] * n
            slots = slot_mapping_for([1] * n, seq_lens, tables, BLOCK_SIZE)
            metadata = build_attention_metadata([1] * n, seq_lens, tables, slots, num_decodes=n)
            positions = torch.full((n,), pos)
            hidden = model(inputs[:, pos].contiguous(), positions, kv_cache, metadata)
            out[:, pos] = model.compute_logits(hidden).float()
    return out


def evaluate(model_dir: Path, windows: torch.Tensor, variants) -> dict[str, dict[str, float]]:
    labels = windows[:, 1:].flatten()
    results: dict[str, dict[str, float]] = {}
    argmaxes: dict[str, torch.Tensor] = {}
    for variant in variants:
        model, config = load_model(model_dir, variant.dtype, torch.device("cpu"))
        t0 = time.process_time()
        logits = window_logits(model, config, variant, windows).flatten(0, 1)
        nll = F.cross_entropy(logits, labels, reduction="mean").item()
        argmaxes[variant.name] = argmax = logits.argmax(-1)
        reference = results.get(variant.reference)
        results[variant.name] = r = {
            "model_dtype": str(variant.dtype).removeprefix("torch."),
            "kv_cache_dtype": variant.kv_cache_dtype,
            "perplexity": math.exp(nll),
            "top1_accuracy": (argmax == labels).float().mean().item(),
            "cpu_seconds": round(time.process_time() - t0, 1),
        }
        ref_argmax = argmaxes[variant.reference]
        r["next_token_agreement"] = (argmax == ref_argmax).float().mean().item()
        r["perplexity_ratio"] = r["perplexity"] / (reference or r)["perplexity"]
        print(json.dumps({variant.name: r}), flush=True)
        del model
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="test", help="trained pair / recipe: test or bench")
    ap.add_argument("--model", type=Path, help="model directory (default: the pair's target)")
    ap.add_argument("--max-windows", type=int, help="at most this many held-out windows")
    ap.add_argument("--bf16", action="store_true", help="also the bfloat16 model's pair")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.model is None:
        from cluster.tools.train import trained_pair

        args.model, _ = trained_pair(args.kind)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    windows = held_out_windows(args.kind, tokenizer)
    windows = windows[: args.max_windows] if args.max_windows else windows
    variants = VARIANTS + (BF16_VARIANTS if args.bf16 else ())
    results = evaluate(args.model, windows, variants)
    print(f"{args.model}: {windows.shape[0]} windows x {windows.shape[1] - 1} tokens held out")
    print("variant   perplexity  ratio  agreement  top-1")
    for name, r in results.items():
        print(f"{name:9} {r['perplexity']:10.4f}  {r['perplexity_ratio']:.4f}  "
              f"{r['next_token_agreement']:9.4f}  {r['top1_accuracy']:.4f}")  # fmt: skip
    if args.json:
        write_quality_json(args.json, args.model, args.kind, windows, results)


if __name__ == "__main__":
    main()
