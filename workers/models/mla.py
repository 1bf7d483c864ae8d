"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention, after Hugging Face's
``DeepseekV3Attention``, over the paged latent cache (``kernels/mla_attention.py``).

Per token the layer computes a query per head, ``[q_nope (qk_nope_head_dim), q_pe
(qk_rope_head_dim)]`` (through ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``, or one
``q_proj`` when ``q_lora_rank`` is None), and one latent for all heads,
``kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank), k_pe (qk_rope_head_dim)]``; ``c_kv`` is
normalised (``kv_a_layernorm``), ``q_pe`` and ``k_pe`` rotated. The cache stores the row
``cat(c_kv, k_pe)``, nothing else. Each head's key is ``[W_UK_h c_kv, k_pe]`` and its value
``W_UV_h c_kv``, ``kv_b_proj`` = ``[W_UK_h; W_UV_h]`` per head. Two ways to attend:

- **expanded** (prefill chunks, ``_expand_attention``): the sequence's cached rows are
  expanded through ``kv_b_proj`` to per-head keys and values, then ordinary causal
  attention. Compute-bound prefill does the expansion once per chunk.
- **absorbed** (decodes, ``_absorbed_decode``): ``W_UK`` is folded into the query,
  ``q_lat_h = q_nope_h W_UK_h`` (``kv_lora_rank`` wide), so a head scores a cached row as
  ``[q_lat_h, q_pe_h] . row``, attention runs on the latent rows directly (every head
  reads the same 576 values per token: memory-bound decode reads the cache once), and the
  latent output goes through ``W_UV_h`` and then ``o_proj``. Both give the same result up
  to rounding (tests/workers/test_deepseek.py).

Tensor parallel: the heads are split (``q_b_proj``/``q_proj``, ``kv_b_proj`` by rows,
``o_proj`` by columns with its all-reduce); ``q_a_proj``, ``kv_a_proj_with_mqa`` and the
latent cache are replicated: every rank caches the same rows.

``rope_interleave`` (V3's default; V2 always): RoPE rotates the pairs ``(x0, x1), (x2,
x3), ...``. Taking the even features then the odd ones and rotating the halves
(``rotate_half``) is the same rotation with the output in that order, which Hugging Face's
``apply_rotary_pos_emb_interleave`` also returns; q and k share the order, so their dot
products are the same. The reordering is done once, on the rows of ``q_b_proj`` /
``q_proj`` and ``kv_a_proj_with_mqa`` that compute ``q_pe`` and ``k_pe``, as they load
(``permute_rope_rows``): the projections already give the halves, no gather per step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from kernels.mla_attention import gather_latent, latent_layer, store_latent
from workers.models.arch_config import ArchConfig
from workers.models.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    _check_shape,
    new_param,
)
from workers.models.parallel import ParallelContext, divide

# HF's DeepseekV3RMSNorm default: q_a_layernorm / kv_a_layernorm ignore rms_norm_eps.
_LORA_NORM_EPS = 1e-6


