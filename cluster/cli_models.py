"""``baton make-model`` and ``baton train-model``: the commands that write Hugging Face
model directories for tests, demos and benchmarks (``cluster/tools/``). Registered in
``cli.py``'s command table; heavy imports (torch, the tools) stay inside the run functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Literals, not imports from workers: building the parser must not load torch.
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
# workers/models/quant/export.py SCHEMES (not imported here: the parser loads no torch)
QUANTIZE_SCHEMES = ("fp8", "fp8-channel", "int4-gptq", "int4-gptq-asym", "int4-awq")

# ---- make-model -----------------------------------------------------------------------


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory to write the model to")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="architecture (llama)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny or small (tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (0)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the stored weights (float32 for tiny, bfloat16 for small)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the model files in a non-empty DIR"
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_SCHEMES,
        default=None,
        help="write the decoder's linear weights quantized, in a published layout "
        "(docs/quantization.md)",
    )
    parser.add_argument(
        "--group-size", type=int, default=128, help="int4: input columns per scale (128)"
    )


def run_make_model(args: argparse.Namespace) -> int:
    from cluster.tools.make_model import make_config, make_model, num_parameters

    config = make_config(args.arch, args.size, dtype=args.dtype)
    if args.quantize is not None and args.arch in ("mixtral", "qwen2-moe", "qwen3-moe"):
        raise ValueError(
            f"--quantize: {args.arch} is a MoE model, whose quantized checkpoints Baton does "
            "not read; write it unquantized and serve it with quantization: fp8 or int4 "
            "(quantized on load)"
        )
    out = make_model(
        args.dir,
        args.arch,
        args.size,
        seed=args.seed,
        overwrite=args.overwrite,
        dtype=args.dtype,
        progress=True,
    )
    if args.quantize is not None:
        from workers.models.quant.export import quantize_checkpoint

        quantize_checkpoint(out, args.quantize, args.group_size)
        print(f"quantized: {args.quantize}")
    print(
        f"wrote {args.arch} {args.size} ({num_parameters(config) / 1e6:.1f}M parameters, "
        f"{config['dtype']}, vocab {config['vocab_size']}) to {out}"
    )
    return 0


# ---- train-model ----------------------------------------------------------------------

TRAIN_RECIPES = ("test", "bench")  # cluster.tools.train.RECIPES


def add_train_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        help="empty directory to write DIR/target, DIR/draft, DIR/report.json to "
        "(default: the cache, ~/.cache/baton/trained; reused when already trained)",
    )
    parser.add_argument(
        "--recipe",
        choices=TRAIN_RECIPES,
        default="test",
        help="test: ~1.7M parameters in minutes; bench: a ~20M target (test)",
    )


def run_train_model(args: argparse.Namespace) -> int:
    import json

    from cluster.tools.train import RECIPES, train_pair, trained_pair

    if args.dir is None:
        target, _ = trained_pair(args.recipe)
        pair = target.parent
    else:
        train_pair(RECIPES[args.recipe], args.dir, progress=True)
        pair = args.dir
    report = json.loads((Path(pair) / "report.json").read_text())
    held_out = report["held_out"]
    print(
        f"{pair}: held-out perplexity target {held_out['target_ppl']:.2f}, "
        f"draft {held_out['draft_ppl']:.2f}; draft/target greedy agreement "
        f"{held_out['agreement']:.1%}"
    )
    return 0
