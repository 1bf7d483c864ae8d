"""KV bytes per token and hand-off time: DeepSeek-V3's latent cache against a GQA (Llama) cache.

Two ``baton make-model`` checkpoints of the same size class (``--size small``: hidden 768,
10 layers, 12 query heads, bfloat16): ``deepseek-v3`` caches one latent row of
``kv_lora_rank + qk_rope_head_dim`` (128 + 32) per token and layer, ``llama`` keys and values
of 4 kv heads x 64. For each, a prefill engine computes a prompt (timed: the compute the
hand-off rides on), offers its blocks, and a decode engine's connector pulls them into
blocks it allocated over real NIXL agents in one process (the bytes are checked); the
median of ``--repeats`` receives is reported with the bytes per token from the layout.

    python -m bench.mla_handoff --json bench/mla_handoff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine

BLOCK_SIZE = 16


def engine(model_dir: str, num_tokens: int) -> LLMEngine:
    config = EngineConfig(
        model=model_dir,
        block_size=BLOCK_SIZE,
        num_kv_blocks=-(-num_tokens // BLOCK_SIZE) + 8,
        max_model_len=num_tokens + BLOCK_SIZE,
        max_num_batched_tokens=512,
        max_num_seqs=4,
    )
    return LLMEngine(config)


def measure(arch: str, model_dir: str, num_tokens: int, repeats: int) -> dict:
    p, d = engine(model_dir, num_tokens), engine(model_dir, num_tokens)
    layouts = [
        KVLayout.from_tensor(e.kv_cache, model_id=arch, num_kv_heads=e.arch.kv_cache_heads)
        for e in (p, d)
    ]
    config = KVTransferConfig(backend="nixl", transfer_timeout_s=60, lease_seconds=600)
    p_conn = create_connector(config, layouts[0], p.kv_cache, f"{arch}-p", lambda *_: None)
    d_conn = create_connector(config, layouts[1], d.kv_cache, f"{arch}-d", lambda *_: None)
    try:
        d_conn.add_peer(p_conn.metadata())
        p_conn.add_peer(d_conn.metadata())
        prompt = [(7 * i + 3) % 1000 for i in range(num_tokens)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # 1 ends at prefill
        start = time.perf_counter()
        req_id = p.add_request(prompt, params, prefill_only=True)
        held = None
        while p.has_unfinished_requests():
            for delta in p.step():
                held = delta if delta.request_id == req_id else held
        prefill_s = time.perf_counter() - start
        src = list(held.held_block_ids)
        assert d.block_manager.allocate_slots("recv", 0, num_tokens)
        dst = list(d.block_manager.block_table("recv"))
        seconds, num_bytes = [], 0
        for i in range(repeats + 1):  # the first one warms the agents up: not counted
            handle = p_conn.offer(f"{req_id}-{i}", src, num_tokens=num_tokens, first_token_id=0)
            result = d_conn.receive([handle], dst).result(timeout=60)
            seconds.extend([result.seconds] if i else [])
            num_bytes = result.num_bytes
        assert torch.equal(d.kv_cache[dst], p.kv_cache[src])  # the blocks arrived intact
        per_token = layouts[0].bytes_per_token
        assert num_bytes == len(src) * BLOCK_SIZE * per_token
        median = statistics.median(seconds)
        return {
            "arch": arch,
            "kv_cache_shape": list(p.kv_cache.shape),
            "dtype": str(p.kv_cache.dtype).removeprefix("torch."),
            "kv_bytes_per_token": per_token,
            "prompt_tokens": num_tokens,
            "blocks": len(src),
            "handoff_bytes": num_bytes,
            "handoff_ms_median": round(median * 1e3, 3),
            "handoff_ms_all": [round(s * 1e3, 3) for s in seconds],
            "handoff_gb_per_s": round(num_bytes / median / 1e9, 3),
            "prefill_s": round(prefill_s, 3),
        }
    finally:
        p_conn.close()
        d_conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        archs = ("llama", "deepseek-v3")
        dirs = {arch: str(make_model(Path(tmp) / arch, arch, "small")) for arch in archs}
        for num_tokens in args.tokens:
            for arch in archs:
                row = measure(arch, dirs[arch], num_tokens, args.repeats)
                print(json.dumps(row))
                rows.append(row)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "threads": args.threads,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
