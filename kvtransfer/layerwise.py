"""Layer-wise KV hand-off: how many layers per transfer, chosen per request (pure).

Streaming a prompt's KV in layer groups as the prefill computes them makes TTFT
compute + the transfers that could not overlap it, instead of compute + the whole
transfer. Each transfer has a fixed cost (posting, descriptors, its notification), so
small groups pay it many times: on a fast link or a short prompt one transfer wins.

The model (the prefill rank's timeline of one request; chunked prefill included):
chunk ``k`` computes its layers one after the other, ``layer_s[k]`` seconds each; the
KV of its layer group ``g`` is ready when the group's last layer is done, and its
transfer starts then or when the link is free (one link, transfers in order), taking
``per_transfer_s + group_bytes / bandwidth``. The whole-request hand-off is one
transfer after the last chunk. Predicted TTFT is when the last transfer lands
(sampling and the first token's trip are the same either way and left out).

:func:`choose_layer_groups` keeps the whole-request hand-off unless layer groups
are predicted to save at least ``min_gain`` of it (and ``min_gain_s``): where the model
is off by a few percent, the simple path must not lose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerwiseCost:
    """What one request's hand-off costs, from measured numbers (seconds, bytes).

    ``layer_s``: compute time of one layer for each prefill chunk of the request (its
    tokens × the measured time per token and layer); one entry without chunking.
    ``layer_bytes``: KV bytes of one layer for each chunk's blocks (same length)."""

    num_layers: int
    layer_s: tuple[float, ...]
    layer_bytes: tuple[int, ...]
    bandwidth: float  # bytes per second of the link (measured: bytes / seconds of transfers)
    per_transfer_s: float  # fixed cost of one transfer: post, descriptors, its notification

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.layer_s or len(self.layer_s) != len(self.layer_bytes):
            raise ValueError("layer_s and layer_bytes need one entry per chunk")
        if min(self.layer_s) < 0 or min(self.layer_bytes) < 0:
            raise ValueError("layer_s and layer_bytes must be >= 0")
        if self.bandwidth <= 0 or self.per_transfer_s < 0:
            raise ValueError("bandwidth must be > 0 and per_transfer_s >= 0")

    @property
    def compute_s(self) -> float:
        return self.num_layers * sum(self.layer_s)

    @property
    def whole_transfer_s(self) -> float:
        return self.per_transfer_s + self.num_layers * sum(self.layer_bytes) / self.bandwidth


@dataclass(frozen=True)
class LayerwisePlan:
    """The choice for one request: ``group_size`` layers per transfer, or None (one
    whole-request transfer), with the predicted TTFT of both (seconds)."""

    group_size: int | None
    predicted_s: float  # of the chosen option
    whole_s: float  # of the whole-request hand-off
    layerwise_s: float  # of the best group size (== whole_s when none helps)
    best_group_size: int  # the group size that gave layerwise_s

    @property
    def gain(self) -> float:
        """Fraction of the whole-request TTFT the chosen option saves."""
        return 1.0 - self.predicted_s / self.whole_s if self.whole_s > 0 else 0.0


def layer_groups(num_layers: int, group_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each group of ``group_size`` layers; the last may be smaller."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]


def predict_ttft(cost: LayerwiseCost, group_size: int | None) -> float:
    """When the last transfer lands, from the start of the request's prefill (seconds).

    ``None``: one transfer of every chunk's blocks after the last chunk."""
    if group_size is None:
        return cost.compute_s + cost.whole_transfer_s
    now = 0.0  # compute clock
    link_free = 0.0
    for layer_s, layer_bytes in zip(cost.layer_s, cost.layer_bytes, strict=True):
        for start, end in layer_groups(cost.num_layers, group_size):
            now += (end - start) * layer_s
            if layer_bytes == 0:
                continue  # a chunk that completes no block sends nothing
            duration = cost.per_transfer_s + (end - start) * layer_bytes / cost.bandwidth
            link_free = max(now, link_free) + duration
    return max(now, link_free)


def choose_layer_groups(
    cost: LayerwiseCost,
    *,
    min_gain: float = 0.05,
    min_gain_s: float = 0.0,
    candidates: tuple[int, ...] | None = None,
) -> LayerwisePlan:
    """The group size that minimises predicted TTFT, or None (whole-request) when the
    best saves less than ``min_gain`` of the whole-request TTFT or ``min_gain_s``.

    ``candidates``: group sizes to try (default every size from 1 to ``num_layers - 1``;
    ``num_layers`` itself is the whole request, per chunk). Ties go to the larger group
    (fewer transfers, fewer notifications)."""
    whole = predict_ttft(cost, None)
    sizes = candidates or tuple(range(1, cost.num_layers))
    best_s, best_size = whole, cost.num_layers
    for size in sorted(set(sizes), reverse=True):
        if not 1 <= size <= cost.num_layers:
            raise ValueError(f"group size {size} outside 1..{cost.num_layers}")
        predicted = predict_ttft(cost, size)
        if predicted < best_s - 1e-12:
            best_s, best_size = predicted, size
    saved = whole - best_s
    if saved <= 0 or saved < min_gain * whole or saved < min_gain_s:
        return LayerwisePlan(None, whole, whole, best_s, best_size)
    return LayerwisePlan(best_size, best_s, whole, best_s, best_size)


def chunk_costs(
    chunk_lens: tuple[int, ...], block_size: int, layer_s_per_token: float, block_layer_bytes: int
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(layer_s, layer_bytes) per chunk of a prompt prefilled in ``chunk_lens`` tokens:
    a chunk sends the blocks it completes (the last chunk: the rest, partial block
    included), as :class:`~workers.engine.layerwise.LayerwiseStream` does."""
    layer_s, layer_bytes = [], []
    done, sent = 0, 0
    for i, n in enumerate(chunk_lens):
        done += n
        upto = -(-done // block_size) if i == len(chunk_lens) - 1 else done // block_size
        layer_s.append(n * layer_s_per_token)
        layer_bytes.append((upto - sent) * block_layer_bytes)
        sent = upto
    return tuple(layer_s), tuple(layer_bytes)
