"""A stand-in worker rank for the cross-process tests: a Ray actor with a real paged KV cache.

It holds what a real worker holds for the hand-off: the cache tensor in the worker
layout, the engine's BlockManager (fragmented on purpose, so requests get random,
non-contiguous block ids) and a KVConnector over NIXL. Arguments and results are
only bytes, strings, numbers and lists (Ray sends those as msgpack, never pickle);
kvtransfer messages travel as their own msgpack bytes, errors as [code, message].
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib

import torch

from kvtransfer import KVTransferConfig, KVTransferError, create_connector
from kvtransfer.layout import KVLayout
from kvtransfer.messages import KVHandle, decode_as, encode
from workers.engine.block_manager import BlockManager

from .helpers import MODEL, empty_cache, full_kv, rank_cache

OK = "ok"


class KVWorker:
    def __init__(
        self,
        worker_id: str,
        *,
        num_kv_heads: int = 4,
        tp_rank: int = 0,
        tp_size: int = 1,
        num_blocks: int = 64,
        num_layers: int = 2,
        block_size: int = 4,
        head_dim: int = 8,
        seed: int | None = 0,
        direction: str = "pull",
        lease_seconds: float = 30.0,
        transfer_timeout_s: float = 5.0,
        progress_delay_us: int = 100,
        frag_seed: int | None = None,
    ):
        self.block_size = block_size
        shape_kv = full_kv(
            num_blocks, num_layers, num_kv_heads, block_size, head_dim, seed=seed or 0
        )
        if seed is None:
            self.cache = empty_cache(shape_kv, tp_rank, tp_size, num_blocks)
        else:
            self.cache = rank_cache(shape_kv, tp_rank, tp_size)
        self.layout = KVLayout.from_tensor(
            self.cache, model_id=MODEL, num_kv_heads=num_kv_heads, tp_rank=tp_rank, tp_size=tp_size
        )
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        # Ranks of one TP worker share a scheduler, hence block ids: same seed.
        self._fragment(
            random.Random(zlib.crc32(worker_id.encode()) if frag_seed is None else frag_seed)
        )
        self.lock = threading.Lock()
        self.released: list[list[str]] = []
        self.futures = {}
        config = KVTransferConfig(
            backend="nixl",
            direction=direction,
            lease_seconds=lease_seconds,
            transfer_timeout_s=transfer_timeout_s,
            progress_delay_us=progress_delay_us,
        )
        self.connector = create_connector(
            config, self.layout, self.cache, worker_id, self._on_release
        )

    def _fragment(self, rng: random.Random) -> None:
        """Free every block in random order: later requests get scattered ids."""
        n = self.bm.num_blocks
        for i in range(n):
            self.bm.allocate_slots(f"frag{i}", 0, self.block_size)
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            self.bm.free(f"frag{i}")

    def _on_release(self, req_id: str, reason: str) -> None:
        # Runs on the connector thread: the block manager is not thread-safe.
        with self.lock:
            self.bm.free(req_id)
            self.released.append([req_id, reason])

    # ---- control plane --------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.connector.metadata()

    def pid(self) -> int:
        return os.getpid()

    def agent_name(self) -> str:
        return self.connector.agent_name

    def add_peer(self, metadata: bytes) -> list:
        try:
            return [OK, self.connector.add_peer(metadata)]
        except KVTransferError as exc:
            return [exc.code, str(exc)]

    def remove_peer(self, name: str) -> None:
        self.connector.remove_peer(name)

    # ---- prefill side -----------------------------------------------------------------
    def prefill(self, req_id: str, num_tokens: int, dst_tp_size: int = 1) -> bytes:
        """'Run' a prompt: allocate its blocks and offer them; returns the KVHandle bytes."""
        with self.lock:
            assert self.bm.allocate_slots(req_id, 0, num_tokens)
            block_ids = list(self.bm.block_table(req_id))
        handle = self.connector.offer(
            req_id, block_ids, num_tokens=num_tokens, first_token_id=1, dst_tp_size=dst_tp_size
        )
        return encode(handle)

    # ---- decode side ------------------------------------------------------------------
    def start_receive(self, handles: list[bytes], num_tokens: int, timeout_s: float = 5.0) -> list:
        decoded = [decode_as(h, KVHandle) for h in handles]
        req_id = decoded[0].req_id
        with self.lock:
            assert self.bm.allocate_slots(req_id, 0, num_tokens)
            block_ids = list(self.bm.block_table(req_id))
        self.futures[req_id] = (
            time.monotonic(),
            self.connector.receive(decoded, block_ids, timeout_s),
        )
        return block_ids

    def wait_receive(self, req_id: str) -> list:
        """[code, message, seconds waited, num_descriptors]; frees the blocks on failure."""
        start, future = self.futures.pop(req_id)
        try:
            result = future.result(timeout=60)
        except KVTransferError as exc:
            with self.lock:
                self.bm.free(req_id)  # safe: the future completed, nothing targets them
            return [exc.code, str(exc), time.monotonic() - start, 0]
        return [OK, "", time.monotonic() - start, result.num_descriptors]

    def abort(self, req_id: str) -> None:
        self.connector.abort(req_id)

    def decline(self, handles: list[bytes], status: str) -> None:
        self.connector.decline([decode_as(h, KVHandle) for h in handles], status)

    def finish(self, req_id: str) -> None:
        with self.lock:
            self.bm.free(req_id)

    # ---- inspection -------------------------------------------------------------------
    def blocks(self, block_ids: list[int]) -> bytes:
        return self.cache[block_ids].contiguous().view(torch.uint8).numpy().tobytes()

    def num_used_blocks(self) -> int:
        with self.lock:
            self.bm.check_integrity()
            return self.bm.num_used_blocks

    def released_reasons(self) -> list:
        with self.lock:
            return list(self.released)

    def stats(self) -> list[int]:
        s = self.connector.stats()
        return [s.num_peers, s.num_leases, s.num_incoming, s.num_outgoing]

    def cpu_seconds(self, seconds: float) -> float:
        """CPU time this process used over ``seconds`` of doing nothing (idle agent)."""
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start
