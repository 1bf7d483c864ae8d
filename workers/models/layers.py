"""The layers the model files are built from: tensor-parallel linear and embedding layers
(Megatron-style sharding), and the replicated RMSNorm and rotary embedding.

Every parameter (until ``pack_linear_weights`` replaces it) carries
``weight_loader(param, loaded_weight, shard_id=None)``, which takes
the *full* checkpoint tensor, checks its shape (ValueError "expected ..., found ...") and
copies this rank's shard (converting dtype/device) into the parameter. The loaders touch
``loaded_weight`` only through ``shape``, ``narrow``, first-dimension slices and ``[:]``, so
that the checkpoint loader can pass a lazy ``CheckpointTensor`` and each rank reads only
its shard from the file. Fused parameters
take a ``shard_id`` naming the piece: "q"/"k"/"v" for ``qkv_proj``, 0/1 (gate/up) for
``gate_up_proj``. Collectives sit in ``forward`` where they happen; at tp_size 1 they are no-ops.

The linear layers and the LM head multiply through ``self.matmul``: ``F.linear``, or on CPU,
once the weights are loaded, oneDNN over a packed weight (``pack_linear_weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps, cpu_linear
from kernels.rotary import compute_cos_sin_cache
from workers.models.parallel import ParallelContext, divide


def _check_shape(loaded_weight: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(loaded_weight.shape) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, found {tuple(loaded_weight.shape)}")


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copy a replicated (unsharded) parameter whole."""
    _check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight[:])


LinearFn = Callable[..., torch.Tensor]  # F.linear's signature: (x, weight, bias=None)


def new_param(shape: Sequence[int], weight_loader) -> nn.Parameter:
    """An uninitialized, frozen parameter on the current default device/dtype."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by output rows: each rank computes a slice of ``y``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        parallel: ParallelContext,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, parallel.tp_size, "output size")
        self.gather_output = gather_output
        shape = (self.output_size_per_partition, input_size)
        self.weight = new_param(shape, self.weight_loader)
        self.bias = new_param(shape[:1], self.weight_loader) if bias else None
        self.matmul: LinearFn = F.linear

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        _check_shape(loaded_weight, (self.output_size, *param.shape[1:]))
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.parallel.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.weight, self.bias)  # [num_tokens, output_size / tp]
        if self.gather_output:
            out = self.parallel.all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate_up).

    Each rank's weight holds its slice of every piece, in order: [gate_r; up_r].
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool, parallel: ParallelContext
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, parallel.tp_size, "merged output size")
        super().__init__(input_size, sum(self.output_sizes), bias, parallel)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"bad shard_id {shard_id!r} for a merged linear")
        tp_size = self.parallel.tp_size
        _check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // tp_size
        size = self.output_sizes[shard_id] // tp_size
        shard = loaded_weight.narrow(0, self.parallel.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused, split by heads: [q_r; k_r; v_r] on each rank.

    When there are fewer KV heads than ranks, each rank holds one KV head and ranks
    ``tp_size // num_kv_heads`` apart share it (replicated).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        parallel: ParallelContext,
    ) -> None:
        tp_size = parallel.tp_size
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads, self.kv_shard_rank = parallel.kv_heads(total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, parallel)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            full, offset, size, rank = self.total_num_heads, 0, q_size, self.parallel.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            full, size, rank = self.total_num_kv_heads, kv_size, self.kv_shard_rank
        else:
            raise ValueError(f"bad shard_id {shard_id!r} for qkv_proj")
        _check_shape(loaded_weight, (full * self.head_dim, *param.shape[1:]))
        shard = loaded_weight.narrow(0, rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split by input columns: each rank takes its slice of ``x``
    (the output of a column-parallel layer) and the partial products are summed."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, parallel: ParallelContext
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.input_size_per_partition = divide(input_size, parallel.tp_size, "input size")
        self.weight = new_param((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = new_param((output_size,), default_weight_loader) if bias else None
        self.matmul: LinearFn = F.linear

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        _check_shape(loaded_weight, (param.shape[0], self.input_size))
        size = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.parallel.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.weight)  # [num_tokens, output_size], partial sum
        out = self.parallel.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias  # once, after the reduction
        return out


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous row ranges across ranks.

    Each rank embeds the ids in its range, zeros the others, and the results are summed.
    The last rank's range is zero-padded when the vocabulary does not divide evenly.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = min(parallel.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        shape = (self.num_embeddings_per_partition, embedding_dim)
        self.weight = new_param(shape, self.weight_loader)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        _check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        num_rows = self.vocab_end - self.vocab_start
        param.data[:num_rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * is_local
        out = F.embedding(local_ids, self.weight).masked_fill_(~is_local[:, None], 0)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (and tieable to it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext) -> None:
        super().__init__(num_embeddings, embedding_dim, parallel)
        self.matmul: LinearFn = F.linear

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden_size] -> [num_seqs, vocab_size] float32 (all ranks get all)."""
        logits = self.matmul(hidden_states, self.weight)  # [N, vocab_size / tp (padded)]
        logits = self.parallel.all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)


