"""The layer-wise hand-off's timeline without a model (``bench/layerwise.py --timeline``).

The prefill's forward pass is replaced by its per-layer delay (``--us-per-token-layer``
µs per token of the chunk, slept: no CPU, so other work on the machine hardly moves
it); everything else is what an engine does: ``LayerwiseStreams`` decides which blocks
and layers go out after each layer of each chunk, the connectors move real bytes
between two caches of the bench model's shape over the in-process backend with the
injected bandwidth cap and fixed cost per transfer, and the whole-request path offers
and pulls as a worker does today.
"""

from __future__ import annotations

import time
from functools import partial
from types import SimpleNamespace

import torch

from kvtransfer import KVConnector, KVLayout, KVTransferConfig
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for
from workers.engine.layerwise import LayerwiseStreams
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput

NUM_BLOCKS = 1100


def connector(cache: torch.Tensor, fabric: LocalFabric, name: str, on_release) -> KVConnector:
    layout = KVLayout.from_tensor(cache, model_id="bench", num_kv_heads=2)
    config = KVTransferConfig(backend="local", direction="pull", transfer_timeout_s=60,
                              lease_seconds=120, active_poll_s=0.0001)  # fmt: skip
    backend = LocalBackend(agent_name_for(name, "1"), cache, layout, fabric)
    return KVConnector(backend, layout, config, name, "1", on_release)


class TimelinePair:
    """A prefill and a decode rank of ``layers`` layers, ``block_size``-token blocks of
    2 kv heads of 16 float32 values, prefilling in chunks of ``budget`` tokens."""

    def __init__(self, fabric: LocalFabric, us: float, layers: int, block_size: int, budget: int):
        shape = (NUM_BLOCKS, layers, 2, 2, block_size, 16)
        self.p_cache, self.d_cache = torch.randn(shape), torch.zeros(shape)
        self.layers, self.block_size, self.budget = layers, block_size, budget
        self.seconds_per_token = us * 1e-6
        self.released: list[str] = []
        self.p_conn = connector(self.p_cache, fabric, "p", lambda r, why: self.released.append(r))
        self.d_conn = connector(self.d_cache, fabric, "d", lambda r, why: None)
        self.p_conn.add_peer(self.d_conn.metadata())
        self.d_conn.add_peer(self.p_conn.metadata())
        self.streams = LayerwiseStreams(block_size, 0, layers)

    def _blocks(self, length: int) -> tuple[list[int], list[int]]:
        n = -(-length // self.block_size)
        return list(range(n)), list(range(NUM_BLOCKS - n, NUM_BLOCKS))  # P's, D's

    def _prefill(self, rid: str, length: int, t0: float) -> list[float]:
        """Each chunk's layers in turn (sleeping), the per-layer hook after each."""
        src, _ = self._blocks(length)
        req = SimpleNamespace(num_prompt_tokens=length)
        ends = []
        for start in range(0, length, self.budget):
            n = min(self.budget, length - start)
            chunk = ScheduledChunk(rid, start, n, tuple(src), start + n >= length)
            hook = self.streams.hook_for(SchedulerOutput((chunk,), (), ()), [req])
            for layer in range(self.layers):
                time.sleep(n * self.seconds_per_token)
                if hook is not None:
                    hook(layer)
            ends.append(time.perf_counter())
        return [b - a for a, b in zip([t0, *ends], ends, strict=False)]

    def whole(self, rid: str, prompt: list[int]) -> dict:
        src, dst = self._blocks(len(prompt))
        self.d_cache[dst] = 0
        t0 = time.perf_counter()
        chunks_s = self._prefill(rid, len(prompt), t0)
        handle = self.p_conn.offer(rid, src, num_tokens=len(prompt), first_token_id=0)
        result = self.d_conn.receive([handle], dst).result(60)
        ttft = time.perf_counter() - t0
        while rid not in self.released:
            self.p_conn.sync()
        assert torch.equal(self.d_cache[dst], self.p_cache[src])
        return {"ttft_s": ttft, "chunks_s": chunks_s, "first": 0,
                "bytes": result.num_bytes, "transfer_s": result.seconds}  # fmt: skip

    def layerwise(self, rid: str, prompt: list[int], first: int, group_size: int) -> dict:
        src, dst = self._blocks(len(prompt))
        self.d_cache[dst] = 0
        reservation, future = self.d_conn.expect_stream(rid, dst, [self.p_conn.agent_name])
        t0 = time.perf_counter()
        sent = self.p_conn.open_stream(rid, [reservation])
        self.streams.add(rid, group_size, partial(self.p_conn.write_layers, rid))
        self._prefill(rid, len(prompt), t0)
        future.result(60)
        ttft = time.perf_counter() - t0
        sent.result(60)
        self.streams.remove(rid)
        assert torch.equal(self.d_cache[dst], self.p_cache[src])
        return {"ttft_s": ttft}

    def close(self) -> None:
        self.p_conn.close()
        self.d_conn.close()
