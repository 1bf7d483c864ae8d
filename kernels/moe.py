"""Mixture-of-Experts: top-k routing (softmax top-k; DeepSeek's group-limited top-k) and the
grouped expert computation (PyTorch reference).

Layouts (``E`` experts held here, ``H`` hidden, ``I`` each expert's intermediate size):

- ``router_logits``: [num_tokens, num_experts], the gate's output (all experts, global ids).
- ``topk_weights``: [num_tokens, top_k] float32, ``topk_ids``: [num_tokens, top_k] int64
  (global expert ids), from ``select_experts``.
- ``w13``: [E, 2 * I, H], each expert's gate projection stacked over its up projection (the
  dense MLP's ``gate_up_proj`` layout, so ``silu_and_mul`` applies); ``w2``: [E, H, I], its
  down projection. Expert ``first_expert + e`` is row ``e``.

``fused_moe`` returns [num_tokens, H] in ``hidden``'s dtype: for each token, the sum over its
top-k experts *held here* of ``weight * w2 @ silu_and_mul(w13 @ x)``; experts held elsewhere
(expert parallelism) contribute nothing, so the sum over ranks is the whole layer.

Grouped, not per token: the (token, slot) pairs are sorted by expert once (their tokens'
rows gathered once), and each *active* expert runs one matmul pair over all of its tokens
(the loop is over the experts that received tokens, never over every expert for every
token). Each pair's weighted product is kept in float32, put back in (token, slot) order
with one scatter, and a token's k slots are summed in slot order (what the Triton kernel
does), so a token's result does not depend on how many tokens share the batch beyond the
matmuls' own row-blocking. (One scatter per layer, not an ``index_add_`` per expert: on a
loaded 2-core machine each parallel region of those cost about a millisecond.)
``grouped_moe`` is that loop over any expert weights (a callable per expert): quantized
experts run through it (``kernels/moe_quant.py``).

On CPU, decode steps of a single-rank MoE model run this computation in C++ instead
(``kernels/csrc/moe_block.h``, in the decoder-layer stack of
``workers/models/fused_decode.py``), op for op: the same ATen calls on the same row groups,
so the two give the same bits. A change to ``select_experts``, ``fused_moe`` or
``grouped_moe``'s arithmetic must be made there too; tests/workers/test_fused_decode_moe.py
fails on any difference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import cpu_linear
from kernels.activation import silu_and_mul
from kernels.timing import fastest


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, as Mixtral and Qwen-MoE compute it: softmax over all experts in
    float32, the ``top_k`` largest (ties to the lower id, as ``torch.topk``), renormalised
    to sum to 1 when ``renormalize`` (Mixtral always; Qwen's ``norm_topk_prob``).

    Returns ``(topk_weights float32 [T, k], topk_ids int64 [T, k])``; mutates nothing.
    """
    if top_k < 1 or top_k > router_logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in 1..{router_logits.shape[-1]} (the experts)")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    scoring: str = "sigmoid",
    group_score: str = "top2_sum",
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing, as DeepSeek-V2/V3 compute it (Hugging Face's
    ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter``), in float32:

    1. ``scores``: ``sigmoid`` (V3) or ``softmax`` (V2) of the logits, per expert;
    2. the *choice* scores add ``correction_bias`` [num_experts] (V3's
       ``e_score_correction_bias``, which balances the load: it picks experts, it never
       weighs them);
    3. the experts are cut into ``num_groups`` equal groups, each scored by the sum of its
       two best choice scores (``"top2_sum"``, V3) or its best (``"max"``, V2's
       ``group_limited_greedy``); only the ``topk_groups`` best groups stay eligible;
    4. the ``top_k`` best eligible experts by choice score; their weights are the
       *unbiased* ``scores``, renormalised to sum to 1 when ``renormalize``
       (``norm_topk_prob``), then multiplied by ``scaling`` (``routed_scaling_factor``).

    ``num_groups == topk_groups`` (or 1) is plain top-k. Returns ``(topk_weights float32
    [T, k], topk_ids int64 [T, k])``, the slots in descending choice score; mutates nothing.
    """
    num_experts = router_logits.shape[-1]
    if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"{num_experts} experts in {num_groups} groups, {topk_groups} of them kept: "
            "the groups must be equal and at least one kept"
        )
    if not 1 <= top_k <= num_experts // num_groups * topk_groups:
        raise ValueError(f"top_k={top_k} must be in 1..{num_experts // num_groups * topk_groups}")
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring must be sigmoid or softmax, got {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_groups < num_groups:
        grouped = choice.view(-1, num_groups, num_experts // num_groups)
        if group_score == "top2_sum":
            per_group = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        elif group_score == "max":
            per_group = grouped.amax(dim=-1)
        else:
            raise ValueError(f"group_score must be top2_sum or max, got {group_score!r}")
        kept = torch.topk(per_group, topk_groups, dim=-1).indices  # [T, topk_groups]
        eligible = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(
            ~eligible.repeat_interleave(grouped.shape[-1], dim=1), float("-inf")
        )
    topk_ids = torch.topk(choice, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling, topk_ids


def sort_by_expert(
    topk_ids: torch.Tensor, first_expert: int, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs routed to experts held here, grouped by expert.

    Returns ``(order, counts)``: ``order`` [P] int64 indexes the flattened ``topk_ids`` (pair
    ``p`` is token ``p // top_k``), sorted by local expert, stable (tokens ascending within
    an expert); ``counts`` [num_local_experts] int64, the pairs per local expert.
    """
    local = topk_ids.flatten() - first_expert
    held = (local >= 0) & (local < num_local_experts)
    pair_ids = torch.nonzero(held).flatten()
    local = local[pair_ids]
    order = pair_ids[torch.argsort(local, stable=True)]
    counts = torch.bincount(local, minlength=num_local_experts)
    return order, counts


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """The experts' weighted sum for each token (module docstring); mutates nothing."""
    hidden_size = hidden.shape[1]
    num_local, two_i, _ = w13.shape
    if w13.shape[2] != hidden_size or w2.shape != (num_local, hidden_size, two_i // 2):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden "
            f"size {hidden_size} (want [E, 2I, H] and [E, H, I])"
        )

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x @ w13[expert].t()) @ w2[expert].t()

    return grouped_moe(hidden, topk_weights, topk_ids, num_local, expert_mlp, first_expert)


