"""The sparse Mixture-of-Experts block of Mixtral and Qwen2/Qwen3-MoE, after Hugging Face's
``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``, and how checkpoints name its experts.

A router (``gate``, a replicated linear H -> num_experts) picks each token's top-k experts
(softmax over all experts, ``kernels.moe.select_experts``); the experts, held as two
stacked parameters, run through ``ops.fused_moe`` (the PyTorch reference, or a fused kernel
where the op set has one). Qwen2-MoE adds a dense shared expert scaled by
``sigmoid(shared_expert_gate(x))``.

Parallelism. Tensor parallel: every expert's intermediate dimension is split over the TP
ranks, as the dense MLP's is (gate/up rows and down columns; the router is replicated), so
each rank's ``fused_moe`` is a partial sum, added up in ``SparseMoeBlock.combine`` (a no-op
on a single rank). Expert parallel (``parallel.expert_parallel``, docs/moe.md): the same TP
ranks hold whole experts instead, ``E / tp_size`` consecutive ones each
(``ExpertPlacement``), and the layer's tokens reach them through the configured dispatcher
(``workers/models/expert_parallel.py``: one all-reduce, or all-to-all both ways). With the
rebalancer on, each rank also holds ``expert_redundant`` spare rows for copies of hot
experts, and the layer's ``ExpertMap`` turns each pair's expert into one copy's slot
before dispatch (``workers/models/expert_rebalance.py``).

Quantized (``quantization: fp8 | int4`` on load): after loading, each rank's stacks become
``kernels/moe_quant.py``'s (``workers/models/quant/experts.py``), and the layer runs them
through ``kernels.moe.grouped_moe``, one call per active expert (docs/moe.md).

Packed (CPU, where the loader's measurement packs the linear weights for oneDNN):
``pack_expert_weights`` gives each single-rank layer's experts a oneDNN copy too
(``kernels.moe.PackedExperts``), used from ``PACKED_MIN_ROWS`` rows of an expert on, and
(float32) the C++ ``expert_matvec`` for an expert's one or few rows where it wins here
(``use_expert_matvec``, timed at load). Decode
steps of single-rank layers run in C++ (``kernels/csrc/moe_block.h``, through
``workers/models/fused_decode.py``), with the same bits.

Checkpoint layouts: ``workers/models/expert_names.py`` (``ExpertNames``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps, cpu_extension
from kernels.moe import PackedExperts, choose_matvec_rows, grouped_moe, select_experts
from kernels.moe_quant import QuantizedExperts
from workers.models.arch_config import ArchConfig
from workers.models.expert_names import ExpertNames, ExpertShard
from workers.models.expert_parallel import ExpertPlacement, make_dispatcher
from workers.models.expert_rebalance import ExpertMap
from workers.models.layers import _check_shape, default_weight_loader, new_param
from workers.models.llama import LlamaForCausalLM, LlamaMLP
from workers.models.parallel import ParallelContext, divide

logger = logging.getLogger(__name__)


class ReplicatedLinear(nn.Module):
    """``y = x W^T``, the whole weight on every rank (a router: small, and every rank
    needs all of its output)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = new_param((output_size, input_size), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [num_tokens, output_size]


class FusedExperts(nn.Module):
    """The routed experts of one layer held here: ``w13`` [E_local, 2 * I_tp, H] (each
    expert's gate rows over its up rows) and ``w2`` [E_local, H, I_tp], ``I_tp`` this TP
    rank's slice of ``intermediate_size``; row ``e`` is expert ``first_expert + e``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext,
        first_expert: int = 0,
        num_local_experts: int | None = None,
        num_spare: int = 0,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.first_expert = first_expert
        self.num_local_experts = (
            num_experts - first_expert if num_local_experts is None else num_local_experts
        )
        if first_expert < 0 or first_expert + self.num_local_experts > num_experts:
            raise ValueError(
                f"experts {first_expert}..{first_expert + self.num_local_experts - 1} "
                f"held here, but the model has {num_experts}"
            )
        self.shard_size = divide(intermediate_size, parallel.tp_size, "moe_intermediate_size")
        # Rows past the experts held here: the rebalancer's spare slots, filled only when
        # it copies an expert in (zero until then: never routed to).
        size, num_rows = self.shard_size, self.num_local_experts + num_spare
        self.w13 = new_param((num_rows, 2 * size, hidden_size), self.weight_loader)
        self.w2 = new_param((num_rows, hidden_size, size), self.weight_loader)
        if num_spare:
            self.w13.data[-num_spare:].zero_()
            self.w2.data[-num_spare:].zero_()
        # model.quantization fp8 / int4: the stacks that replace w13 / w2 after loading.
        self.quantized: QuantizedExperts | None = None
        # CPU, linear weights packed for oneDNN: each expert's packed w13 / w2 instead.
        self.packed: PackedExperts | None = None

    def set_quantized(self, quantized: QuantizedExperts) -> None:
        """Compute with ``quantized`` (this rank's rows of ``w13`` / ``w2``, quantized by
        ``workers/models/quant/experts.py``) from now on and free the dense stacks."""
        del self.w13, self.w2
        self.quantized = quantized

    def set_packed(self, packed: PackedExperts) -> None:
        """Compute with ``packed`` (these rows of ``w13`` / ``w2``, each expert also packed
        for oneDNN) from now on; single-rank layers only (the rebalancer and the
        dispatchers copy the stacks, which packing would leave stale)."""
        self.packed = packed

    def stacked(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the experts (dense, or quantized values and scales), each
        [rows, ...] with row ``e`` all of slot ``e``: what the rebalancer copies."""
        return self.quantized.tensors if self.quantized is not None else (self.w13, self.w2)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ExpertShard
    ) -> None:
        """Copy this rank's part of one checkpoint tensor (``ExpertShard``) into ``param``:
        its TP slice of the intermediate dimension, of the experts held here."""
        piece, expert = shard_id
        hidden, inter, size = self.hidden_size, self.intermediate_size, self.shard_size
        cols = slice(self.parallel.tp_rank * size, (self.parallel.tp_rank + 1) * size)
        if expert is not None:  # one expert's [I, H] gate / up or [H, I] down
            if piece not in ("gate", "up", "down") or not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} {piece!r}: the model has {self.num_experts}")
            _check_shape(loaded_weight, (hidden, inter) if piece == "down" else (inter, hidden))
            local = expert - self.first_expert
            if not 0 <= local < self.num_local_experts:
                return  # held by another rank: never read
            if piece == "down":
                param.data[local].copy_(loaded_weight[:, cols])
            else:
                offset = 0 if piece == "gate" else size
                param.data[local, offset : offset + size].copy_(loaded_weight[cols])
            return
        held = slice(self.first_expert, self.first_expert + self.num_local_experts)
        rows = param.data[: self.num_local_experts]  # the spare rows stay as they are
        if piece == "gate_up":  # [E, 2I, H]: every expert's gate rows, then its up rows
            _check_shape(loaded_weight, (self.num_experts, 2 * inter, hidden))
            up_cols = slice(inter + cols.start, inter + cols.stop)
            rows[:, :size].copy_(loaded_weight[held, cols])
            rows[:, size:].copy_(loaded_weight[held, up_cols])
        elif piece == "down":  # [E, H, I]
            _check_shape(loaded_weight, (self.num_experts, hidden, inter))
            rows.copy_(loaded_weight[held, :, cols])
        else:
            raise ValueError(f"bad stacked expert piece {piece!r}")


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(
        self,
        config: ArchConfig,
        parallel: ParallelContext,
        ops: KernelOps,
        *,
        first_expert: int = 0,
        num_local_experts: int | None = None,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        if ops.is_batch_invariant:
            raise ValueError(
                "model.deterministic: the MoE experts have no batch-invariant kernel "
                f"({config.architecture})"
            )
        self.ops = ops
        self.parallel = parallel
        self.layer_idx = layer_idx  # the model's numbering (expert load is reported by it)
        # (token, slot) pairs routed to each expert (global ids) since the model was built:
        # the expert load the worker reports (workers/serving/metrics.py, baton status).
        # Every rank routes every token alike, so rank 0's counts are the whole layer's.
        self.register_buffer(
            "expert_tokens", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False
        )
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.dispatch = None
        self.expert_map: ExpertMap | None = None  # expert_redundant > 0: the rebalancer's
        self.first_slot = first_expert  # fused_moe's id of this rank's first weight row
        expert_parallel, num_spare = parallel, 0
        if parallel.expert_parallel and parallel.ep_size > 1:  # TP ranks, or data-parallel
            ep_size, num_spare = parallel.ep_size, parallel.expert_redundant
            placement = ExpertPlacement(config.num_experts, parallel.ep_rank, ep_size)
            first_expert, num_local_experts = placement.first_expert, placement.num_local_experts
            if num_spare:
                check_redundant(num_spare, config.num_experts, ep_size)
                self.expert_map = ExpertMap(config.num_experts, ep_size, num_spare)
                # The dispatchers see S = E/N + R physical slots per rank as the "experts".
                slots = num_local_experts + num_spare
                placement = ExpertPlacement(ep_size * slots, parallel.ep_rank, ep_size)
            self.first_slot = placement.first_expert
            self.dispatch = make_dispatcher(
                placement, parallel.expert_dispatch, parallel.ep_group, parallel.dp_tokens
            )
            expert_parallel = ParallelContext()  # whole experts: no TP split inside one
        self.experts = FusedExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            expert_parallel,
            first_expert,
            num_local_experts,
            num_spare,
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                config, intermediate_size=config.shared_expert_intermediate_size
            )
            self.shared_expert = LlamaMLP(shared, parallel, ops)  # all-reduces itself
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)  # [num_tokens, num_experts]
        # float32 [num_tokens, top_k] each
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, renormalize=self.renormalize
        )
        count_expert_tokens(self.expert_tokens, topk_ids)
        if self.expert_map is not None:  # each pair to one copy of its expert
            topk_ids = self.expert_map.physical(topk_ids)
        if self.dispatch is not None:  # expert parallel: the whole layer on every rank
            out = self.dispatch(hidden_states, topk_weights, topk_ids, self._local_experts)
        else:
            out = self.combine(self._local_experts(hidden_states, topk_weights, topk_ids))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = torch.sigmoid(self.shared_expert_gate(hidden_states))  # [num_tokens, 1]
            out = out + gate * self.shared_expert(hidden_states)
        return out

    def _local_experts(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum over each row's pairs whose experts are held here, [rows, H]."""
        quantized = self.experts.quantized
        if quantized is not None:  # no fused kernel: one matmul pair per active expert
            return grouped_moe(
                hidden, topk_weights, topk_ids, quantized.num_rows, quantized.mlp, self.first_slot
            )
        packed = self.experts.packed
        if packed is not None:  # CPU, oneDNN per expert (pack_expert_weights)
            return grouped_moe(
                hidden, topk_weights, topk_ids, packed.num_rows, packed.mlp, self.first_slot
            )
        return self.ops.fused_moe(
            hidden,
            self.experts.w13,
            self.experts.w2,
            topk_weights,
            topk_ids,
            first_expert=self.first_slot,
        )

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Sum the TP ranks' partial expert outputs [num_tokens, hidden_size] (in place),
        their intermediate slices, as ``RowParallelLinear`` does; a no-op on one rank.
        (Expert parallelism sums through its dispatcher instead.)"""
        return self.parallel.all_reduce(out)


def pack_expert_weights(model: nn.Module) -> int:
    """Pack each expert of every single-rank MoE layer of ``model`` for oneDNN
    (``kernels.moe.PackedExperts``), as ``pack_linear_weights`` packs the dense linears: CPU,
    after loading, where the loader's measurement keeps packing. Tensor or expert parallel
    layers (a dispatcher, the rebalancer's slots: they read the stacks) and quantized
    experts keep theirs.
    Mutates the model; returns how many layers were packed."""
    blocks = [
        m
        for m in model.modules()
        if isinstance(m, SparseMoeBlock)
        and m.parallel.tp_size == 1  # single-rank replicas only (the stack's scope)
        and m.dispatch is None
        and m.expert_map is None
        and m.experts.quantized is None
        and m.experts.packed is None
    ]
    for block in blocks:
        experts = block.experts
        experts.set_packed(PackedExperts(experts.w13.detach(), experts.w2.detach()))
    layers = [block.experts.packed for block in blocks if block.experts.packed is not None]
    if layers and layers[0].dense_w13.dtype == torch.float32:
        use_expert_matvec(layers)
    return len(blocks)


def use_expert_matvec(layers: list[PackedExperts]) -> int:
    """Send the experts' few-row multiplies through the C++ ``expert_matvec`` up to as many
    rows as it wins by on this machine (``kernels.moe.choose_matvec_rows``, timed here, and
    logged); nothing where the C++ kernels are unavailable. Returns that row count."""
    module = cpu_extension.load()
    if module is None:
        return 0
    most, timings = choose_matvec_rows(layers, module.expert_matvec, module.MATVEC_MAX_ROWS)
    for packed in layers:
        packed.use_matvec(module.expert_matvec, most)
    logger.info(
        "MoE experts: the C++ matvec up to %d rows (measured per pass, other / matvec: %s)",
        most, ", ".join(f"{r + 1}: {a * 1e3:.2f} / {b * 1e3:.2f} ms"
                        for r, (a, b) in enumerate(timings)),
    )  # fmt: skip
    return most


def check_redundant(num_redundant: int, num_experts: int, ep_size: int) -> None:
    """Refuse more spare slots per rank than experts the rank does not hold already."""
    most = num_experts - num_experts // ep_size
    if not 0 <= num_redundant <= most:
        raise ValueError(
            f"expert_redundant: {num_redundant} spare slots per rank, but with "
            f"expert_parallel {ep_size} a rank holds {num_experts // ep_size} of the "
            f"{num_experts} experts and can copy at most {most} others"
        )


def count_expert_tokens(expert_tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Add each routed pair to its expert's count, in place (a scatter: no host sync on
    CUDA, where ``bincount`` would wait for its size)."""
    ids = topk_ids.flatten()
    expert_tokens.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


def expert_load(model: nn.Module) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(layer, tokens per expert)`` of every MoE layer this rank runs, by layer: the
    pairs routed to each expert since the model was built (any module with an
    ``expert_tokens`` buffer and a ``layer_idx`` counts). One copy to the host."""
    blocks = sorted(
        ((m.layer_idx, m.expert_tokens) for m in model.modules() if hasattr(m, "expert_tokens")),
        key=lambda block: block[0],
    )
    if not blocks:
        return ()
    counts = torch.stack([tokens for _, tokens in blocks]).cpu().tolist()
    return tuple((layer, tuple(row)) for (layer, _), row in zip(blocks, counts, strict=True))


def make_moe_mlp(
    config: ArchConfig, layer_idx: int, parallel: ParallelContext, ops: KernelOps
) -> nn.Module:
    """Decoder layer ``layer_idx``'s MLP: the sparse block, or a dense MLP of
    ``intermediate_size`` where ``config.is_moe_layer`` says so (Qwen's
    ``decoder_sparse_step`` / ``mlp_only_layers``)."""
    if config.is_moe_layer(layer_idx):
        return SparseMoeBlock(config, parallel, ops, layer_idx=layer_idx)
    return LlamaMLP(config, parallel, ops)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped model whose layers' MLPs are ``make_moe_mlp``'s; the loader maps its
    expert tensors through ``expert_names``."""

    # (block, gate, up, down) of the architecture's checkpoints (ExpertNames).
    expert_layout: ClassVar[tuple[str, str, str, str]] = (
        "mlp",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    make_mlp = staticmethod(make_moe_mlp)

    def __init__(self, config: ArchConfig, parallel: ParallelContext, ops: KernelOps) -> None:
        super().__init__(config, parallel, ops)
        self.expert_names = ExpertNames(*self.expert_layout, num_experts=config.num_experts)
