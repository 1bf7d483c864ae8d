"""What quantized weights cost in accuracy, on a model that has learned something.

Model: the target of a trained pair (``cluster.tools.train.trained_pair``: a Llama trained
on the Python standard library's source), or ``--model DIR``. Held-out text: the
standard library files the trainer held out (never seen in training), tokenized with the
model's tokenizer and cut into the trainer's evaluation windows (``--kind`` picks the
recipe's window length and token budget).

For each variant the model is loaded by Baton's loader with that ``quantization``, run
over every window (prefill through the paged KV cache, float32 activations), and
measured by held-out perplexity and by next-token agreement with the fp32 model (the
share of positions where both models' argmax is the same token). Variants:

- ``fp32``: the stored weights, float32;
- ``fp8``: FP8 e4m3 weights, per 128x128 block (as ``baton make-model --quantize fp8``
  writes them), dequantized at load;
- ``fp8-channel``: a compressed-tensors ``float-quantized`` checkpoint, per-channel scales
  (weights only: its dynamic FP8 activations are not applied);
- ``int4``: INT4 weights, asymmetric, groups of 128 (the on-load default; GPTQ-asym and
  AWQ checkpoints of the same model give the same logits, tests/workers/test_quant.py),
  through torch's int4-packed CPU matmul;
- ``int4-gptq-sym``: a symmetric GPTQ checkpoint, groups of 128 (the common published kind).

    python -m bench.quant_quality --kind test --json bench/quant_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from cluster.tools.train import held_out_windows
from kernels.attention_metadata import build_attention_metadata, slot_mapping_for
from workers.engine.kv_cache import allocate_kv_cache
from workers.models import load_model
from workers.models.quant.export import quantize_checkpoint

BLOCK_SIZE = 16
WINDOWS_PER_STEP = 8


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str  # model.quantization
    scheme: str | None = None  # load a copy written by `make-model --quantize SCHEME` instead
    kv_cache_dtype: str = "auto"  # kv_cache.dtype (the attention ops read it off the cache)


VARIANTS = (
    Variant("fp32", "none"),
    Variant("fp8", "fp8"),
    Variant("fp8-channel", "none", scheme="fp8-channel"),
    Variant("int4", "int4"),
    Variant("int4-gptq-sym", "none", scheme="int4-gptq"),
    Variant("fp8-kv", "none", kv_cache_dtype="fp8_e4m3"),
)


def make_kv_cache(variant: Variant, config, num_blocks: int) -> torch.Tensor:
    """The paged KV cache for one step of windows, in the variant's KV-cache dtype."""
    return allocate_kv_cache(
        num_blocks, config.num_hidden_layers, config.num_key_value_heads, BLOCK_SIZE,
        config.head_dim, torch.float32, torch.device("cpu"), variant.kv_cache_dtype,
    )  # fmt: skip


def window_logits(model, config, variant: Variant, windows: torch.Tensor) -> torch.Tensor:
    """[num_windows, seq_len, vocab] float32 logits of every window's inputs (prefill)."""
    out = []
    seq_len = windows.shape[1] - 1
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    for chunk in windows.split(WINDOWS_PER_STEP):
        n = chunk.shape[0]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(n)]
        lens = [seq_len] * n
        slots = slot_mapping_for(lens, lens, tables, BLOCK_SIZE)
        metadata = build_attention_metadata(lens, lens, tables, slots, num_decodes=0)
        kv_cache = make_kv_cache(variant, config, n * blocks_per_seq)
        positions = torch.arange(seq_len).repeat(n)
        with torch.inference_mode():
            hidden = model(chunk[:, :-1].flatten(), positions, kv_cache, metadata)
            out.append(model.compute_logits(hidden).view(n, seq_len, -1))
    return torch.cat(out)


def evaluate(model_dir: Path, windows: torch.Tensor) -> dict[str, dict[str, float]]:
    labels = windows[:, 1:].flatten()
    results: dict[str, dict[str, float]] = {}
    reference_argmax = None
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            path = model_dir
            if variant.scheme is not None:  # a checkpoint in the published layout
                path = Path(tmp) / "model"
                shutil.copytree(model_dir, path)
                quantize_checkpoint(path, variant.scheme)
            model, config = load_model(path, torch.float32, torch.device("cpu"),
                                       quantization=variant.quantization)  # fmt: skip
        logits = window_logits(model, config, variant, windows).flatten(0, 1)
        nll = F.cross_entropy(logits, labels, reduction="mean").item()
        argmax = logits.argmax(-1)
        if reference_argmax is None:
            reference_argmax = argmax
        results[variant.name] = {
            "perplexity": math.exp(nll),
            "next_token_agreement_vs_fp32": (argmax == reference_argmax).float().mean().item(),
            "top1_accuracy": (argmax == labels).float().mean().item(),
        }
        del model
    fp32_ppl = results["fp32"]["perplexity"]
    for r in results.values():
        r["perplexity_vs_fp32"] = r["perplexity"] / fp32_ppl
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="test", help="trained pair / recipe: test or bench")
    ap.add_argument("--model", type=Path, help="model directory (default: the pair's target)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.model is None:
        from cluster.tools.train import trained_pair

        args.model, _ = trained_pair(args.kind)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    windows = held_out_windows(args.kind, tokenizer)
    results = evaluate(args.model, windows)
    print(f"{args.model}: {windows.shape[0]} windows x {windows.shape[1] - 1} tokens held out")
    print("variant        perplexity  x fp32  agreement vs fp32  top-1 accuracy")
    for name, r in results.items():
        print(f"{name:13}  {r['perplexity']:10.3f}  {r['perplexity_vs_fp32']:6.3f}  "
              f"{r['next_token_agreement_vs_fp32']:17.4f}  {r['top1_accuracy']:14.4f}")  # fmt: skip
    if args.json:
        write_quality_json(args.json, args.model, args.kind, windows, results)


def write_quality_json(
    path: Path, model: Path, kind: str, windows: torch.Tensor, results: dict
) -> None:
    """A held-out quality run as JSON (this bench's and bench/kv_fp8_quality's): the
    machine, the windows, the trained pair's own report and the results."""
    report = model.parent / "report.json"  # the trained pair's, beside target/
    result = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": str(model),
        "kind": kind,
        "num_windows": windows.shape[0],
        "window_len": windows.shape[1] - 1,
        "trainer_report": json.loads(report.read_text()) if report.is_file() else None,
        "results": results,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
