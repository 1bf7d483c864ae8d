"""Batch-invariant linear layers and attention, for deterministic serving on CPU.

With ``model.deterministic: true`` a sequence's logits must come out bitwise the same
whatever computed them: the rows beside it in a batch, how its prompt was cut into chunks,
whether its prefix came from the cache, a KV tier or a prefill worker, whether a token was
decoded alone or verified inside a speculative chunk. Each op below gives a row a result
that depends on that row (and its own context) alone.

What was measured on the development VM (AMD EPYC Zen 5, AVX-512; probes in
tests/kernels/test_batch_invariant.py, figures in bench/RESULTS.md):

- **Linear layers.** oneDNN's inner product over a packed weight (``kernels/cpu_linear.py``)
  and the int4 CPU kernel (``kernels/int4_linear.py``) give each row the same bits for any
  number of rows from 2 to 2048, at any offset, at 1, 2 or 4 threads; a *single* row takes
  another path for some shapes (oneDNN at K=1536: a matrix-vector product) and differs.
  MKL's sgemm (float32 ``F.linear``) differs for 1 to 9 rows. So in this mode every linear
  multiplies through oneDNN (or the int4 kernel) and never fewer than ``MIN_ROWS`` rows
  (``RowPadded`` copies a lone row), and ``invariance_failures`` checks each weight at load:
  a library that blocks by the number of rows is refused, not trusted.
- **Attention.** The C++ decode kernel (``kernels/csrc/paged_decode.h``) computes each query
  from its own context alone, in fixed chunks of 256 positions merged in order, whatever
  the batch or thread count. ``per_token_attention`` sends *every* query token through it,
  a prefill's too, with its own context length: one reduction order along the keys however
  the sequence was chunked. The K/V it reads are the cache's (stored first), so a prompt's
  own keys are read exactly as a later decode reads them, FP8 or not.
- RMSNorm, SiLU-and-multiply (C++), rotary and the embedding are row-local already, and so
  is the sampler (``workers/engine/sampler.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.attention_metadata import AttentionMetadata

# The fewest rows a linear layer multiplies in this mode: one row alone may take a
# matrix-vector path that sums in another order (measured above).
MIN_ROWS = 2

LinearFn = Callable[..., torch.Tensor]  # F.linear's signature: (x, weight, bias=None)

# The row counts and offsets ``invariance_failures`` compares: a lone row, the small
# batches of decode steps, odd sizes and a prefill chunk's.
_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 100)
_PROBE_OFFSETS = (0, 3)
_PROBE_TOTAL = 128


class RowPadded:
    """A linear layer's ``matmul`` that never multiplies fewer than ``MIN_ROWS`` rows: a
    single row is multiplied beside a copy of itself and the copy dropped. ``inner`` is the
    wrapped matmul (the C++ decode stack multiplies through it, padding the whole step)."""

    def __init__(self, inner: LinearFn) -> None:
        self.inner = inner

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if num_rows >= MIN_ROWS or num_rows == 0:
            return self.inner(x, weight, bias)
        padded = rows[:1].expand(MIN_ROWS, rows.shape[1])
        out = self.inner(padded.contiguous(), weight, bias)[:num_rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def __repr__(self) -> str:
        return f"RowPadded({self.inner!r})"


def invariance_failures(
    matmul: LinearFn,
    weight: torch.Tensor,
    in_features: int,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """Multiply a random batch by ``weight`` whole, then sub-batches of it (the counts and
    offsets of ``_PROBE_ROWS``/``_PROBE_OFFSETS``); returns the (rows, offset) pairs whose
    rows did not come out bitwise as in the whole batch (empty: invariant here)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_TOTAL, in_features, generator=gen).to(dtype).to(weight.device)
    with torch.inference_mode():
        whole = matmul(x, weight, bias)
        failures = []
        for num_rows in _PROBE_ROWS:
            for offset in _PROBE_OFFSETS:
                part = matmul(x[offset : offset + num_rows].contiguous(), weight, bias)
                if not torch.equal(part, whole[offset : offset + num_rows]):
                    failures.append((num_rows, offset))
    return failures


DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]  # (query, kv_cache_layer, block_tables, seq_lens, scale) -> out; a row-local kernel


def per_token_tables(
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a decode of its own: (block_tables [num_tokens, max_blocks],
    seq_lens [num_tokens] int32), the token ``i`` of a sequence with ``q`` query tokens and
    context ``L`` seeing ``L - q + 1 + i`` positions."""
    query_lens = torch.tensor(metadata.query_lens_cpu, dtype=torch.int64)
    device = metadata.block_tables.device
    seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens  # each sequence's first token
    within = torch.arange(int(query_lens.sum())) - starts[seq_idx]
    seq_lens = torch.tensor(metadata.seq_lens_cpu, dtype=torch.int64)
    token_lens = seq_lens[seq_idx] - query_lens[seq_idx] + 1 + within
    tables = metadata.block_tables.index_select(0, seq_idx.to(device))
    return tables, token_lens.to(device=device, dtype=torch.int32)


def per_token_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    decode_fn: DecodeFn,
) -> torch.Tensor:
    """``paged_attention`` (``kernels/paged_attention.py``: same layouts and contract) with
    every query token computed by ``decode_fn`` over its own context: the decodes as they
    are, each extend token as a decode of the positions up to its own."""
    if metadata.num_decodes == metadata.num_seqs:
        return decode_fn(query, kv_cache_layer, metadata.block_tables, metadata.seq_lens, scale)
    tables, seq_lens = per_token_tables(metadata)
    return decode_fn(query, kv_cache_layer, tables, seq_lens, scale)


def distinct_linears(
    layers: Sequence[tuple[str, LinearFn, torch.Tensor, int, torch.Tensor | None]],
) -> list[tuple[str, LinearFn, torch.Tensor, int, torch.Tensor | None]]:
    """One (name, matmul, weight, in_features, bias) per distinct kind of multiply: the
    matmul's type and the weight's shape and dtype (what a library's blocking can depend
    on), so a 30-layer model is probed on its five shapes, not 150 weights."""
    seen: set[tuple] = set()
    kept = []
    for entry in layers:
        _, matmul, weight, _, bias = entry
        inner = matmul.inner if isinstance(matmul, RowPadded) else matmul
        key = (
            type(inner).__name__,
            getattr(inner, "__name__", ""),
            tuple(weight.shape),
            weight.dtype,
            bias is None,
        )
        if key not in seen:
            seen.add(key)
            kept.append(entry)
    return kept
