"""The router's overhead in bench/serving.py: the workers' engine called directly in this
process, and the served streams matched against it per request and token index, split
where the router handled each chunk (from the stamps of ``serving_stamps.py``)."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from itertools import pairwise
from typing import TYPE_CHECKING

from bench.serving_stamps import PUBLISH, ROUTE, Stamps
from bench.serving_stats import dist_ms

if TYPE_CHECKING:
    from bench.serving import Item, Result


def delivery(results: list[Result], stamps: Stamps) -> dict:
    """Per streamed chunk: worker publish -> client receive, split where the router was."""
    legs: dict[str, list[float]] = defaultdict(list)
    missing = 0
    for res in results:
        published, routed = stamps.per_chunk(PUBLISH, res), stamps.per_chunk(ROUTE, res)
        if published is None or routed is None:
            missing += 1
            continue
        for p, r, c in zip(published, routed, res.recv, strict=True):
            legs["delivery"].append(c - p)
            legs["worker_to_router"].append(r - p)
            legs["router_to_client"].append(c - r)
    return {**{f"{k}_ms": dist_ms(v) for k, v in legs.items()}, "unmatched_requests": missing}


class DirectEngine:
    """The workers' engine (same model and settings) in this process, called directly."""

    def __init__(self, model_dir: str, args: argparse.Namespace, num_threads: int):
        import torch

        from workers.engine.config import EngineConfig
        from workers.engine.llm_engine import LLMEngine

        torch.set_num_threads(num_threads)
        self.engine = LLMEngine(
            EngineConfig(
                model=model_dir,
                device="cpu",
                max_model_len=args.max_model_len,
                block_size=args.block_size,
                num_kv_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                detokenize=False,
            )
        )

    def run(self, item: Item) -> dict:
        """Step one request alone: its tokens, TTFT, and when each token came out."""
        from workers import SamplingParams

        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        start = time.monotonic()
        request_id = self.engine.add_request(list(item.prompt_ids), params)
        times, token_ids = [], []
        while self.engine.has_unfinished_requests():
            deltas = self.engine.step()
            now = time.monotonic()
            for d in deltas:
                if d.request_id == request_id and d.token_ids:
                    times.append(now)
                    token_ids.extend(d.token_ids)
        return {"token_ids": token_ids, "ttft": times[0] - start, "times": times}


def router_overhead(served: list[Result], direct: list[dict], stamps: Stamps) -> dict:
    """Served streams against the same requests stepped directly, matched by request and
    token index: per streamed chunk, and for the first token."""
    m: dict[str, list[float]] = defaultdict(list)
    differ = 0
    for res, ref in zip(served, direct, strict=True):
        if res.error or res.token_ids != ref["token_ids"] or set(res.counts) != {1}:
            differ += 1
            continue
        published, arrived = stamps.per_chunk(PUBLISH, res), stamps.arrived(res.request_id)
        if published is None or arrived is None:
            continue
        gaps = [b - a for a, b in pairwise(res.recv)]
        steps = [b - a for a, b in pairwise(ref["times"])]
        m["cadence_added"] += [g - s for g, s in zip(gaps, steps, strict=True)]
        m["client_gap"] += gaps
        m["worker_publish_gap"] += [b - a for a, b in pairwise(published)]
        m["direct_engine_step"] += steps
        m["ttft_client"].append(res.recv[0] - res.send)
        m["ttft_direct_engine"].append(ref["ttft"])
        m["ttft_in_worker"].append(published[0] - arrived)
        m["ttft_added"].append(res.recv[0] - res.send - ref["ttft"])
        m["request_path"].append(arrived - res.send)
    return {
        "outputs_differ_from_direct_engine": differ,
        **delivery(served, stamps),
        **{f"{k}_ms": dist_ms(v) for k, v in m.items()},
    }
