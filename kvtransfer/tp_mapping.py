"""Heterogeneous layouts: which bytes of which prefill rank a decode rank needs.

A prefill worker with TP=p and a decode worker with TP=d both split the model's kv
heads across their ranks (``layout.kv_head_range``). A decode rank needs exactly the
heads it holds; each of them lives on one prefill rank (or on several, when heads are
replicated because there are fewer heads than ranks: then one replica is chosen,
spreading decode ranks over the replicas).

With pipeline parallelism each rank also holds only its stage's layers
(``layout.layer_range``). A decode rank takes, from each prefill rank, the heads chosen
above *for the layers both hold*: every (layer, head) it holds comes from exactly one
prefill rank, since a layer lives in one stage on each side.

Inside one block the region of (layer, K/V, head) is contiguous on both sides, so a
copy between two ranks is a short list of :class:`Segment` byte ranges relative to the
start of a block, the same for every block. When both ranks hold the same heads and
layers the list is a single segment: the whole block. Pure functions, no I/O.

A latent cache (MLA: one replicated "head", ``KVLayout.is_latent``) is whole on every
prefill rank. A decode rank then takes each block once, from one prefill rank of the
stage, chosen round robin by block position (:func:`latent_block_sources`), so a request's
reads are spread over the prefill ranks instead of all landing on one; every decode rank
reads (or declines) a part from every prefill rank of the stages it overlaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.layout import KVLayout, kv_head_range, layer_range


@dataclass(frozen=True)
class Segment:
    """Copy ``length`` bytes from ``src_offset`` (in a source block) to ``dst_offset``."""

    src_offset: int
    dst_offset: int
    length: int


def source_heads(
    num_kv_heads: int, src_tp_size: int, dst_tp_rank: int, dst_tp_size: int
) -> dict[int, tuple[int, ...]]:
    """For one decode rank: ``{prefill rank: global heads to take from it}``.

    Every head the decode rank holds appears exactly once. Deterministic, so the
    prefill side (push) and the decode side (pull) compute the same answer.
    """
    dst_start, dst_end = kv_head_range(num_kv_heads, dst_tp_rank, dst_tp_size)
    owners = [kv_head_range(num_kv_heads, r, src_tp_size) for r in range(src_tp_size)]
    plan: dict[int, list[int]] = {}
    for head in range(dst_start, dst_end):
        holders = [r for r, (start, end) in enumerate(owners) if start <= head < end]
        src_rank = holders[dst_tp_rank % len(holders)]
        plan.setdefault(src_rank, []).append(head)
    return {rank: tuple(heads) for rank, heads in sorted(plan.items())}


def num_readers(
    num_kv_heads: int,
    src_tp_rank: int,
    src_tp_size: int,
    dst_tp_size: int,
    *,
    src_layers: tuple[int, int] | None = None,
    total_num_layers: int = 0,
    dst_pp_size: int = 1,
    is_latent: bool = False,
) -> int:
    """How many decode ranks read from prefill rank ``src_tp_rank`` (0: none needs it).

    A latent cache (``is_latent``): every decode rank of the overlapping stages sends one
    notice (its round-robin share read, or "skipped" when its share is empty).

    With pipeline stages on either side: ``src_layers`` are the prefill rank's layers
    ``[start, end)`` of the model's ``total_num_layers`` (None: all of them), and the
    decode worker splits them over ``dst_pp_size`` stages; only the decode stages whose
    layers overlap the prefill rank's read from it.
    """
    if is_latent:  # every decode rank reads a share of the blocks, or declines (module doc)
        per_stage = dst_tp_size
    else:
        per_stage = sum(
            src_tp_rank in source_heads(num_kv_heads, src_tp_size, dst_rank, dst_tp_size)
            for dst_rank in range(dst_tp_size)
        )
    if dst_pp_size == 1 or src_layers is None:
        return per_stage * dst_pp_size
    overlapping = sum(
        _overlap(src_layers, layer_range(total_num_layers, stage, dst_pp_size)) is not None
        for stage in range(dst_pp_size)
    )
    return per_stage * overlapping


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def plan_segments(src: KVLayout, dst: KVLayout, heads: Sequence[int]) -> tuple[Segment, ...]:
    """Byte ranges (per block) that carry ``heads`` of the layers both hold, K and V (or the
    latent row), from src to dst (model layers, whichever pipeline stage holds them on each
    side).

    Adjacent ranges are merged, so equal head and layer slices give one whole-block
    segment.
    """
    if (
        src.total_num_layers != dst.total_num_layers
        or src.head_bytes != dst.head_bytes
        or src.num_kv_entries != dst.num_kv_entries
    ):
        raise ValueError("layouts differ in layers, entries or head size; check_compatible first")
    layers = _overlap(src.layer_range, dst.layer_range)
    if layers is None:
        return ()
    segments: list[Segment] = []
    for layer in range(*layers):
        for kv in range(src.num_kv_entries):  # K and V, or the one latent row
            for head in heads:
                src_offset = src.region_offset(layer, kv, head)
                dst_offset = dst.region_offset(layer, kv, head)
                last = segments[-1] if segments else None
                if (
                    last is not None
                    and last.src_offset + last.length == src_offset
                    and last.dst_offset + last.length == dst_offset
                ):
                    segments[-1] = Segment(
                        last.src_offset, last.dst_offset, last.length + src.head_bytes
                    )
                else:
                    segments.append(Segment(src_offset, dst_offset, src.head_bytes))
    return tuple(segments)


def plan_for_pair(src: KVLayout, dst: KVLayout) -> tuple[Segment, ...]:
    """Segments that the pair (prefill rank ``src``, decode rank ``dst``) exchanges.

    Empty when the decode rank takes nothing from this prefill rank (none of the heads
    it takes from that rank's TP position, or no layer in common).
    """
    heads = source_heads(src.num_kv_heads, src.tp_size, dst.tp_rank, dst.tp_size)
    return plan_segments(src, dst, heads.get(src.tp_rank, ()))


def replica_segments(src: KVLayout, dst: KVLayout) -> tuple[Segment, ...]:
    """What a pair can move whatever :func:`source_heads` chose: for a latent cache the
    whole rows of the layers both hold (any prefill rank may serve any block); for K/V
    caches the pair's plan (:func:`plan_for_pair`)."""
    if src.is_latent and dst.is_latent:
        return plan_segments(src, dst, (0,))
    return plan_for_pair(src, dst)


def latent_block_sources(
    first_block: int, num_blocks: int, src_tp_ranks: Sequence[int], dst_tp_rank: int
) -> dict[int, tuple[int, ...]]:
    """Latent cache, one decode rank and one prefill stage: ``{prefill rank: positions}``.

    Positions ``0 .. num_blocks - 1`` of the blocks received (the request's blocks from
    ``first_block`` on) go round robin over ``src_tp_ranks`` (the stage's prefill ranks),
    offset by ``dst_tp_rank`` so that decode ranks start on different prefill ranks: block
    ``first_block + i`` comes from ``ranks[(first_block + i + dst_tp_rank) % len(ranks)]``.
    Every rank is a key; an empty tuple means this decode rank reads nothing from it.
    """
    ranks = sorted(src_tp_ranks)
    plan: dict[int, list[int]] = {rank: [] for rank in ranks}
    for i in range(num_blocks):
        plan[ranks[(first_block + i + dst_tp_rank) % len(ranks)]].append(i)
    return {rank: tuple(positions) for rank, positions in plan.items()}


def segments_for_layers(
    segments: Sequence[Segment], src: KVLayout, layers: tuple[int, int]
) -> tuple[Segment, ...]:
    """The parts of ``segments`` (a pair's plan, offsets in ``src`` = the data's source)
    that carry model layers ``[start, end)``: a layer group's bytes of each block.

    A source block holds its layers one after the other (``[layer, K/V, head, ...]``), so
    a layer range is one byte range of it, and a segment maps bytes linearly: cutting it
    to that range keeps the destination in step. Layers the source does not hold give
    nothing."""
    held = _overlap(src.layer_range, layers)
    if held is None:
        return ()
    layer_bytes = src.layer_bytes
    lo = (held[0] - src.first_layer) * layer_bytes
    hi = (held[1] - src.first_layer) * layer_bytes
    out = []
    for seg in segments:
        cut = _overlap((seg.src_offset, seg.src_offset + seg.length), (lo, hi))
        if cut is not None:
            shift = cut[0] - seg.src_offset
            out.append(Segment(cut[0], seg.dst_offset + shift, cut[1] - cut[0]))
    return tuple(out)


def count_merged_descriptors(
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    segments: Sequence[Segment],
    src_stride: int,
    dst_stride: int,
) -> int:
    """Descriptors left after merging ranges adjacent in memory on both sides.

    This is what a prepared transfer built from (block, segment) indices turns into:
    runs of consecutive block ids with whole-block segments collapse to one.
    """
    if len(segments) != 1:
        # Segments of one block are separated by gaps on at least one side (else
        # plan_segments merged them), and then no range can touch the next block's
        # first range either: every (block, segment) pair is its own descriptor.
        return len(src_block_ids) * len(segments)
    count = 0
    prev_src = prev_dst = None  # end addresses (relative) of the previous range
    for src_block, dst_block in zip(src_block_ids, dst_block_ids, strict=True):
        for seg in segments:
            src_addr = src_block * src_stride + seg.src_offset
            dst_addr = dst_block * dst_stride + seg.dst_offset
            if src_addr != prev_src or dst_addr != prev_dst:
                count += 1
            prev_src, prev_dst = src_addr + seg.length, dst_addr + seg.length
    return count
