"""Mixture-of-Experts: top-k routing and the grouped expert computation (PyTorch reference).

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

Grouped, not per token: the (token, slot) pairs are sorted by expert once, and each *active*
expert runs one matmul over all of its tokens (the loop is over the experts that received
tokens, never over every expert for every token). Products are accumulated in float32 and
added in a fixed order (by expert, then token), so a token's result does not depend on how
many tokens share the batch beyond the matmuls' own row-blocking.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul


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
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    if w13.shape[2] != hidden_size or w2.shape != (num_local, hidden_size, two_i // 2):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden "
            f"size {hidden_size} (want [E, 2I, H] and [E, H, I])"
        )
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    order, counts = sort_by_expert(topk_ids, first_expert, num_local)
    flat_weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        token_ids = pairs // top_k
        x = hidden[token_ids]  # [count, H]
        y = silu_and_mul(x @ w13[expert].t()) @ w2[expert].t()  # [count, H]
        out.index_add_(0, token_ids, y.float() * flat_weights[pairs, None])
    return out.to(hidden.dtype)