class ReplicatedLinear(ColumnParallelLinear):
    """``y = x W^T + b`` with the whole weight on every rank (the latent projections): a
    column-parallel layer over one rank, so that the loader packs it for oneDNN on CPU
    and ``model.deterministic`` makes it batch-invariant like every other linear."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelContext):
        super().__init__(input_size, output_size, bias, replace(parallel, tp_rank=0, tp_size=1))


def permute_rope_rows(param: nn.Parameter, rows_per_head: int, rope_start: int, order) -> None:
    """Make ``param``'s loader reorder, after loading, the rows ``rope_start:`` of every
    ``rows_per_head`` rows by ``order`` (the parameter's rows that compute a RoPE part):
    the interleaved pairs come out as halves, with no gather per step (module docstring)."""
    load = param.weight_loader

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        load(param, loaded_weight, shard_id)
        rows = param.data.view(-1, rows_per_head, *param.shape[1:])
        rows[:, rope_start:] = rows[:, rope_start:][:, order].clone()

    param.weight_loader = loader


class HeadParallelLinear(nn.Module):
    """``kv_b_proj``: column-parallel by heads like ``ColumnParallelLinear``, but its weight
    stays a plain tensor (never packed for oneDNN), because the absorbed decode reads it
    as ``W_UK`` / ``W_UV`` per head."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.output_size = output_size
        size = divide(output_size, parallel.tp_size, "kv_b_proj output size")
        self.weight = new_param((size, input_size), self.weight_loader)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        _check_shape(loaded_weight, (self.output_size, param.shape[1]))
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.parallel.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MlaAttention(nn.Module):
    """One decoder layer's MLA (module docstring); the ``attention_cls`` of
    ``workers/models/deepseek.py``."""

    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        mla = config.deepseek
        assert mla is not None  # an MLA model's config (deepseek_config.py)
        self.ops = ops
        self.layer_idx = layer_idx  # in this stage's cache
        self.q_lora_rank = mla.q_lora_rank
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim = mla.qk_nope_head_dim
        self.qk_rope_head_dim = mla.qk_rope_head_dim
        self.qk_head_dim = mla.qk_head_dim
        self.v_head_dim = mla.v_head_dim
        self.scale = mla.softmax_scale
        total_heads = config.num_attention_heads
        self.num_heads = divide(total_heads, parallel.tp_size, "num_attention_heads")
        hidden, bias = config.hidden_size, config.attention_bias
        q_size = total_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_size, False, parallel)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, parallel)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS, ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_size, False, parallel)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.cache_row, bias, parallel)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS, ops)
        self.kv_b_proj = HeadParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), parallel
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias, parallel)
        self.rotary_emb = rotary_emb  # shared by all layers, qk_rope_head_dim wide
        if mla.rope_interleave:  # interleaved pairs -> halves, in the weights (docstring)
            rope = self.qk_rope_head_dim
            order = [*range(0, rope, 2), *range(1, rope, 2)]
            q_out = self.q_proj if self.q_lora_rank is None else self.q_b_proj
            projections = ((q_out, self.qk_head_dim), (self.kv_a_proj_with_mqa, mla.cache_row))
            for proj, rows_per_head in projections:
                for param in (proj.weight, proj.bias):
                    if param is not None:
                        permute_rope_rows(param, rows_per_head, rows_per_head - rope, order)
        # Decodes (and, where the op set has the kernel, prefill chunks) through the
        # absorbed form (False: all expanded; tests compare).
        self.absorb_decodes = True

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; stores this step's latent rows into
        this layer of the latent cache [num_blocks, num_layers, 1, 1, block_size, R + P]."""
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # [T, R + P]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [T, R]
        q_pe, k_pe = self._rope(positions, q_pe, k_pe)  # [T, H, P], [T, P]
        latent_cache = latent_layer(kv_cache, self.layer_idx)  # [num_blocks, bs, R + P]
        store_latent(torch.cat((c_kv, k_pe), dim=-1), latent_cache, attn_metadata.slot_mapping)

        out = hidden_states.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        num_decodes = attn_metadata.num_decodes if self.absorb_decodes else 0
        if num_decodes:
            q_abs = self._absorb(q_nope[:num_decodes], q_pe[:num_decodes])
            out_lat = self.ops.mla_decode_attention(
                q_abs, latent_cache, attn_metadata, self.scale, self.kv_lora_rank
            )  # [N, H, R]
            out[:num_decodes] = self._unabsorb(out_lat)
        prefill = self.ops.mla_prefill_attention if self.absorb_decodes else None
        if prefill is not None and num_decodes < attn_metadata.num_seqs:
            # The op set's kernel (Triton): every chunk on its latent rows, in one call.
            q_abs = self._absorb(q_nope[num_decodes:], q_pe[num_decodes:])
            out_lat = prefill(q_abs, latent_cache, attn_metadata, self.scale, self.kv_lora_rank)
            out[num_decodes:] = self._unabsorb(out_lat)
            num_decodes = attn_metadata.num_seqs  # nothing left to expand
        start = num_decodes
        for seq_idx in range(num_decodes, attn_metadata.num_seqs):
            end = start + attn_metadata.query_lens_cpu[seq_idx]
            out[start:end] = self._expand_attention(
                q_nope[start:end],
                q_pe[start:end],
                latent_cache,
                attn_metadata.block_tables[seq_idx],
                attn_metadata.seq_lens_cpu[seq_idx],
            )
            start = end
        return self.o_proj(out.view(num_tokens, self.num_heads * self.v_head_dim))

    def _rope(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe[:, None].contiguous())
        return q_pe, k_pe[:, 0]

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Queries in latent space: [N, H, dn], [N, H, P] -> [N, H, R + P],
        ``cat(q_nope_h W_UK_h, q_pe_h)`` (module docstring)."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self._w_kv()[0])  # [H, N, R]
        return torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)

    def _unabsorb(self, out_lat: torch.Tensor) -> torch.Tensor:
        """Latent attention outputs through ``W_UV``: [N, H, R] -> [N, H, dv]."""
        out = torch.bmm(out_lat.transpose(0, 1), self._w_kv()[1].transpose(1, 2))  # [H, N, dv]
        return out.transpose(0, 1)

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` per head: (W_UK [H, dn, R], W_UV [H, dv, R])."""
        w_kv = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        return w_uk, w_uv

    def _expand_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        """One sequence's chunk [q, H, *] attending causally to its ``seq_len`` cached rows
        (the chunk's own included), expanded to per-head keys and values -> [q, H, dv]."""
        query_len = q_nope.shape[0]
        rows = gather_latent(latent_cache, block_table, seq_len, q_nope.dtype)  # [S, R + P]
        kv = self.kv_b_proj(rows[:, : self.kv_lora_rank])  # [S, H * (dn + dv)]
        kv = kv.view(seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = rows[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        key = torch.cat((k_nope, k_pe), dim=-1)  # [S, H, qk_head_dim]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [q, H, qk_head_dim]
        # [1, H, len, dim]: a batch dim of 1 takes torch's fused CPU kernel (paged_attention.py).
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        if query_len == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # bottom-right aligned: query i sits at position seq_len - query_len + i
            ctx = torch.arange(seq_len, device=q.device)
            mask = ctx[None, :] <= ctx[seq_len - query_len :, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1)  # [q, H, dv]
