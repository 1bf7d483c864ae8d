"""Triton kernels against the hardware and against PyTorch (needs a CUDA GPU).

For each kernel: time (``triton.testing.do_bench``, L2 flushed between runs), achieved
bytes/s and FLOP/s, as a share of two ceilings measured in the same run — the device-copy
bandwidth (``dst.copy_(src)`` over 2 GiB, bytes read + written) and the dense bf16 matmul
rate (8192^3) — and the same op through PyTorch as a peer:

- decode attention: the reference op (``kernels/paged_attention.py``: gather whole blocks +
  ``bmm``), and ``scaled_dot_product_attention`` on KV already gathered into contiguous
  [batch, Hkv, ctx, D] tensors (the gather not timed: a lower bound for any PyTorch path);
- prefill attention: SDPA (causal, GQA) on contiguous K/V, i.e. PyTorch's flash kernel;
- KV store, RMSNorm (+ residual), RoPE, SiLU-and-mul: the plain-PyTorch references;
- fused MoE (Mixtral-8x7B-like layer: 8 experts, top-2): the reference (``kernels/moe.py``:
  one pair of matmuls per active expert).

Bytes count each tensor read or written once (the minimum traffic); FLOPs count the
matmuls only (4 * q_len * kv_len * head_dim per head; causal pairs for prefill).

    python -m bench.gpu_kernels [--dtype bfloat16] [--json out.json]
    python -m bench.gpu_kernels --compile-only [--arch 90]   # no GPU: bench/kernels_compile.py

Targets on an H200 (issue 3): decode at batch 64 x 4k >= 70% of copy bandwidth and >= 1.5x
the PyTorch path; RMSNorm and SiLU-and-mul >= 80% of copy bandwidth; prefill at 4k tokens
>= 50% of the matmul rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention shape
HIDDEN, INTERMEDIATE = 4096, 14336
NUM_EXPERTS, TOP_K = 8, 2  # Mixtral-8x7B's MoE layer (its H and I are Llama's above)


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float
    bytes_moved: float
    flops: float
    peer: str
    peer_us: float | None
    peer2: str = ""
    peer2_us: float | None = None


def bench_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def check_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Never time a wrong kernel: compare once against the PyTorch peer first."""
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (each byte read and written)."""
    num_bytes = 2 << 30
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * num_bytes / (us * 1e-6)


def matmul_rate(device: torch.device) -> float:
    """Dense bf16 matmul FLOP/s at 8192^3."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    us = bench_us(lambda: a @ b)
    return 2 * n**3 / (us * 1e-6)


def paged_batch(
    query_lens, seq_lens, block_size, dtype, device, num_decodes,
    num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
):  # fmt: skip
    """A random paged batch: scattered blocks, a zero-filled-then-random cache (Llama-3-8B's
    attention shape unless told otherwise; bench/decode_groups.py uses another)."""
    from kernels.attention_metadata import build_attention_metadata, slot_mapping_for

    gen = torch.Generator().manual_seed(0)
    num_blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(num_blocks_needed) + 16
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in num_blocks_needed:
        table, perm = perm[:n], perm[n:]
        tables.append(table)
    # Two layers, so the layer view is strided as in the engine.
    cache = torch.randn(
        num_blocks, 2, 2, num_kv_heads, block_size, head_dim, dtype=dtype, device=device
    )
    slots = slot_mapping_for(query_lens, seq_lens, tables, block_size)
    metadata = build_attention_metadata(query_lens, seq_lens, tables, slots, num_decodes, device)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    return query, cache[:, 1], metadata


def gathered_kv(layer, metadata, seq_len):
    """Contiguous [batch, Hkv, seq_len, D] K and V of equal-length sequences."""
    num_blocks = math.ceil(seq_len / layer.shape[3])
    ids = metadata.block_tables[:, :num_blocks].long()  # [B, nb]
    kv = layer[ids]  # [B, nb, 2, Hkv, bs, D]
    kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, ids.shape[0], NUM_KV_HEADS, -1, HEAD_DIM)
    return kv[0, :, :, :seq_len].contiguous(), kv[1, :, :, :seq_len].contiguous()


