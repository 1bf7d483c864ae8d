"""Partial receive through the router, over real engines in one process: ``kv_aware``
sends a handed-off request to the decode worker that holds the prompt's first blocks
already (an earlier request it prefilled itself), which receives only the rest from the
prefill worker, with the tokens of ``LLM.generate``; its Prometheus series count the
blocks received, those it reused and the bytes they saved (docs/metrics.md)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from proto.baton.v1 import inference_pb2 as pb
from workers import LLM, SamplingParams

from .test_router_flow import LONG_PREFIX, Cluster, collect, req, run

BS = 8
PROMPT = LONG_PREFIX + "and then"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("partial") / "tiny", "llama", "tiny")


def series(cluster: Cluster, worker: str) -> dict[str, float]:
    role, model, instance = cluster.services[worker].metrics._labels
    labels = {"role": role, "model": model, "instance": instance}
    names = ("blocks", "reused_blocks", "saved_bytes")
    values = {
        name: REGISTRY.get_sample_value(
            f"baton_kv_receive_{name}_total", {**labels, "source": "prefill"}
        )
        for name in names
    }
    values["transfer_bytes"] = REGISTRY.get_sample_value("baton_kv_transfer_bytes_sum", labels)
    return values


def test_a_decode_worker_receives_only_what_its_cache_lacks_and_counts_it(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = list(llm.generate([PROMPT], params)[0].token_ids)
    # Two decode workers: idle and equal but for decode-0's cache, round robin (the tie
    # break) would send the second request to decode-1.
    cluster = Cluster(model_dir, num_decode=2, disaggregation="always", policy="kv_aware")
    engine = cluster.services["decode-0"].engine
    n_prefix = len(engine.tokenizer.encode(LONG_PREFIX))
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    held, total = n_prefix // BS, -(-n_prompt // BS)
    assert 0 < held < total
    before = series(cluster, "decode-0")

    async def body(router):
        never = pb.DISAGGREGATION_NEVER
        first = await collect(router, req(LONG_PREFIX, max_tokens=1, disaggregation=never))
        assert first[2].timing.decode_worker == "decode-0"
        while len(router.decode[0].hashes) < held:  # its report reaches the router
            await asyncio.sleep(0.01)
        out = await collect(router, req(PROMPT))
        await cluster.settled()
        return out

    tokens, _, final = run(cluster, body)
    assert tokens == want
    assert (final.timing.prefill_worker, final.timing.decode_worker) == ("prefill-0", "decode-0")
    after = series(cluster, "decode-0")
    moved = {k: after[k] - before[k] for k in after}
    assert moved["blocks"] == total - held and moved["reused_blocks"] == held
    # Every block has the same bytes: the held ones saved as many per block as one moved.
    per_block = moved["transfer_bytes"] / moved["blocks"]
    assert per_block > 0 and moved["saved_bytes"] == held * per_block
    assert moved["saved_bytes"] == cluster.services["decode-0"].transport.bytes_not_received
