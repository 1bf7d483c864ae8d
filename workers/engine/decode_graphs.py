"""Decode-only steps replayed from captured graphs, one per batch-size bucket (CUDA).

An eager decode step launches every kernel of every layer from Python: hundreds of
launches whose host cost, at small batches, is most of the step (the first GPU run:
bench/RESULTS.md "The first GPU run", a decode step at 19-27% of its roofline). vLLM,
SGLang and TensorRT-LLM capture decode once per batch size and replay it; so do we.

What a captured step may read is fixed at capture: the model's weights, the KV cache and
the static input buffers here (token ids, positions, slots, block tables, context
lengths). Each step copies its inputs into those buffers, pads the batch up to the next
bucket, and replays. The padding rows write no K/V (slot -1: every ``store_kv`` skips a
negative slot) and attend to one token of block 0 (read only); their logits are dropped.
The attention launches are sized at capture for ``max_model_len`` (the host ints of the
metadata are the bucket's), and the kernels bound each row by its own device-side
length, so a replay is correct at every context that fits.

Only the steps that qualify replay (``takes``): decode-only, every row sampled, no prompt
logprobs, no layer-wise hook, at most the largest bucket. Everything else, and every
step where capture failed (a kernel that syncs with the host, a MoE layer's data-dependent
shapes; logged once at start-up), runs eager. One rank only: a replica of several ranks
would have to replay in lockstep (not built).

``capture`` is the one seam: on CUDA :func:`cuda_capture` (``torch.cuda.CUDAGraph`` in a
shared memory pool); the CPU tests pass a capture that replays by calling the function
again over the same buffers, which checks everything here but the driver's recording.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from workers.engine.step_inputs import StepInputs
from workers.models.base import CausalLM

logger = logging.getLogger(__name__)

# fn() -> logits, run once under capture; returns replay() -> the same logits tensor.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_batch_sizes(max_num_seqs: int, limit: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, 8, then every multiple of 8, up to ``min(max_num_seqs,
    limit)`` (which is a bucket itself): a step pads to at most 7 rows more (vLLM's
    default sizes have the same shape)."""
    top = min(max_num_seqs, limit)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(s for s in sizes if s >= 1))


