"""FP8 KV cache (``kv_cache.dtype: fp8_e4m3``) against bf16 and fp32 KV, in one run.

Three figures, each FP8 over the unquantized cache of the same run:

- **KV bytes per token** of a Llama-3-8B-shaped cache (32 layers, 8 kv heads, head dim 128)
  and of the tiny test model, from the allocated tensors (``allocate_kv_cache``);
- **hand-off time** of one long prompt's blocks between two Ray actors (separate
  processes) over real NIXL (decode pulls): an FP8 pair and a bf16 pair of actors, the
  transfers of the two interleaved run by run so the machine's noise hits them alike; the
  bytes are checked after the timed runs;
- **CPU decode attention** (the reference path, which dequantizes after its gather): one
  layer's paged attention for 32 decodes of 512-token contexts, Llama-8B heads (32 query,
  8 kv, dim 128), CPU time per call, the kinds alternated call by call;
- **requests held at once** for a fixed KV memory: a real engine (the tiny model, CPU) with
  the same ``kv_cache_memory_gib`` for each KV dtype is given many identical requests at
  once; the figure is the most requests running in one step (and preemptions).

    python -m bench.kv_fp8 --json bench/kv_fp8.json
    python -m bench.kv_fp8 --model DIR --skip-handoff   # requests held, another model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time

import ray
import torch

from kvtransfer import KVLayout, KVTransferConfig, create_connector
from kvtransfer.messages import KVHandle, decode_as, encode
from workers.engine.kv_cache import allocate_kv_cache

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
KINDS = {  # name -> (model dtype, kv_cache_dtype)
    "fp8": (torch.bfloat16, "fp8_e4m3"),
    "bf16": (torch.bfloat16, "auto"),
    "fp32": (torch.float32, "auto"),
}


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, kind: str) -> int:
    dtype, kv_cache_dtype = KINDS[kind]
    cache = allocate_kv_cache(
        1, layers, kv_heads, BLOCK_SIZE, head_dim, dtype, torch.device("cpu"), kv_cache_dtype
    )
    return cache.numel() * cache.element_size() // BLOCK_SIZE


class HandoffWorker:
    """One side of a hand-off: a warm Llama-8B-shaped cache and its NIXL connector."""

    def __init__(self, name: str, num_blocks: int, kind: str):
        torch.set_num_threads(1)
        dtype, kv_cache_dtype = KINDS[kind]
        cpu = torch.device("cpu")
        self.cache = allocate_kv_cache(
            num_blocks, LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype, cpu, kv_cache_dtype
        )
        # Touch every page (a serving worker's cache is warm) with bytes that are not zero.
        self.cache.view(-1).view(torch.uint8).random_(
            0, 256, generator=torch.Generator().manual_seed(len(name))
        )
        layout = KVLayout.from_tensor(self.cache, model_id="llama-3-8b", num_kv_heads=KV_HEADS)
        config = KVTransferConfig(direction="pull", transfer_timeout_s=30, lease_seconds=60)
        self.connector = create_connector(config, layout, self.cache, name, lambda *_: None)

    def metadata(self) -> bytes:
        return self.connector.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.connector.add_peer(metadata)

    def offer(self, req_id: str, block_ids: list[int]) -> bytes:
        handle = self.connector.offer(
            req_id, block_ids, num_tokens=len(block_ids) * BLOCK_SIZE, first_token_id=0
        )
        return encode(handle)

    def receive(self, handle: bytes, block_ids: list[int]) -> list:
        future = self.connector.receive([decode_as(handle, KVHandle)], block_ids)
        result = future.result(timeout=60)
        return [result.seconds, result.num_bytes]

    def digest(self, block_ids: list[int]) -> str:
        h = hashlib.blake2b(digest_size=16)
        for block_id in block_ids:
            h.update(self.cache[block_id].view(torch.uint8).numpy())
        return h.hexdigest()


def handoff(tokens: int, repeats: int, kinds: tuple[str, ...]) -> dict:
    """Median NIXL pull time of one ``tokens``-token prompt per KV kind, interleaved."""
    worker = ray.remote(num_cpus=0)(HandoffWorker)
    n = tokens // BLOCK_SIZE
    pairs = {}
    for kind in kinds:
        prefill = worker.remote(f"prefill-{kind}", n, kind)
        decode = worker.remote(f"decode-{kind}", n, kind)
        metas = ray.get([prefill.metadata.remote(), decode.metadata.remote()])
        ray.get([prefill.add_peer.remote(metas[1]), decode.add_peer.remote(metas[0])])
        pairs[kind] = (prefill, decode)
    src, dst = list(range(n)), list(range(n))[::-1]  # reversed: no merged runs on one side
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    num_bytes = {}
    for rep in range(repeats + 1):  # repeat 0 warms the connections
        for kind, (prefill, decode) in pairs.items():
            handle = ray.get(prefill.offer.remote(f"r{rep}", src))
            seconds, num_bytes[kind] = ray.get(decode.receive.remote(handle, dst))
            if rep:
                times[kind].append(seconds)
    for kind, (prefill, decode) in pairs.items():
        want = ray.get(prefill.digest.remote(src))
        assert ray.get(decode.digest.remote(dst)) == want, f"{kind}: bytes differ"
    row = {"tokens": tokens}
    for kind in kinds:
        row[f"{kind}_bytes"] = num_bytes[kind]
        row[f"{kind}_ms"] = 1e3 * statistics.median(times[kind])
        row[f"{kind}_ms_runs"] = [round(1e3 * t, 2) for t in times[kind]]
    for kind in kinds[1:]:
        row[f"fp8_over_{kind}_time"] = row["fp8_ms"] / row[f"{kind}_ms"]
        row[f"fp8_over_{kind}_bytes"] = row["fp8_bytes"] / row[f"{kind}_bytes"]
    for pair in pairs.values():
        for actor in pair:
            ray.kill(actor)
    return row


def attention_cpu_time(repeats: int) -> dict:
    """Median CPU seconds of one layer's decode attention over each kind's cache."""
    from kernels.fp8_kv import quantize_rows
    from kernels.paged_attention import paged_attention
    from tests.kernels.paged_batch import build_metadata

    num_seqs, ctx, heads = 32, 512, 32
    blocks_per_seq = ctx // BLOCK_SIZE
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(num_seqs * blocks_per_seq, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    metadata = build_metadata([1] * num_seqs, [ctx] * num_seqs, tables, BLOCK_SIZE, num_seqs)
    cases = {
        "fp8": (torch.float32, quantize_rows(kv)),
        "bf16": (torch.bfloat16, kv.bfloat16()),
        "fp32": (torch.float32, kv),
    }
    query = torch.randn(num_seqs, heads, HEAD_DIM, generator=gen)
    times: dict[str, list[float]] = {kind: [] for kind in cases}
    for rep in range(repeats + 1):
        for kind, (dtype, cache) in cases.items():
            t0 = time.process_time()
            paged_attention(query.to(dtype), cache, metadata, HEAD_DIM**-0.5)
            if rep:
                times[kind].append(time.process_time() - t0)
    row = {f"{kind}_ms": 1e3 * statistics.median(t) for kind, t in times.items()}
    row["fp8_over_fp32"] = row["fp8_ms"] / row["fp32_ms"]
    row["fp8_over_bf16"] = row["fp8_ms"] / row["bf16_ms"]
    return row


def requests_held(kind: str, model_dir: str, memory_gib: float, prompt_len: int, num_reqs: int):
    """Most requests running at once in a real engine whose KV cache is ``memory_gib``."""
    from workers.engine.config import EngineConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.protocol.sampling_params import SamplingParams

    dtype, kv_cache_dtype = KINDS[kind]
    config = EngineConfig(
        model=model_dir, dtype=str(dtype).removeprefix("torch."), device="cpu",
        kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gib=memory_gib, block_size=BLOCK_SIZE,
        max_model_len=512, max_num_seqs=1024, max_num_batched_tokens=8192,
        enable_prefix_caching=False, detokenize=False,
    )  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(prompt_len)], params)
    most, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        steps += 1
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return {
        "kind": kind,
        "num_blocks": engine.block_manager.num_blocks,
        "kv_cache_mib": engine.kv_cache.numel() * engine.kv_cache.element_size() / 2**20,
        "most_running": most,
        "steps": steps,
    }


def run(args) -> dict:
    from cluster.tools.make_model import make_model

    result: dict = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "repeats": args.repeats,
    }
    result["bytes_per_token"] = {
        shape: {kind: bytes_per_token(*dims, kind) for kind in KINDS}
        for shape, dims in {"llama-3-8b": (LAYERS, KV_HEADS, HEAD_DIM), "tiny": (2, 2, 16)}.items()
    }
    print(json.dumps(result["bytes_per_token"]))
    # What the same sizing gives a Llama-3-8B-shaped cache: blocks in 16 GiB of KV memory,
    # and requests of 2048 tokens held at once (computed, not run: the model is not here).
    per_token = result["bytes_per_token"]["llama-3-8b"]
    result["llama_3_8b_16gib"] = {
        kind: {"blocks": (16 << 30) // (per_token[kind] * BLOCK_SIZE),
               "requests_of_2048": (16 << 30) // (per_token[kind] * BLOCK_SIZE) // 128}
        for kind in KINDS
    }  # fmt: skip
    print(json.dumps(result["llama_3_8b_16gib"]))
    result["cpu_decode_attention"] = attention_cpu_time(args.repeats * 3)
    print(json.dumps(result["cpu_decode_attention"]))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(os.path.join(tmp, "tiny"), "qwen2", "tiny")
        held = [
            requests_held(kind, str(model_dir), args.memory_gib, args.prompt_len, args.num_reqs)
            for kind in KINDS
        ]
    for row in held:
        print(json.dumps(row))
    by_kind = {row["kind"]: row for row in held}
    result["requests_held"] = {
        "memory_gib": args.memory_gib,
        "prompt_len": args.prompt_len,
        "max_tokens": 16,
        "rows": held,
        "fp8_over_bf16": by_kind["fp8"]["most_running"] / by_kind["bf16"]["most_running"],
        "fp8_over_fp32": by_kind["fp8"]["most_running"] / by_kind["fp32"]["most_running"],
    }
    if args.skip_handoff:
        return result
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        result["handoff"] = []
        for tokens in args.tokens:
            row = handoff(tokens, args.repeats, tuple(args.kinds))
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs")}))
            result["handoff"].append(row)
    finally:
        ray.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--kinds", nargs="+", default=["fp8", "bf16"], help="fp8 first")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", help="model for the requests-held run (default: tiny)")
    parser.add_argument("--memory-gib", type=float, default=0.002)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--num-reqs", type=int, default=200)
    parser.add_argument("--skip-handoff", action="store_true", help="no NIXL hand-off runs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
