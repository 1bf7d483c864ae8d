"""Description of one worker's (one tensor-parallel rank's) paged KV cache.

The worker's cache is one tensor (docs/kv-cache-layout.md)::

    [num_blocks, num_layers, num_kv_entries, num_kv_heads_local, block_size, head_dim]

``num_kv_entries`` is 2 (K and V) for every model but those with multi-head latent
attention (DeepSeek-V2/V3, docs/mla.md), which cache one latent row per token and layer:
1 entry of 1 "head" whose ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim``. That head is
replicated on every tensor-parallel rank (``kv_head_range`` with one head), so any prefill
rank can serve a decode rank the whole block.

kvtransfer never sees the worker's objects: the worker builds a :class:`KVLayout`
from its tensor (:meth:`KVLayout.from_tensor`) and everything here works on that
description (addresses, strides, byte offsets). Inside one block, the region of one
layer, K or V, one kv head is contiguous (``block_size * head_dim`` elements), which
is what lets a decode rank with another tensor-parallel size pull just its heads.

An FP8 cache (``kv_cache_dtype: fp8_e4m3``) is a ``uint8`` tensor of packed rows: each
token row of a head holds ``head_dim`` float8_e4m3fn values and their float32 scale
(``kernels/fp8_kv.py``). Its layout says ``dtype="float8_e4m3fn"``,
``scale_layout="per_token_head_f32"`` and the *logical* ``head_dim``; the scales sit inside
each head's contiguous region, so they travel with the blocks and head slicing is unchanged.

Two workers may exchange KV when :func:`check_compatible` passes: same model, KV dtype,
scale layout, model layers, entries (K/V or latent), head count, head dim and block size.
Tensor-parallel sizes and pipeline stages may differ (``tp_mapping`` maps heads and
layers); devices may differ (the transport copies).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvtransfer.errors import LayoutMismatchError

_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

# How a row's scales are stored: none, or one float32 after each token row's values.
# One float32 scale after each packed FP8 token row: kernels/fp8_kv.py's SCALE_BYTES, not
# imported from there because kernels/ loads torch and the router's bring-up reads layouts
# (tests/kvtransfer/test_fp8_layout.py holds the two equal).
SCALE_BYTES = 4
_SCALE_ROW_BYTES = {"none": 0, "per_token_head_f32": SCALE_BYTES}

# Fields that must be equal for two caches to exchange KV; they make the fingerprint.
COMPAT_FIELDS = (
    "model_id",
    "dtype",
    "scale_layout",
    "total_num_layers",
    "num_kv_entries",
    "num_kv_heads",
    "head_dim",
    "block_size",
)


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Global kv heads ``[start, end)`` held by ``tp_rank`` of ``tp_size``.

    With at least as many heads as ranks the heads are split evenly; with fewer,
    each rank holds one head and ``tp_size // num_kv_heads`` consecutive ranks hold
    the same one (replicated, as Megatron/vLLM do for GQA with large TP).
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide num_kv_heads {num_kv_heads}")
        per_rank = num_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads {num_kv_heads} does not divide tp_size {tp_size}")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """Model layers ``[start, end)`` of pipeline ``stage`` of ``num_stages``.

    Contiguous ranges, as even as possible; the first ``num_layers % num_stages`` stages
    take one layer more. The last stage (which adds the final norm, the LM head and, on
    rank 0, the scheduler and the sampler) is never the one with the extra layer, unless
    every stage has one.
    """
    if num_stages <= 0 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} pipeline stages")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


@dataclass(frozen=True)
class KVLayout:
    """Where one rank's KV lives and how it is laid out (bytes, not tensors).

    ``block_stride`` is the distance in bytes between block ``i`` and ``i + 1``;
    a block's ``block_bytes`` are contiguous from ``base_addr + i * block_stride``.

    A dataclass (``dataclasses.replace`` derives layouts): inside a
    :class:`~kvtransfer.messages.HandshakeMetadata` msgspec encodes it as a map of its
    fields and decodes it typed, through ``__post_init__`` (its checks).
    """

    model_id: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    num_layers: int  # layers held by this rank (a pipeline stage holds a range)
    num_kv_heads: int  # the model's total kv heads
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    base_addr: int
    block_stride: int
    device: str = "cpu"  # "cpu" or "cuda:N"
    first_layer: int = 0  # index of this rank's first layer (pipeline stages)
    tp_rank: int = 0
    tp_size: int = 1
    total_num_layers: int = 0  # the model's layers; 0: this rank holds them all
    scale_layout: str = "none"  # "per_token_head_f32": FP8 rows with their scale (module doc)
    num_kv_entries: int = 2  # 2: K and V; 1: one latent row per token (MLA, module doc)

    def __post_init__(self) -> None:
        if self.total_num_layers == 0:
            object.__setattr__(self, "total_num_layers", self.first_layer + self.num_layers)
        self._validate()

    def _validate(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.scale_layout not in _SCALE_ROW_BYTES:
            raise ValueError(f"unsupported scale_layout {self.scale_layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_entries not in (1, 2):
            raise ValueError(
                f"num_kv_entries must be 1 (latent) or 2 (K, V), got {self.num_kv_entries}"
            )
        if self.num_kv_entries == 1 and self.num_kv_heads != 1:
            # The round-robin hand-off reads any block from any rank: the row must be whole.
            raise ValueError(f"a latent cache has 1 kv head, got {self.num_kv_heads}")
        if self.first_layer < 0 or self.first_layer + self.num_layers > self.total_num_layers:
            raise ValueError(
                f"layers [{self.first_layer}, {self.first_layer + self.num_layers}) are not "
                f"within the model's {self.total_num_layers}"
            )
        kv_head_range(self.num_kv_heads, self.tp_rank, self.tp_size)  # validates the slice
        if self.block_stride < self.block_bytes:
            raise ValueError(
                f"block_stride {self.block_stride} is smaller than a block ({self.block_bytes} B)"
            )

    # ---- derived geometry ------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def head_range(self) -> tuple[int, int]:
        """Global kv heads ``[start, end)`` this rank holds."""
        return kv_head_range(self.num_kv_heads, self.tp_rank, self.tp_size)

    @property
    def num_kv_heads_local(self) -> int:
        start, end = self.head_range
        return end - start

    @property
    def layer_range(self) -> tuple[int, int]:
        """Model layers ``[start, end)`` this rank holds (its pipeline stage's)."""
        return self.first_layer, self.first_layer + self.num_layers

    @property
    def is_latent(self) -> bool:
        """One latent row per token and layer (MLA), the same on every TP rank."""
        return self.num_kv_entries == 1

    @property
    def row_bytes(self) -> int:
        """One token of one kv head, layer, K or V: its values and, for FP8, their scale."""
        return self.head_dim * self.itemsize + _SCALE_ROW_BYTES[self.scale_layout]

    @property
    def head_bytes(self) -> int:
        """One kv head of one block, one layer, K or V: contiguous."""
        return self.block_size * self.row_bytes

    @property
    def layer_bytes(self) -> int:
        """One layer of one block, every entry and head this rank holds: contiguous."""
        return self.num_kv_entries * self.num_kv_heads_local * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        """What one token's KV costs this rank (and moves in a hand-off to it): for MLA
        ``(kv_lora_rank + qk_rope_head_dim) x element size x layers``."""
        return self.block_bytes // self.block_size

    @property
    def num_bytes(self) -> int:
        """Bytes from ``base_addr`` to the end of the last block (what is registered)."""
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def device_id(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def region_offset(self, layer: int, kv: int, head: int) -> int:
        """Byte offset inside a block of (*model* ``layer``, ``kv`` 0=K/1=V or 0=latent,
        *global* ``head``)."""
        start, end = self.head_range
        local = layer - self.first_layer
        if not (
            0 <= local < self.num_layers and 0 <= kv < self.num_kv_entries and start <= head < end
        ):
            raise ValueError(f"region (layer {layer}, {kv}, head {head}) not held by this rank")
        entry = local * self.num_kv_entries + kv
        return (entry * self.num_kv_heads_local + head - start) * self.head_bytes

    def block_addr(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self.base_addr + block_id * self.block_stride

    # ---- identity ---------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Hex digest of the fields peers must agree on (not addresses, slices or device)."""
        text = "|".join(f"{name}={getattr(self, name)}" for name in COMPAT_FIELDS)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    @classmethod
    def from_tensor(
        cls,
        kv_cache,
        *,
        model_id: str,
        num_kv_heads: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        first_layer: int = 0,
        total_num_layers: int = 0,
    ) -> KVLayout:
        """Describe the worker's cache tensor ``[blocks, layers, entries, heads_local, bs, dim]``.

        ``entries`` is 2 (K, V) or 1 (the MLA latent row); ``num_kv_heads`` is the cache's
        total kv heads (``ArchConfig.kv_cache_heads``: 1 for MLA, replicated on every rank).
        A pipeline stage's tensor holds its layers only: model layers ``first_layer`` on,
        of ``total_num_layers`` (0: the tensor holds every layer).

        Each block must be contiguous inside (the blocks themselves may be strided).
        Called by the worker; kvtransfer never imports the worker's code.
        """
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            raise ValueError(
                f"expected [num_blocks, num_layers, 2 (K, V) or 1 (latent), num_kv_heads, "
                f"block_size, head_dim], got {tuple(kv_cache.shape)}"
            )
        num_blocks, num_layers, num_kv_entries, heads_local, block_size, head_dim = kv_cache.shape
        if not kv_cache[0].is_contiguous():
            raise ValueError("each block of the KV cache must be contiguous")
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        scale_layout = "none"
        if dtype == "uint8":  # the worker's packed FP8 cache (kernels/fp8_kv.py)
            dtype, scale_layout = "float8_e4m3fn", "per_token_head_f32"
            head_dim -= SCALE_BYTES
        layout = cls(
            model_id=model_id,
            dtype=dtype,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
            base_addr=kv_cache.data_ptr(),
            block_stride=kv_cache.stride(0) * kv_cache.element_size(),
            device=str(kv_cache.device),
            first_layer=first_layer,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_layers=total_num_layers,
            scale_layout=scale_layout,
            num_kv_entries=num_kv_entries,
        )
        if layout.num_kv_heads_local != heads_local:
            raise ValueError(
                f"tensor holds {heads_local} kv heads but rank {tp_rank} of {tp_size} "
                f"should hold {layout.num_kv_heads_local} of {num_kv_heads}"
            )
        return layout


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise :class:`LayoutMismatchError` naming every field that differs.

    Called on both sides at handshake. Tensor-parallel slices, pipeline stages (which
    layers a rank holds) and devices may differ.
    """
    diffs = [
        f"{name}: local {getattr(local, name)!r} != remote {getattr(remote, name)!r}"
        for name in COMPAT_FIELDS
        if getattr(local, name) != getattr(remote, name)
    ]
    if diffs:
        # The KV dtypes lead the message, named for both sides even when they agree: a
        # prefill/decode pair configured with different kv_cache_dtype is the common case.
        kv_dtypes = f"KV cache local {_kv_dtype(local)}, remote {_kv_dtype(remote)}"
        raise LayoutMismatchError(f"incompatible KV layouts ({kv_dtypes}): " + "; ".join(diffs))


def _kv_dtype(layout: KVLayout) -> str:
    if layout.scale_layout == "none":
        return layout.dtype
    return f"{layout.dtype} with {layout.scale_layout} scales"
