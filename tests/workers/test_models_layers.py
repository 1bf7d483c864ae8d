"""Tensor-parallel layers: each rank's weight_loader takes the right shard, and the ranks'
partial results combine (all-gather / all-reduce, emulated here) to the unsharded result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workers.models.parallel import ParallelContext


def ranks(tp_size: int) -> list[ParallelContext]:
    return [ParallelContext(tp_rank=r, tp_size=tp_size) for r in range(tp_size)]


def test_parallel_context_validates_and_is_noop_at_size_1():
    with pytest.raises(ValueError):
        ParallelContext(tp_rank=2, tp_size=2)
    x = torch.randn(3, 4)
    ctx = ParallelContext()
    assert ctx.all_reduce(x) is x and ctx.all_gather(x) is x


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_and_kv_replication(tp_size):
    head_dim, num_heads, num_kv_heads, hidden = 4, 8, 2, 16
    full = {
        "q": torch.randn(num_heads * head_dim, hidden),
        "k": torch.randn(num_kv_heads * head_dim, hidden),
        "v": torch.randn(num_kv_heads * head_dim, hidden),
    }
    x = torch.randn(5, hidden)
    q_parts, k_parts = [], []
    for ctx in ranks(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, False, ctx)
        for shard_id, w in full.items():
            layer.weight.weight_loader(layer.weight, w, shard_id)
        kv_size = layer.num_kv_heads * head_dim
        q, k, v = layer(x).split([layer.num_heads * head_dim, kv_size, kv_size], dim=-1)
        q_parts.append(q)
        k_parts.append(k)
        # KV head of this rank: rank // (tp / kv_heads) when replicated.
        kv_head = ctx.tp_rank // max(1, tp_size // num_kv_heads)
        if tp_size >= num_kv_heads:
            expected_v = x @ full["v"][kv_head * head_dim : (kv_head + 1) * head_dim].T
            torch.testing.assert_close(v, expected_v)
    torch.testing.assert_close(torch.cat(q_parts, -1), x @ full["q"].T)
    if tp_size <= num_kv_heads:
        torch.testing.assert_close(torch.cat(k_parts, -1), x @ full["k"].T)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_mlp_shards_compose(tp_size):
    hidden, inter = 8, 12
    gate, up, down = (
        torch.randn(inter, hidden),
        torch.randn(inter, hidden),
        torch.randn(hidden, inter),
    )
    down_bias = torch.randn(hidden)
    x = torch.randn(3, hidden)
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T + down_bias
    partials = []
    for ctx in ranks(tp_size):
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], False, ctx)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        row = RowParallelLinear(inter, hidden, True, ctx)
        row.weight.weight_loader(row.weight, down)
        row.bias.weight_loader(row.bias, down_bias)
        g, u = gate_up(x).chunk(2, dim=-1)
        partials.append(F.linear(F.silu(g) * u, row.weight))  # row.forward minus all-reduce
    torch.testing.assert_close(sum(partials) + down_bias, expected)


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_vocab_parallel_embedding_and_lm_head(tp_size):
    vocab, hidden = 10, 4  # 10 does not divide by 3: the last shard is padded
    weight = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 9, 3, 4, 7])
    h = torch.randn(2, hidden)
    embeds, logits = [], []
    for ctx in ranks(tp_size):
        emb = VocabParallelEmbedding(vocab, hidden, ctx)
        emb.weight.weight_loader(emb.weight, weight)
        local = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        embeds.append(F.embedding((ids - emb.vocab_start) * local, emb.weight) * local[:, None])
        head = ParallelLMHead(vocab, hidden, ctx)
        head.weight.weight_loader(head.weight, weight)
        logits.append(F.linear(h, head.weight))
    torch.testing.assert_close(sum(embeds), weight[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ weight.T)


def test_shape_mismatch_message():
    layer = MergedColumnParallelLinear(8, [12, 12], False, ParallelContext())
    with pytest.raises(ValueError, match=r"expected shape \(12, 8\), found \(12, 9\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(12, 9), 1)