def cuda_capture(device: torch.device) -> Capture:
    """Capture on ``device``'s CUDA graphs, every bucket in one memory pool (a replay
    runs alone, so the buckets' activations can share memory)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


@dataclass(frozen=True)
class _Buffers:
    """The static inputs of every bucket: bucket ``b`` reads the first ``b`` rows."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: 0..max_bs, one query token each


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        sizes: Sequence[int],
        device: torch.device,
        capture: Capture,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.sizes = tuple(sorted(sizes))
        self.device = device
        self._capture = capture
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.buffers = _Buffers(
            input_ids=zeros(max_bs, dtype=torch.int64),
            positions=zeros(max_bs, dtype=torch.int64),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            block_tables=zeros(max_bs, max_blocks, dtype=torch.int32),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
        )
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_s = 0.0
        self.num_replays = 0

    # ---- start-up -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> bool:
        """Capture every bucket, largest first; False (and nothing captured) when a bucket
        fails, with the reason logged: the engine then runs every step eager."""
        t0 = time.perf_counter()
        try:
            for size in reversed(self.sizes):
                step = self._step_fn(size)
                step()  # warm-up outside capture: Triton compiles and autotunes here
                self._replays[size] = self._capture(step)
        except Exception as exc:  # any failure means eager: the graphs are an optimisation
            self._replays.clear()
            logger.warning("decode graphs off, every step eager: capture failed (%s)", exc)
            return False
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "decode graphs: %d batch sizes (%s) captured in %.1f s",
            len(self.sizes), ",".join(map(str, self.sizes)), self.capture_s,
        )  # fmt: skip
        return True

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        buf = self.buffers
        metadata = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:size],
            block_tables=buf.block_tables[:size],
            seq_lens=buf.seq_lens[:size],
            query_start_loc=buf.query_start_loc[: size + 1],
            num_decodes=size,
            max_query_len=1,
            # Launches sized for the longest context; each row stops at its own length.
            max_seq_len=self.max_model_len,
            seq_lens_cpu=(self.max_model_len,) * size,
            query_lens_cpu=(1,) * size,
        )
        model, kv_cache = self.model, self.kv_cache

        def step() -> torch.Tensor:
            hidden = model.forward(buf.input_ids[:size], buf.positions[:size], kv_cache, metadata)
            return model.compute_logits(hidden)

        return step

    # ---- each step ------------------------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        return bool(self._replays)

    def takes(self, inputs: StepInputs) -> bool:
        """Whether ``inputs`` replays: decode-only, each row sampled once in order, no
        prompt-logprob rows, a captured bucket large enough."""
        n = inputs.num_decodes
        return (
            bool(self._replays)
            and n == len(inputs.seq_lens)
            and 0 < n <= self.sizes[-1]
            and not inputs.prompt_logprob_indices
            and inputs.sample_indices == tuple(range(n))
            and inputs.block_tables.shape[1] <= self.buffers.block_tables.shape[1]
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits ``[num_decodes, vocab]``: a view of the bucket's output,
        valid until the next replay (the engine samples before it runs another step)."""
        n = inputs.num_decodes
        size = next(s for s in self.sizes if s >= n)
        self._fill(inputs, n, size)
        self.num_replays += 1
        return self._replays[size]()[:n]

    def _fill(self, inputs: StepInputs, n: int, size: int) -> None:
        """The step's inputs into the static buffers, rows ``n..size`` as padding: token 0
        at position 0, no K/V written, one token of context."""
        buf = self.buffers
        pad = size - n
        ids = np.concatenate([inputs.input_ids, np.zeros(pad, dtype=np.int64)])
        positions = np.concatenate([inputs.positions, np.zeros(pad, dtype=np.int64)])
        slots = np.concatenate([inputs.slot_mapping, np.full(pad, -1, dtype=np.int64)])
        seq_lens = np.asarray(inputs.seq_lens + (1,) * pad, dtype=np.int32)
        tables = inputs.block_tables
        width = tables.shape[1]
        blocks = np.zeros((size, width), dtype=np.int32)  # padding rows read block 0
        blocks[:n] = tables
        # Columns past ``width`` keep an earlier step's ids: never read, since a row reads
        # only the blocks its length covers.
        copy = self._copy
        copy(buf.input_ids[:size], ids)
        copy(buf.positions[:size], positions)
        copy(buf.slot_mapping[:size], slots)
        copy(buf.seq_lens[:size], seq_lens)
        copy(buf.block_tables[:size, :width], blocks)

    def _copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        # Ordered on the stream before the replay's kernels, as every input copy is.
        dst.copy_(torch.from_numpy(src), non_blocking=dst.device.type != "cpu")


def reads_lengths_on_device(model: CausalLM) -> bool:
    """Whether every op set in ``model`` is the Triton one (``KernelOps.is_triton``)."""
    sets = [m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), KernelOps)]
    return bool(sets) and all(ops.is_triton for ops in sets)


def build_decode_graphs(
    model: CausalLM,
    kv_cache: torch.Tensor,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    limit: int,
    device: torch.device,
    capture: Capture | None = None,
) -> DecodeGraphs | None:
    """Captured decode graphs for the engine, or None where they do not apply (not CUDA
    unless a ``capture`` is given; ``limit`` 0: off). Capture failures leave None too."""
    if limit <= 0 or (capture is None and device.type != "cuda"):
        return None
    if not reads_lengths_on_device(model):
        # The references size their loops from the host-side lengths, which a replay
        # would freeze at capture: only the Triton set's kernels read them from tensors.
        logger.info("decode graphs off: the model's op set is not the Triton one")
        return None
    if capture is None:
        capture = cuda_capture(device)
    sizes = graph_batch_sizes(max_num_seqs, limit)
    graphs = DecodeGraphs(model, kv_cache, block_size, max_model_len, sizes, device, capture)
    return graphs if graphs.capture_all() else None
