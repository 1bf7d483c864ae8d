"""The C++ decode-attention kernel alone (kernels/csrc/paged_decode.h), one decode step of
SmolLM2-135M's shapes: 9 query heads over 3 KV heads of 64, blocks of 16, a 30-layer cache
(each block a whole all-layer block apart, as the engine lays it out), blocks in random
order; all 30 layers, best of 5. Prints ms per step for each (decodes, context).

    python -m bench.decode_kernel [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu_paged_decode

SHAPES = ((1, 64), (1, 2048), (8, 512), (32, 512), (32, 2048))


def step_ms(decode, num_decodes: int, context: int, layers: int = 30) -> float:
    block_size = 16
    blocks = -(-context // block_size)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_decodes * blocks, layers, 2, 3, block_size, 64, generator=gen)
    tables = torch.randperm(num_decodes * blocks, generator=gen, dtype=torch.int32)
    tables = tables.view(num_decodes, blocks)
    lens = torch.full((num_decodes,), context, dtype=torch.int32)
    query = torch.randn(num_decodes, 9, 64, generator=gen)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for layer in range(layers):
            decode(query, cache[:, layer], tables, lens, 0.125)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decode = cpu_paged_decode.load()
    if decode is None:
        raise SystemExit("the C++ CPU kernels are unavailable here (see the log)")
    with torch.inference_mode():
        for num_decodes, context in SHAPES:
            ms = step_ms(decode, num_decodes, context)
            print(f"{num_decodes:3d} decodes x {context:5d} tokens: {ms:7.2f} ms / 30 layers")


if __name__ == "__main__":
    main()
