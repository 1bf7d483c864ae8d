"""Group-limited top-k routing (kernels.moe.select_experts_grouped) against transformers'
DeepSeek-V3 and V2 routers, and against its definition written out per token."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kernels.moe import select_experts_grouped

HIDDEN = 16


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots in expert-id order (the routers' slot order differs; the sum does not)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize(
    ("num_experts", "n_group", "topk_group", "top_k", "renormalize"),
    [(8, 4, 2, 3, True), (16, 4, 1, 4, False), (12, 1, 1, 2, True), (8, 4, 4, 8, True)],
)
def test_v3_matches_transformers(num_experts, n_group, topk_group, top_k, renormalize):
    config = DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=num_experts, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(num_experts + top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, HIDDEN, generator=gen))
        # Large enough to move choices away from the best unbiased scores.
        router.e_score_correction_bias.copy_(0.5 * torch.randn(num_experts, generator=gen))
        x = torch.randn(37, HIDDEN, generator=gen)
        logits, want_weights, want_ids = router(x)
    weights, ids = select_experts_grouped(
        logits, top_k, num_groups=n_group, topk_groups=topk_group,
        correction_bias=router.e_score_correction_bias, renormalize=renormalize, scaling=2.5,
    )  # fmt: skip
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    want_weights, want_ids = _sorted(want_weights, want_ids)
    weights, ids = _sorted(weights, ids)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_matches_transformers(topk_method):
    config = DeepseekV2Config(
        hidden_size=HIDDEN, num_attention_heads=4, n_routed_experts=12, n_group=4, topk_group=2,
        num_experts_per_tok=3, topk_method=topk_method, routed_scaling_factor=1.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, HIDDEN, generator=gen))
        logits, want_weights, want_ids = router(torch.randn(29, HIDDEN, generator=gen))
    groups = (4, 2) if topk_method == "group_limited_greedy" else (1, 1)
    weights, ids = select_experts_grouped(
        logits, 3, num_groups=groups[0], topk_groups=groups[1], scoring="softmax",
        group_score="max", renormalize=False, scaling=1.5,
    )  # fmt: skip
    want_weights, want_ids = _sorted(want_weights, want_ids)
    weights, ids = _sorted(weights, ids)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)


def test_groups_limit_the_choice_and_bias_only_chooses():
    """Per token, written out: the best 2 groups by the sum of their top two biased
    scores, the best 2 experts inside them; weights are the unbiased sigmoid scores."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(50, 8, generator=gen)
    bias = torch.randn(8, generator=gen)
    weights, ids = select_experts_grouped(
        logits, 2, num_groups=4, topk_groups=2, correction_bias=bias, renormalize=False
    )
    scores = logits.sigmoid()
    for t in range(50):
        choice = scores[t] + bias
        group_scores = choice.view(4, 2).sum(dim=-1)  # two experts per group: both are top 2
        groups = group_scores.topk(2).indices.tolist()
        eligible = [e for e in range(8) if e // 2 in groups]
        best = sorted(eligible, key=lambda e: -choice[e])[:2]
        assert ids[t].tolist() == best
        torch.testing.assert_close(weights[t], scores[t, best])


def test_bad_groups_are_refused():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="equal"):
        select_experts_grouped(logits, 2, num_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match=r"top_k=3 must be in 1\.\.2"):
        select_experts_grouped(logits, 3, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="scoring"):
        select_experts_grouped(logits, 2, scoring="relu")
