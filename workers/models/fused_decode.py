"""Decode steps through the C++ decoder-layer stack on CPU (``kernels/csrc/decode_stack.h``).

Why: on a real 30-layer model about half of an eager decode step at one sequence was Python
and the dispatch of small ops between the matmuls (bench/profile_step.py, bench/RESULTS.md).
The stack runs every layer of a step in one call, with the same matmuls the eager layers
use (it holds references to their weights: no copy), so only the embedding and the LM
head stay in Python.

``attach_fused_decode(model)`` builds the stack from a loaded model and sets
``model.model.fused_decode``; ``LlamaModel.forward`` then sends a step through it when
``FusedDecode.takes`` says so (a batch of single-token decodes, a KV cache of the model's
dtype or FP8) and every other step (prefill, chunked prefill, speculative verification)
through the eager layers. It attaches only where the stack computes exactly what
the eager model does: a Llama, Mistral, Qwen2 or Qwen3 model, or a Mixtral, Qwen2-MoE or
Qwen3-MoE model whose sparse blocks hold every expert in dense weights and compute through
the reference ``fused_moe`` (``kernels/csrc/moe_block.h``; not quantized experts, not expert
parallel), on one rank and one pipeline stage, float32 or bfloat16, each linear layer
multiplying through ``F.linear``, oneDNN's packed weight or the int4 CPU kernel. Elsewhere
it returns the reason and the model runs eager. Its steps give the same bits as the eager ones (same matmuls, the C++ norms and
decode attention of the CPU op set, the same roundings elsewhere: tested), so which path
a step takes never changes a token. ``BATON_FUSED_DECODE=0`` keeps every model eager.

Call it again after replacing a layer's weight (``pack_linear_weights``): the stack holds
the tensors it was built from.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_extension, cpu_linear
from kernels import moe as moe_reference
from kernels.attention_metadata import AttentionMetadata
from kernels.batch_invariant import MIN_ROWS, RowPadded
from kernels.int4_linear import Int4CpuMatmul
from workers.models.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)


class FusedDecode:
    """A model's decoder layers and final norm as one C++ call per decode step."""

    def __init__(self, stack: Any, dtype: torch.dtype) -> None:
        self.stack = stack
        self.dtype = dtype

    def takes(
        self, num_tokens: int, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> bool:
        """Whether this step is one the stack computes: single-token decodes only, on a
        CPU cache of the model's dtype or FP8 (``uint8``)."""
        return (
            attn_metadata.num_decodes == attn_metadata.num_seqs == num_tokens
            and kv_cache.dtype in (self.dtype, torch.uint8)
            and kv_cache.device.type == "cpu"
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Embedded tokens [N, hidden] -> the final norm's output [N, hidden]; writes the
        step's K/V of every layer into ``kv_cache``."""
        return self.stack.forward(
            hidden,
            positions,
            kv_cache,
            attn_metadata.slot_mapping,
            attn_metadata.block_tables,
            attn_metadata.seq_lens,
        )


def _linear(layer: nn.Module, module: Any) -> Any:
    """The C++ ``Linear`` that multiplies as ``layer.matmul`` does; ValueError otherwise."""
    matmul, weight = layer.matmul, layer.weight.detach()
    min_rows = 1
    if isinstance(matmul, RowPadded):  # the C++ Linear pads as RowPadded does
        matmul, min_rows = matmul.inner, MIN_ROWS
    bias = None if layer.bias is None else layer.bias.detach()
    if isinstance(matmul, Int4CpuMatmul):
        linear = module.Linear("int4", weight, bias, matmul.scale_zeros, matmul.group_size)
    elif matmul is cpu_linear.linear:
        linear = module.Linear("onednn", weight, bias, None, 0)
    elif matmul is F.linear and not weight.is_mkldnn:
        linear = module.Linear("dense", weight, bias, None, 0)
    else:
        linear = None
    if linear is not None:
        linear.min_rows = min_rows
        return linear
    raise ValueError(f"a linear layer multiplies through {matmul!r}, which the stack lacks")


def _moe_block(block: SparseMoeBlock, module: Any) -> Any:
    """The C++ ``MoeBlock`` computing ``block`` as its eager forward does; ValueError where
    it cannot (expert parallel, the rebalancer's slots, quantized experts, another
    ``fused_moe`` than the reference)."""
    experts = block.experts
    if block.dispatch is not None or block.expert_map is not None:
        raise ValueError("expert parallel or rebalanced MoE layers")
    if experts.quantized is not None:
        raise ValueError("quantized MoE experts (they run through grouped_moe)")
    if block.first_slot != 0 or experts.num_local_experts != experts.num_experts:
        raise ValueError("a MoE layer that holds only some of its experts")
    # at::linear over a dense [out, in] weight is the reference's x @ w.t() (one mm).
    gate_up = [module.Linear("dense", w, None, None, 0) for w in experts.w13.detach()]
    down = [module.Linear("dense", w, None, None, 0) for w in experts.w2.detach()]
    packed_gate_up, packed_down, packed_min_rows = [], [], 0
    if experts.packed is not None:  # oneDNN per expert from some rows on, as its mlp
        packed_gate_up = [module.Linear("onednn", w, None, None, 0) for w in experts.packed.w13]
        packed_down = [module.Linear("onednn", w, None, None, 0) for w in experts.packed.w2]
        packed_min_rows = moe_reference.PACKED_MIN_ROWS
    elif block.ops.fused_moe is not moe_reference.fused_moe:
        raise ValueError(f"the MoE experts run through {block.ops.fused_moe!r}")
    shared_gate_up = shared_down = shared_gate = None
    if block.shared_expert is not None:
        assert block.shared_expert_gate is not None
        shared_gate_up = _linear(block.shared_expert.gate_up_proj, module)
        shared_down = _linear(block.shared_expert.down_proj, module)
        shared_gate = block.shared_expert_gate.weight.detach()
    cpp = module.MoeBlock(
        block.gate.weight.detach(),
        gate_up,
        down,
        packed_gate_up,
        packed_down,
        packed_min_rows,
        block.top_k,
        block.renormalize,
        block.expert_tokens,  # the block's own buffer: the C++ block counts into it
        shared_gate_up,
        shared_down,
        shared_gate,
    )
    if experts.packed is not None:  # the few-row expert_matvec, as its mlp (0: none)
        cpp.matvec_max_rows = experts.packed.matvec_max_rows
    return cpp


def _why_not(model: nn.Module) -> str | None:
    """Why the stack cannot compute ``model`` exactly, or None when it can."""
    from workers.models.llama import LlamaForCausalLM, MistralForCausalLM
    from workers.models.mixtral import MixtralForCausalLM
    from workers.models.qwen2 import Qwen2ForCausalLM
    from workers.models.qwen2_moe import Qwen2MoeForCausalLM
    from workers.models.qwen3 import Qwen3ForCausalLM
    from workers.models.qwen3_moe import Qwen3MoeForCausalLM

    if type(model) not in (
        LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
        MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
    ):  # fmt: skip
        return (
            f"{type(model).__name__} is not a Llama, Mistral, Qwen2, Qwen3, Mixtral, "
            "Qwen2-MoE or Qwen3-MoE model"
        )
    inner = model.model
    parallel = inner.parallel
    if parallel.tp_size != 1 or not (parallel.is_first_stage and parallel.is_last_stage):
        return "tensor or pipeline parallel"
    dtype = inner.rotary_emb.cos_sin_cache.dtype
    if inner.rotary_emb.cos_sin_cache.device.type != "cpu":
        return "not on CPU"
    if dtype not in _DTYPES:
        return f"dtype {dtype}"
    if not inner.layers[inner.start_layer].self_attn.attn.ops.is_cpu_kernels:
        # Its eager steps would norm and attend otherwise than the stack: the two would
        # not agree to the bit, and a sequence's tokens would depend on its batches.
        return "the model's op set is not the C++ CPU kernels"
    return None


def attach_fused_decode(model: nn.Module) -> str | None:
    """Build the stack for ``model`` and set ``model.model.fused_decode`` (None when it
    does not apply); returns None when attached, else the reason (also logged)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "fused_decode"):
        inner.fused_decode = None
    if os.environ.get("BATON_FUSED_DECODE", "1") == "0":
        return "turned off by BATON_FUSED_DECODE=0"
    reason = _why_not(model)
    module = cpu_extension.load() if reason is None else None
    if reason is None and module is None:
        reason = "the C++ CPU kernels are unavailable"
    if reason is None:
        try:
            stack = _build(model, module)
        except ValueError as exc:
            reason = str(exc)
        else:
            model.model.fused_decode = FusedDecode(
                stack, model.model.rotary_emb.cos_sin_cache.dtype
            )
            logger.info("decode steps: the C++ layer stack (%d layers)", stack.num_layers)
            return None
    logger.info("decode steps: eager layers (%s)", reason)
    return reason


def _build(model: nn.Module, module: Any) -> Any:
    inner = model.model
    layers = list(inner.layers)
    first = layers[0].self_attn
    norm = inner.norm
    stack = module.DecodeStack(
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        norm.eps,
        first.attn.scale,
        inner.rotary_emb.cos_sin_cache,
        norm.weight.detach(),
    )
    for layer in layers:
        attn = layer.self_attn
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if isinstance(layer.mlp, SparseMoeBlock):
            add, mlp = stack.add_moe_layer, (_moe_block(layer.mlp, module),)
        else:
            add = stack.add_layer
            mlp = (_linear(layer.mlp.gate_up_proj, module), _linear(layer.mlp.down_proj, module))
        add(
            _linear(attn.qkv_proj, module),
            _linear(attn.o_proj, module),
            *mlp,
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            None if q_norm is None else q_norm.weight.detach(),
            None if k_norm is None else k_norm.weight.detach(),
            attn.attn.layer_idx,
            attn.attn.k_scale,  # static FP8 KV scales, read only with an FP8 cache
            attn.attn.v_scale,
        )
    return stack
