"""The second pass of flash-decoding (Triton): a sequence's context splits combined.

``kernels/triton_paged_decode.py`` cuts long contexts into splits computed in parallel;
each split writes its unnormalised output row and its log-sum-exp (base 2) to float32
scratch. These kernels merge them, one program per (sequence, query head):

    partial_out: [num_seqs, num_heads, num_splits, head_dim_pad] float32
    partial_lse: [num_seqs, num_heads, num_splits] float32 (-inf: an empty split)
    out:         [num_seqs, num_heads, head_dim] in the query's dtype

``decode_reduce_kernel`` weighs all the launch's splits at once (a split past a
sequence's end weighs exp2(-inf) = 0); ``decode_reduce_ordered_kernel``, for
``model.deterministic``, walks only the sequence's own splits one after another, so the
sum does not depend on the batch's longest context.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    lse = tl.load(
        partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    # Split 0 always holds position 0, so the maximum is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    po_ptrs = (
        partial_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + splits[:, None] * stride_po_split
        + dims[None, :]
    )
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(po_ptrs, mask=mask, other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = tl.sum(partial * weights[:, None], 0)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def decode_reduce_ordered_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    tokens_per_split,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """``decode_reduce_kernel`` for batch-invariant runs: it combines only this sequence's
    own splits (``ceil(seq_len / tokens_per_split)``), one after another in order, so the
    result depends on the sequence alone, not on the batch's longest."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_PAD)
    num_splits = tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + seq), tokens_per_split), 1)
    pl_ptr = partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head
    peak = tl.load(pl_ptr)
    for split in range(1, num_splits):
        peak = tl.maximum(peak, tl.load(pl_ptr + split))
    total = tl.zeros([1], tl.float32)
    out = tl.zeros([HEAD_DIM_PAD], tl.float32)
    po_ptr = partial_out_ptr + seq * stride_po_seq + head * stride_po_head + dims
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(pl_ptr + split) - peak)
        total += weight
        out += weight * tl.load(po_ptr + split * stride_po_split, mask=dims < HEAD_DIM, other=0.0)
    out = out / total
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