def grouped_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_local: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
    first_expert: int = 0,
) -> torch.Tensor:
    """``fused_moe`` over any expert weights: ``expert_mlp(e, x)`` is local expert ``e``'s
    ``w2 @ silu_and_mul(w13 @ x)`` for its rows ``x`` [count, H] (dense weights, or the
    quantized ones of ``kernels/moe_quant.py``), called once per *active* expert."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, first_expert, num_local)
    rows = hidden[order // top_k]  # [P, H] each held pair's token, grouped by expert
    out_rows = torch.empty(len(order), hidden_size, dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        x = rows[start : start + count]  # [count, H], contiguous
        out_rows[start : start + count] = expert_mlp(expert, x)  # [count, H]
        start += count
    out_rows *= topk_weights.flatten()[order, None]
    # Back to (token, slot) order, pairs held elsewhere 0, each token's slots summed in slot
    # order (as the Triton kernel sums): one scatter for the layer, not one per expert.
    pairs = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    pairs[order] = out_rows
    return pairs.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


# Fewer rows than this go through the dense stacks' mm, more through oneDNN: measured on
# the 2-vCPU AMD VM on Qwen3-MoE-shaped experts (768 -> 512, 256 -> 768; bench/RESULTS.md),
# oneDNN's one-row path was 2-4x slower than MKL's, from two rows on it was 2-3x faster.
PACKED_MIN_ROWS = 2


class PackedExperts:
    """One layer's experts with each expert's ``w13[e]`` / ``w2[e]`` also packed for oneDNN
    (``kernels/cpu_linear.py``): on CPUs where packing wins (the loader's measurement, as
    for the dense linears) MKL's sgemm is slowest at the few rows an expert gets in a
    batched decode step, but oneDNN's one-row path is slower still, so an expert's rows
    go through oneDNN from ``PACKED_MIN_ROWS`` on and through the dense stacks' mm below
    (the expert weights are held twice). Up to ``matvec_max_rows`` rows (0: none; set by
    ``choose_matvec_rows``) they go through ``matvec`` instead, the C++ kernels'
    ``expert_matvec`` (``kernels/csrc/matvec.h``) over the dense float32 stacks, which
    reads a weight near the memory bandwidth where one-row sgemm does not.
    ``mlp`` is ``grouped_moe``'s per-expert callable; row ``e`` is slot ``e``."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.dense_w13, self.dense_w2 = w13, w2  # [E, 2I, H], [E, H, I]
        self.w13 = [cpu_linear.pack(w) for w in w13]  # [2I, H] each, packed
        self.w2 = [cpu_linear.pack(w) for w in w2]  # [H, I] each, packed
        self.matvec: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.matvec_max_rows = 0

    @property
    def num_rows(self) -> int:
        return len(self.w13)

    def use_matvec(
        self, matvec: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], max_rows: int
    ) -> None:
        """Send an expert's rows up to ``max_rows`` (0: none) through ``matvec(x, w)`` =
        ``x @ w.t()`` over the dense float32 weights."""
        if max_rows and self.dense_w13.dtype != torch.float32:
            raise ValueError(f"the expert matvec is float32 only, not {self.dense_w13.dtype}")
        self.matvec, self.matvec_max_rows = matvec, max_rows

    def mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s ``w2 @ silu_and_mul(w13 @ x)`` for its rows ``x`` [count, H]."""
        if x.shape[0] <= self.matvec_max_rows:  # as kernels/csrc/moe_block.h multiplies
            assert self.matvec is not None
            gate_up = self.matvec(x, self.dense_w13[expert])
            return self.matvec(silu_and_mul(gate_up), self.dense_w2[expert])
        if x.shape[0] < PACKED_MIN_ROWS:  # as fused_moe multiplies
            return silu_and_mul(x @ self.dense_w13[expert].t()) @ self.dense_w2[expert].t()
        gate_up = cpu_linear.linear(x, self.w13[expert])
        return cpu_linear.linear(silu_and_mul(gate_up), self.w2[expert])


def choose_matvec_rows(
    layers: list[PackedExperts],
    matvec: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    most_rows: int,
    repeats: int = 5,
) -> tuple[int, list[tuple[float, float]]]:
    """Up to how many rows ``matvec`` beats the multiply ``PackedExperts.mlp`` would use
    otherwise, timed here on the model's own experts (a pass over up to three layers'
    weights, more than a cache holds, as a decode step reads them): the largest ``r`` in
    1..``most_rows`` such that it wins at every row count up to ``r`` (0: never).

    Returns it with the ``(other, matvec)`` seconds of a pass at each row count timed."""
    sample = layers[:3]
    gen = torch.Generator().manual_seed(0)
    hidden = sample[0].dense_w13.shape[2]
    timings: list[tuple[float, float]] = []
    best = 0
    with torch.inference_mode():
        for rows in range(1, most_rows + 1):
            x = torch.randn(rows, hidden, generator=gen)

            def other(x: torch.Tensor = x) -> None:
                for layer in sample:
                    for e in range(layer.num_rows):
                        PackedExperts.mlp(layer, e, x)

            def ours(x: torch.Tensor = x) -> None:
                for layer in sample:
                    for e in range(layer.num_rows):
                        gate_up = matvec(x, layer.dense_w13[e])
                        matvec(silu_and_mul(gate_up), layer.dense_w2[e])

            saved = [(layer.matvec, layer.matvec_max_rows) for layer in sample]
            for layer in sample:
                layer.matvec_max_rows = 0  # time the multiply it would replace
            try:
                t_other, t_ours = fastest([other, ours], repeats)
            finally:
                for layer, (fn, most) in zip(sample, saved, strict=True):
                    layer.matvec, layer.matvec_max_rows = fn, most
            timings.append((t_other, t_ours))
            if t_ours >= t_other:
                break
            best = rows
    return best, timings
