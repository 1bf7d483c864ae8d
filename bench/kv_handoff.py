"""KV hand-off of one request between two processes: NIXL (pull, push) vs copy_ vs Ray object store.

A Llama-3-8B-shaped cache (32 layers, 8 kv heads, head dim 128, bf16, block size 16:
2 MiB per block) in each of two Ray actors (separate processes, one machine). For a
request of 2k and 8k tokens (128 / 512 blocks; 256 MiB / 1 GiB) it times:

- NIXL pull: the decode actor READs the prefill actor's blocks (one transfer);
- NIXL push: the prefill actor WRITEs into blocks the decode actor reserved;
- copy_: the same bytes copied inside one process (runs of blocks, torch, 1 thread);
- Ray object store: prefill gathers the blocks into one array and returns it (put),
  decode gets it and copies it into its blocks.

Block ids are either consecutive (what an idle cache hands out) or random. Each
figure is the median of ``--repeats`` runs, the paths interleaved run by run (so that
the machine's noise hits them alike); the bytes are checked once per case.
Also reported: descriptors per request after merging, and the idle CPU of an agent
(with our progress delay, and with NIXL's default of 0 for comparison).

    python -m bench.kv_handoff --json bench/kv_handoff.json
    python -m bench.kv_handoff --ucx-tls tcp --patterns consecutive --skip-store  # TCP
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import time

import numpy as np
import ray
import torch

from kvtransfer import KVLayout, KVTransferConfig, create_connector
from kvtransfer.messages import KVHandle, decode_as, encode
from workers.engine.kv_cache import allocate_kv_cache

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


class BenchWorker:
    def __init__(
        self,
        name: str,
        num_blocks: int,
        direction: str,
        progress_delay_us: int = 100,
    ):
        torch.set_num_threads(1)
        self.cache = allocate_kv_cache(
            num_blocks, LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, DTYPE, torch.device("cpu")
        )
        # Touch every page (a serving worker's cache is warm) with bytes that are not zero.
        self.cache.view(-1).view(torch.uint8).random_(
            0, 256, generator=torch.Generator().manual_seed(len(name))
        )
        layout = KVLayout.from_tensor(self.cache, model_id="llama-3-8b", num_kv_heads=KV_HEADS)
        config = KVTransferConfig(
            direction=direction,
            transfer_timeout_s=20,
            lease_seconds=60,
            progress_delay_us=progress_delay_us,
        )
        self.connector = create_connector(config, layout, self.cache, name, lambda *_: None)
        self.buffer = None

    def metadata(self) -> bytes:
        return self.connector.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.connector.add_peer(metadata)

    def offer(self, req_id: str, block_ids: list[int]) -> bytes:
        return encode(
            self.connector.offer(
                req_id, block_ids, num_tokens=len(block_ids) * BLOCK_SIZE, first_token_id=0
            )
        )

    def receive(self, handle: bytes, block_ids: list[int]) -> list:
        result = self.connector.receive([decode_as(handle, KVHandle)], block_ids).result(timeout=60)
        return [result.seconds, result.num_descriptors, result.num_bytes]

    def digest(self, block_ids: list[int]) -> str:
        h = hashlib.blake2b(digest_size=16)
        for block_id in block_ids:
            h.update(self.cache[block_id].view(torch.uint8).numpy())
        return h.hexdigest()

    def copy_baseline(self, block_ids: list[int], repeats: int) -> list[float]:
        """In-process copy_ of the same bytes into a second (warm) buffer, run by run."""
        n = len(block_ids)
        if self.buffer is None or self.buffer.shape[0] < n:
            self.buffer = torch.ones((n, *self.cache.shape[1:]), dtype=DTYPE)
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or block_ids[i] != block_ids[i - 1] + 1:
                runs.append((start, block_ids[start], i - start))
                start = i
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for dst, src, length in runs:
                self.buffer[dst : dst + length].copy_(self.cache[src : src + length])
            times.append(time.perf_counter() - t0)
        return times

    def export(self, block_ids: list[int]) -> np.ndarray:
        return self.cache[block_ids].view(torch.uint8).numpy()  # gather copy, then put

    def import_(self, array: np.ndarray, block_ids: list[int]) -> None:
        self.cache[block_ids] = (
            torch.from_numpy(array).view(DTYPE).view(len(block_ids), *self.cache.shape[1:])
        )

    def idle_cpu(self, seconds: float) -> float:
        start = time.process_time()
        time.sleep(seconds)
        return (time.process_time() - start) / seconds


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def one_case(args, prefill, decoders, tokens, src_ids, dst_ids, seq) -> dict:
    """Every path once per repeat, interleaved, so that noise hits them alike."""
    num_bytes = len(src_ids) * LAYERS * 2 * KV_HEADS * BLOCK_SIZE * HEAD_DIM * 2
    times: dict[str, list[float]] = {"copy": [], "store": []}
    descs = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms connections and buffers
        copy_s = ray.get(prefill.copy_baseline.remote(src_ids, 1))[0]
        for direction, decode in decoders.items():
            seq += 1
            t0 = time.perf_counter()
            handle = ray.get(prefill.offer.remote(f"r{seq}", src_ids))
            seconds, descs[direction], _ = ray.get(decode.receive.remote(handle, dst_ids))
            if rep:
                times.setdefault(direction, []).append(seconds)
                times.setdefault(f"{direction}_e2e", []).append(time.perf_counter() - t0)
        if not args.skip_store:
            t0 = time.perf_counter()
            ray.get(decoders["pull"].import_.remote(prefill.export.remote(src_ids), dst_ids))
            if rep:
                times["store"].append(time.perf_counter() - t0)
        if rep:
            times["copy"].append(copy_s)
    want = ray.get(prefill.digest.remote(src_ids))
    for direction, decode in decoders.items():
        ray.get(
            decode.receive.remote(ray.get(prefill.offer.remote(f"v{direction}", src_ids)), dst_ids)
        )
        assert ray.get(decode.digest.remote(dst_ids)) == want, f"{direction}: bytes differ"
    if not args.skip_store:
        ray.get(decoders["pull"].import_.remote(prefill.export.remote(src_ids), dst_ids))
        assert ray.get(decoders["pull"].digest.remote(dst_ids)) == want, "store: bytes differ"
    row = {"tokens": tokens, "bytes": num_bytes}
    for name, values in times.items():
        if values:
            row[f"{name}_gbps"] = gbps(num_bytes, statistics.median(values))
    for direction, count in descs.items():
        row[f"{direction}_descriptors"] = count
    return row


def run(args) -> dict:
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=2 * 2**30, runtime_env={"env_vars": env})  # fmt: skip
    worker = ray.remote(num_cpus=0)(BenchWorker)
    max_blocks = max(args.tokens) // BLOCK_SIZE
    num_blocks = max_blocks + max_blocks // 4
    delay = args.progress_delay_us
    prefill = worker.remote("prefill", num_blocks, "pull", delay)
    decoders = {d: worker.remote(f"decode-{d}", num_blocks, d, delay) for d in ("pull", "push")}
    metas = ray.get([a.metadata.remote() for a in (prefill, *decoders.values())])
    for decode, meta in zip(decoders.values(), metas[1:], strict=True):
        ray.get([prefill.add_peer.remote(meta), decode.add_peer.remote(metas[0])])
    if not args.skip_store:  # steady state: the object store's memory has been used once
        for _ in range(3):
            ids = list(range(max_blocks))
            ray.get(decoders["pull"].import_.remote(prefill.export.remote(ids), ids))
    rng = random.Random(0)
    rows = []
    for tokens in args.tokens:
        n = tokens // BLOCK_SIZE
        for pattern in args.patterns:
            if pattern == "consecutive":
                src_ids, dst_ids = list(range(n)), list(range(num_blocks - n, num_blocks))
            else:
                src_ids = rng.sample(range(num_blocks), n)
                dst_ids = rng.sample(range(num_blocks), n)
            row = {
                "pattern": pattern,
                **one_case(args, prefill, decoders, tokens, src_ids, dst_ids, len(rows) * 1000),
            }
            rows.append(row)
            print(json.dumps(row))
    idle = {
        "agent_idle_core": statistics.median(
            ray.get(prefill.idle_cpu.remote(args.idle_seconds)) for _ in range(3)
        )
    }
    spinner = worker.remote("spinner", 64, "pull", 0)  # NIXL's default delay, for comparison
    ray.get(spinner.add_peer.remote(metas[0]))
    idle["agent_idle_core_delay0"] = ray.get(spinner.idle_cpu.remote(args.idle_seconds))
    print(json.dumps(idle))
    ray.shutdown()
    return {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "ucx_tls": args.ucx_tls or "(UCX default)",
        "progress_delay_us": args.progress_delay_us,
        "rows": rows,
        **idle,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--patterns", nargs="+", default=["consecutive", "random"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--ucx-tls", default="", help="UCX_TLS for the workers (e.g. tcp)")
    parser.add_argument("--progress-delay-us", type=int, default=100)
    parser.add_argument("--skip-store", action="store_true", help="skip the object-store path")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
