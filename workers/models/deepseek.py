"""DeepSeek-V2 and DeepSeek-V3 (and R1: V3's architecture), after Hugging Face's
``modeling_deepseek_v3.py`` / ``modeling_deepseek_v2.py``.

Llama's decoder (``workers/models/llama.py``: pre-norm residual blocks, pipeline stages)
with multi-head latent attention (``workers/models/mla.py``: the cache holds one latent row
per token and layer) and, past the first ``first_k_dense_replace`` dense layers, a MoE
block: routed experts chosen by group-limited top-k (``kernels.moe.select_experts_grouped``:
V3 scores with a sigmoid and picks with ``e_score_correction_bias``, V2 with a softmax)
computed by ``ops.fused_moe`` (the Triton kernel on CUDA), plus ``n_shared_experts``
always-on experts as one dense MLP, added. YaRN RoPE scaling: ``kernels/rotary.py``; its
softmax correction (``mscale_all_dim``) is in ``DeepseekConfig.softmax_scale``.

Checkpoint names are Hugging Face's: ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, ``mlp.gate.weight``
(and V3's ``mlp.gate.e_score_correction_bias``), ``mlp.experts.{e}.{gate,up,down}_proj``
or the stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (``workers/models/moe.py``'s
``ExpertNames``), ``mlp.shared_experts.{gate,up,down}_proj``. A real V3 checkpoint's
multi-token-prediction layer (``model.layers.61``, past ``num_hidden_layers``) is skipped.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps
from kernels.moe import select_experts_grouped
from workers.models.arch_config import ArchConfig
from workers.models.expert_names import ExpertNames
from workers.models.layers import default_weight_loader
from workers.models.llama import LlamaForCausalLM, LlamaMLP
from workers.models.mla import MlaAttention
from workers.models.moe import SparseMoeBlock, count_expert_tokens
from workers.models.parallel import ParallelContext


def _float32_param(*shape: int) -> nn.Parameter:
    # The router stays float32 whatever the model's dtype, as transformers keeps it
    # (``_keep_in_fp32_modules_strict``): routing decisions are sensitive to rounding.
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class DeepseekGate(nn.Module):
    """The router: ``weight`` [num_experts, hidden] and (V3) ``e_score_correction_bias``."""

    def __init__(self, num_experts: int, hidden_size: int, has_correction_bias: bool) -> None:
        super().__init__()
        self.weight = _float32_param(num_experts, hidden_size)
        self.e_score_correction_bias = _float32_param(num_experts) if has_correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [num_tokens, num_experts] float32


class DeepseekMoE(SparseMoeBlock):
    """Router, routed experts and shared experts of one MoE layer (module docstring).

    ``workers/models/moe.py``'s block with DeepSeek's router (``DeepseekGate``, grouped
    top-k) and its ungated shared experts, one ``LlamaMLP`` of ``n_shared_experts *
    moe_intermediate_size`` (which all-reduces itself). Parallelism is the block's: each
    expert's intermediate dimension split over the TP ranks, or whole experts per rank
    with expert parallelism, the routed sum reduced in ``combine`` / the dispatcher."""

    def __init__(
        self, config: ArchConfig, parallel: ParallelContext, ops: KernelOps, layer_idx: int
    ) -> None:
        super().__init__(config, parallel, ops, layer_idx=layer_idx)
        ds = config.deepseek
        assert ds is not None
        self.deepseek = ds
        self.gate = DeepseekGate(config.num_experts, config.hidden_size, ds.has_correction_bias)
        self.shared_experts: LlamaMLP | None = None
        if ds.n_shared_experts:
            size = config.moe_intermediate_size * ds.n_shared_experts
            shared = dataclasses.replace(config, intermediate_size=size)
            self.shared_experts = LlamaMLP(shared, parallel, ops)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ds = self.deepseek
        topk_weights, topk_ids = select_experts_grouped(
            self.gate(hidden_states),
            self.top_k,
            num_groups=ds.n_group,
            topk_groups=ds.topk_group,
            scoring=ds.scoring,
            group_score=ds.group_score,
            correction_bias=self.gate.e_score_correction_bias,
            renormalize=self.renormalize,
            scaling=ds.routed_scaling_factor,
        )  # float32 [num_tokens, top_k] each
        count_expert_tokens(self.expert_tokens, topk_ids)
        if self.dispatch is not None:  # expert parallel: the whole layer on every rank
            out = self.dispatch(hidden_states, topk_weights, topk_ids, self._local_experts)
        else:  # [num_tokens, hidden_size], the TP ranks' partial sums added
            out = self.combine(self._local_experts(hidden_states, topk_weights, topk_ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def make_deepseek_mlp(
    config: ArchConfig, layer_idx: int, parallel: ParallelContext, ops: KernelOps
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense (``intermediate_size``) for the first
    ``first_k_dense_replace`` layers (``config.mlp_only_layers``), else the MoE block."""
    if config.is_moe_layer(layer_idx):
        return DeepseekMoE(config, parallel, ops, layer_idx)
    return LlamaMLP(config, parallel, ops)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 (module docstring); the engine sizes its latent cache from
    ``ArchConfig.kv_cache_*`` (one row of kv_lora_rank + qk_rope_head_dim per token)."""

    attention_cls = MlaAttention
    make_mlp = staticmethod(make_deepseek_mlp)
    # Only the dense MLPs' gate/up are fused; MLA's projections load as they are named.
    packed_modules_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config: ArchConfig, parallel: ParallelContext, ops: KernelOps) -> None:
        if config.deepseek is None:
            raise ValueError(f"{config.architecture}: no multi-head latent attention config")
        super().__init__(config, parallel, ops)
        self.expert_names = ExpertNames(
            "mlp", "gate_proj", "up_proj", "down_proj", num_experts=config.num_experts
        )


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite: V3's layers with softmax routing (greedy, or
    ``group_limited_greedy`` by each group's best expert), no correction bias, RoPE always
    interleaved (all read into ``ArchConfig.deepseek``)."""
