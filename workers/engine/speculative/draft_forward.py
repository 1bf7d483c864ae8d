"""The draft model's forward for its proposal loop: one token per row, few ops.

A draft exists to be cheap, but a small model's forward through the engine's general path
(``ModelRunner``: step inputs, attention metadata, decode groups, the reference kernels'
checks and dtype conversions, oneDNN linears) is bound by per-op overhead, not by
arithmetic: on the development CPU a 1.6M-parameter draft step cost 1.5 ms against the
20M-parameter target's 10 ms (bench/RESULTS.md, "Speculative decoding"). This runs the
same Llama computation for rows of exactly one new token each, with the step's shared
inputs (RoPE rows, block gather index, mask) built once per step rather than once per
layer, q and k rotated together, K and V stored with one scatter, attention through one
fused ``scaled_dot_product_attention`` over the gathered blocks, and the linears through
``F.linear`` (on that CPU MKL's matrix-vector product beats oneDNN's packed weights 2-4x at
these shapes; ``bench/speculative.py`` measured the whole).

Its numbers may differ from the general path in the last bits (another op order): that
changes which tokens the draft proposes, never what the engine outputs, which the target
verifies (greedy equality and rejection sampling do not depend on how ``q`` was computed,
only on it being the distribution the proposals were drawn from).

Plain Llama-family drafts only (no biases, no q/k norms, full-width RoPE, one rank, float
weights): ``LeanDraftForward.supports`` says which; others take the general path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.models.base import CausalLM
from workers.models.llama import LlamaForCausalLM, MistralForCausalLM

_LayerWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor]  # fmt: skip


class LeanDraftForward:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        if not self.supports(model):
            raise ValueError("not a plain single-rank Llama-family model")
        body = model.model  # type: ignore[attr-defined]
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, Hkv, block_size, D]
        self.block_size = block_size
        attn = body.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        self.vocab_size = model.lm_head.num_embeddings  # type: ignore[attr-defined]
        self.eps = body.norm.eps
        self.embed = body.embed_tokens.weight
        self.layers: list[_LayerWeights] = [
            (
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
            )
            for layer in body.layers
        ]
        self.norm = body.norm.weight
        self.lm_head = model.lm_head.weight  # type: ignore[attr-defined]
        # RoPE in the rotate-half form: x * cos + swap_halves(x) * sin_signed, with
        # cos = [c, c] and sin_signed = [-s, s] per position: [max_position, 2, D].
        cos, sin = body.rotary_emb.cos_sin_cache.chunk(2, dim=-1)
        self.rope = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1)

    @staticmethod
    def supports(model: CausalLM) -> bool:
        """Whether ``model`` is a draft this forward computes exactly as its own forward."""
        if type(model) not in (LlamaForCausalLM, MistralForCausalLM):
            return False
        body = model.model  # type: ignore[attr-defined]
        if model.lm_head is None or body.embed_tokens is None:  # type: ignore[attr-defined]
            return False
        if body.parallel.tp_size != 1 or body.parallel.pp_size != 1:
            return False
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.bias is not None or lin.weight.is_mkldnn for lin in linears):
                return False
            if not all(lin.weight.is_floating_point() for lin in linears):
                return False
        head_dim = body.layers[0].self_attn.head_dim
        return body.rotary_emb.cos_sin_cache.shape[-1] == head_dim

    def step_inputs(
        self, positions: list[int], tables: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What every layer of one step shares, for rows at ``positions`` (their new token)
        with block tables ``tables`` [rows, >= num_blocks] (int64): the RoPE rows, the new
        tokens' (block, offset), the gather index and the mask (None: one row, which
        attends to exactly its context)."""
        bs = self.block_size
        pos = torch.tensor(positions, dtype=torch.int64, device=tables.device)
        blocks = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
        rope = self.rope.index_select(0, pos).unsqueeze(2)  # [rows, 2, 1, D]
        gather = tables[:, :num_blocks].reshape(-1)
        mask = None
        if len(positions) > 1:
            ctx = torch.arange(num_blocks * bs, device=tables.device)
            mask = (ctx.unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]  # [rows,1,1,ctx]
        return rope, blocks, pos % bs, gather, mask

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: list[int],
        tables: torch.Tensor,
        compute_logits: bool = True,
    ) -> torch.Tensor | None:
        """One new token per row: ``input_ids`` [rows] at ``positions`` (one per row), the
        rows' block tables ``tables`` [rows, >= blocks] (int64). Writes the tokens' K/V
        into the draft's cache; returns float32 logits [rows, vocab_size] (or None)."""
        rows, bs = input_ids.shape[0], self.block_size
        num_blocks = -(-(max(positions) + 1) // bs)
        rope, blocks, offsets, gather, mask = self.step_inputs(positions, tables, num_blocks)
        ctx_len = max(positions) + 1 if mask is None else num_blocks * bs
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half = d // 2
        x = F.embedding(input_ids, self.embed)
        residual = x
        for i, (norm_in, w_qkv, w_o, norm_post, w_gate_up, w_down) in enumerate(self.layers):
            if i:
                x = x + residual
                residual = x
            h = _rms_norm(x, norm_in, self.eps)
            qkv = F.linear(h, w_qkv)
            qk = qkv[:, : self.qk_size].view(rows, hq + hkv, d)
            swapped = torch.cat((qk[..., half:], qk[..., :half]), -1)
            qk = torch.addcmul(qk * rope[:, 0], swapped, rope[:, 1])
            kv = torch.cat((qk[:, hq:], qkv[:, self.qk_size :].view(rows, hkv, d)), 1)
            layer_cache = self.kv_cache[:, i]  # [num_blocks, 2, Hkv, bs, D]
            layer_cache[blocks, :, :, offsets] = kv.view(rows, 2, hkv, d)
            # [2, Hkv, rows * blocks, bs, D] -> K, V as [rows, Hkv, ctx, D] (views)
            ctx = layer_cache.permute(1, 2, 0, 3, 4).index_select(2, gather)
            ctx = ctx.view(2, hkv, rows, num_blocks * bs, d)[:, :, :, :ctx_len].transpose(1, 2)
            q = qk[:, :hq].unsqueeze(2)  # [rows, Hq, 1, D]
            out = F.scaled_dot_product_attention(q, ctx[0], ctx[1], attn_mask=mask, enable_gqa=True)
            x = F.linear(out.view(rows, hq * d), w_o)
            x = x + residual
            residual = x
            h = _rms_norm(x, norm_post, self.eps)
            gate, up = F.linear(h, w_gate_up).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, w_down)
        if not compute_logits:
            return None
        h = _rms_norm(x + residual, self.norm, self.eps)
        return F.linear(h, self.lm_head)[:, : self.vocab_size].float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # kernels/rms_norm.py's numerics (float32 statistics) for a float32 or lower x.
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)