def decode_row(batch: int, ctx: int, dtype, device, block_size: int) -> Row:
    from kernels.paged_attention import paged_attention as reference
    from kernels.triton_attention import paged_attention

    query, layer, md = paged_batch([1] * batch, [ctx] * batch, block_size, dtype, device, batch)
    scale = HEAD_DIM**-0.5
    k, v = gathered_kv(layer, md, ctx)
    q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
    check_close(paged_attention(query, layer, md, scale), reference(query, layer, md, scale))
    item = query.element_size()
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * item
    return Row(
        "decode attention",
        f"B={batch} ctx={ctx} bs={block_size}",
        bench_us(lambda: paged_attention(query, layer, md, scale)),
        kv_bytes + 2 * query.numel() * item,
        4 * batch * NUM_HEADS * ctx * HEAD_DIM,
        "torch reference (gather+bmm)",
        bench_us(lambda: reference(query, layer, md, scale)),
        "SDPA on gathered KV",
        bench_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)),
    )


def prefill_row(num_tokens: int, dtype, device, block_size: int) -> Row:
    from kernels.triton_attention import paged_attention

    query, layer, md = paged_batch([num_tokens], [num_tokens], block_size, dtype, device, 0)
    scale = HEAD_DIM**-0.5
    k, v = gathered_kv(layer, md, num_tokens)
    q = query.transpose(0, 1)[None]  # [1, Hq, T, D]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    check_close(paged_attention(query, layer, md, scale), expected[0].transpose(0, 1))
    pairs = num_tokens * (num_tokens + 1) / 2
    return Row(
        "prefill attention",
        f"T={num_tokens} causal bs={block_size}",
        bench_us(lambda: paged_attention(query, layer, md, scale)),
        (2 * query.numel() + 2 * k.numel()) * query.element_size(),
        4 * NUM_HEADS * pairs * HEAD_DIM,
        "SDPA causal (contiguous KV)",
        bench_us(
            lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        ),
    )


def elementwise_rows(dtype, device, block_size, num_tokens: int = 4096) -> list[Row]:
    from kernels import REFERENCE_OPS as ref
    from kernels import triton_activation as t_act
    from kernels import triton_kv_store as t_kv
    from kernels import triton_rms_norm as t_norm
    from kernels import triton_rotary as t_rot
    from kernels.rotary import compute_cos_sin_cache

    item = torch.empty((), dtype=dtype).element_size()
    rows = []

    x = torch.randn(num_tokens, HIDDEN, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, dtype=dtype, device=device)
    rows.append(
        Row(
            "rms_norm",
            f"T={num_tokens} H={HIDDEN}",
            bench_us(lambda: t_norm.rms_norm(x, weight, 1e-6)),
            2 * x.numel() * item,
            0,
            "torch reference",
            bench_us(lambda: ref.rms_norm(x, weight, 1e-6)),
        )
    )
    rows.append(
        Row(
            "fused_add_rms_norm",
            f"T={num_tokens} H={HIDDEN}",
            bench_us(lambda: t_norm.fused_add_rms_norm(x, residual, weight, 1e-6)),
            4 * x.numel() * item,
            0,
            "torch reference",
            bench_us(lambda: ref.fused_add_rms_norm(x, residual, weight, 1e-6)),
        )
    )

    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, device=device)
    rows.append(
        Row(
            "silu_and_mul",
            f"T={num_tokens} I={INTERMEDIATE}",
            bench_us(lambda: t_act.silu_and_mul(gate_up)),
            1.5 * gate_up.numel() * item,
            0,
            "torch reference",
            bench_us(lambda: ref.silu_and_mul(gate_up)),
        )
    )

    qkv = torch.randn(
        num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype, device=device
    )
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    cos_sin = compute_cos_sin_cache(HEAD_DIM, 8192, 500000.0, None, dtype).to(device)
    rows.append(
        Row(
            "rotary (in place)",
            f"T={num_tokens} Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}",
            bench_us(lambda: t_rot.apply_rotary(q, k, positions, cos_sin)),
            2 * (q.numel() + k.numel()) * item,
            0,
            "torch reference",
            bench_us(lambda: ref.apply_rotary(q, k, positions, cos_sin)),
        )
    )

    _, layer, md = paged_batch([num_tokens], [num_tokens], block_size, dtype, device, 0)
    rows.append(
        Row(
            "store_kv",
            f"T={num_tokens} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bs={block_size}",
            bench_us(lambda: t_kv.store_kv(k, v, layer, md.slot_mapping)),
            2 * 2 * k.numel() * item,
            0,
            "torch reference",
            bench_us(lambda: ref.store_kv(k, v, layer, md.slot_mapping)),
        )
    )
    return rows