def _dense_linear_layers(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)
        and m.weight.is_floating_point()  # not an int4-packed weight (workers/models/quant)
        and not m.weight.is_mkldnn
    ]


def measure_linear_packing(model: nn.Module) -> cpu_linear.PackingChoice | None:
    """Time ``F.linear`` against oneDNN packing on the largest decoder-layer weight of
    ``model`` (the LM head only when it is the one dense layer left, as with int4
    layers: its size makes the timing slower); None when there is no dense layer."""
    dense = _dense_linear_layers(model)
    layers = [m for m in dense if not isinstance(m, ParallelLMHead)] or dense
    if not layers:
        return None
    largest = max(layers, key=lambda m: m.weight.numel())
    return cpu_linear.measure_packing(largest.weight.detach())


def pack_linear_weights(model: nn.Module) -> int:
    """Move every linear layer and LM head of ``model`` onto oneDNN with a packed weight.

    CPU only, after the weights are loaded (see ``kernels/cpu_linear.py``): each weight
    parameter is replaced by its packed form, which only the layer's ``matmul`` can read,
    so this costs no memory, except for an LM head tied to the embedding, which gets a
    packed copy (the embedding keeps the plain weight to look rows up in). Mutates the
    model; returns how many weights were packed.
    """
    layers = _dense_linear_layers(model)
    for layer in layers:
        packed = cpu_linear.pack(layer.weight.detach())
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.matmul = cpu_linear.linear
    return len(layers)


def pack_lm_head_bfloat16(model: nn.Module) -> bool:
    """Give a float32 model's LM head a bfloat16 oneDNN-packed weight (CPU; the caller
    checks ``cpu_linear.packing_supported(torch.bfloat16)``). For int4 models only: their
    linears already multiply bfloat16 activations, and at one row the float32 head is a
    quarter of the step (113 MB of the ~173 MB an int4 SmolLM2-135M reads per token). A tied head
    gets its own copy; the embedding keeps its weight. Mutates the model; False if the
    model has no float32 LM head on this rank."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, ParallelLMHead) or head.weight.dtype != torch.float32:
        return False
    head.weight = nn.Parameter(
        cpu_linear.pack(head.weight.detach().to(torch.bfloat16)), requires_grad=False
    )
    head.matmul = cpu_linear.linear_bf16
    return True


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally fused with the residual add before it."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = new_param((hidden_size,), default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE with a precomputed cos/sin table (built in the current default dtype/device)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None,
        ops: KernelOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        cache = compute_cos_sin_cache(
            head_dim, max_position, base, rope_scaling, torch.get_default_dtype()
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] at ``positions`` [T] -> rotated (q, k)."""
        return self.ops.apply_rotary(q, k, positions, self.cos_sin_cache)