def moe_rows(dtype, device) -> list[Row]:
    """The fused MoE layer at a decode-sized and a prefill-sized batch. Bytes: the active
    experts' weights once, the activations in and out; FLOPs: both matmuls of every pair."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    w13 = torch.randn(shape, dtype=dtype, device=device, generator=gen) * HIDDEN**-0.5
    shape = (NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    w2 = torch.randn(shape, dtype=dtype, device=device, generator=gen) * INTERMEDIATE**-0.5
    return [moe_row(t, w13, w2, gen) for t in (64, 4096)]


def moe_row(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, gen) -> Row:
    from kernels.moe import fused_moe as reference
    from kernels.moe import select_experts
    from kernels.triton_moe import fused_moe

    x = torch.randn(num_tokens, HIDDEN, dtype=w13.dtype, device=w13.device, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, device=w13.device, generator=gen)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    check_close(fused_moe(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids))
    num_active = ids.unique().numel()
    item = x.element_size()
    return Row(
        "fused_moe",
        f"T={num_tokens} E={NUM_EXPERTS} top{TOP_K} H={HIDDEN} I={INTERMEDIATE}",
        bench_us(lambda: fused_moe(x, w13, w2, weights, ids)),
        num_active * (w13[0].numel() + w2[0].numel()) * item + 2 * x.numel() * item,
        6 * num_tokens * TOP_K * HIDDEN * INTERMEDIATE,
        "torch reference (per expert)",
        bench_us(lambda: reference(x, w13, w2, weights, ids)),
    )


def _compile_only(arch: int) -> None:
    from bench.kernels_compile import compile_only

    compile_only(arch, HIDDEN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the rows and ceilings here")
    parser.add_argument(
        "--compile-only", action="store_true", help="no GPU: compile and report register use"
    )
    parser.add_argument("--arch", type=int, default=90, help="with --compile-only: sm_ARCH")
    args = parser.parse_args()
    if args.compile_only:
        _compile_only(args.arch)
        return
    if not torch.cuda.is_available():
        sys.exit(
            "bench/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). Without "
            "one: `python -m bench.gpu_kernels --compile-only` reports the kernels' register and "
            "shared-memory use, and `pytest tests/kernels -k triton` checks them against the "
            "references in Triton's interpreter"
        )
    try:
        import triton
    except ImportError:
        sys.exit("bench/gpu_kernels.py needs the `triton` package (pip install triton)")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth(device)
    mm_rate = matmul_rate(device)
    bs = args.block_size
    rows = [
        decode_row(b, ctx, dtype, device, bs) for b, ctx in ((64, 4096), (8, 32768), (256, 1024))
    ]
    rows += [prefill_row(t, dtype, device, bs) for t in (4096, 16384)]
    rows += elementwise_rows(dtype, device, bs)
    rows += moe_rows(dtype, device)
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; {args.dtype}")
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s; bf16 matmul: {mm_rate / 1e12:.0f} TFLOP/s\n")
    header = (
        "| kernel | shape | Triton µs | GB/s | % copy BW | TFLOP/s | % matmul | peer | peer µs "
        "| speed-up | peer 2 | peer 2 µs |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        gbs = r.bytes_moved / (r.triton_us * 1e-6)
        flops = r.flops / (r.triton_us * 1e-6)
        speedup = f"{r.peer_us / r.triton_us:.2f}x" if r.peer_us else "-"
        print(
            f"| {r.kernel} | {r.shape} | {r.triton_us:.1f} | {gbs / 1e9:.0f} | "
            f"{100 * gbs / copy_bw:.0f}% | {flops / 1e12:.1f} | {100 * flops / mm_rate:.0f}% | "
            f"{r.peer} | {r.peer_us:.1f} | {speedup} | {r.peer2 or '-'} | "
            f"{f'{r.peer2_us:.1f}' if r.peer2_us else '-'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "dtype": args.dtype,
                    "copy_bytes_per_s": copy_bw,
                    "matmul_flops_per_s": mm_rate,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
