"""A whole cluster streaming the KV layer-wise: real Ray actors, real NIXL, real gRPC.

``kv_transfer.layerwise: on`` with ``layerwise_min_tokens``: every prompt of at least
that many uncached tokens streams (on this CPU machine the ``auto`` chooser's measured
numbers would rarely predict a gain; ``on`` asks none). A long prompt (two prefill
chunks, one layer per write) must give exactly the single-process engine's tokens and
the aggregated path's; a short one keeps the whole-request hand-off (what
``layerwise: off`` does for every prompt) with the same tokens as well; the prefill
worker's ``baton_kv_layerwise_streams_total`` proves the streams happened; no block
stays in use on either worker. One cluster serves the module (its start is the cost).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, request, wait_blocks_released
from tests.e2e.test_metrics import scrape

pytestmark = pytest.mark.slow

MIN_TOKENS = 64
# Past max_num_batched_tokens (256): two prefill chunks, each streamed group by group.
LONG_A = "Once upon a time in a land far away there lived a curious engineer who " * 10
LONG_B = "The river ran quietly under the old stone bridge near the mill, " * 12
LONG_C = "Numbers and letters: alpha beta gamma delta epsilon zeta eta theta " * 13
SHORT = "Hello there, general"
STREAMS = "baton_kv_layerwise_streams_total"
PREFILL = {"role": "prefill", "instance": "prefill-0"}


@pytest.fixture(scope="module")
def layerwise_cluster(tiny_model_dir, tmp_path_factory):
    config = cluster_config(tiny_model_dir)
    config["kv_transfer"].update(
        # The reservation's deadline covers the prefill's queueing and compute (twice):
        # generous on a shared two-core machine.
        layerwise="on",
        layerwise_min_tokens=MIN_TOKENS,
        timeout_seconds=30,
        lease_seconds=60,
    )
    served = start_cluster(config, tmp_path_factory.mktemp("layerwise-cluster"))
    yield served
    assert stop_cluster(served) == 0, served.output()[-4000:]


def num_streams(cluster, result: str) -> float:
    return scrape(cluster).get(STREAMS, result=result, **PREFILL)


def wait_streams(cluster, result: str, want: float, timeout_s: float = 20.0) -> None:
    """The prefill worker counts a stream once its loop saw the future complete (a moment
    after the decode worker may already have answered)."""
    deadline = time.monotonic() + timeout_s
    while (have := num_streams(cluster, result)) < want:
        assert time.monotonic() < deadline, f"{result} streams: {have}, want {want}"
        time.sleep(0.1)
    assert have == want


def test_long_prompts_stream_layerwise_with_the_engines_tokens(layerwise_cluster, tiny_model_dir):
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    prompts = [LONG_A, LONG_B, LONG_C, SHORT]
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    assert min(lengths[:3]) > 256 and max(lengths) < 480 and lengths[3] < MIN_TOKENS
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [list(out.token_ids) for out in llm.generate(prompts, params)]
    stub = layerwise_cluster.stub()
    assert num_streams(layerwise_cluster, "done") == 0

    # One long prompt alone: streamed, the engine's tokens.
    long_a = collect(stub, request(LONG_A, disaggregation=pb.DISAGGREGATION_ALWAYS))
    assert long_a[0] == want[0]
    wait_streams(layerwise_cluster, "done", 1)

    # The short one: the whole-request hand-off (layerwise: off's path), the same tokens.
    short = collect(stub, request(SHORT, disaggregation=pb.DISAGGREGATION_ALWAYS))
    assert short[0] == want[3]
    time.sleep(0.5)
    assert num_streams(layerwise_cluster, "done") == 1

    # Two long ones at once (two streams into the decode worker's blocks together).
    with ThreadPoolExecutor(2) as pool:
        outs = list(
            pool.map(
                lambda p: collect(stub, request(p, disaggregation=pb.DISAGGREGATION_ALWAYS)),
                [LONG_B, LONG_C],
            )
        )
    assert [out[0] for out in outs] == want[1:3]
    wait_streams(layerwise_cluster, "done", 3)

    # The aggregated path (no hand-off at all) agrees, text included.
    agg = collect(stub, request(LONG_A, disaggregation=pb.DISAGGREGATION_NEVER))
    assert agg[0] == long_a[0] and agg[1] == long_a[1]
    assert num_streams(layerwise_cluster, "failed") == 0
    wait_blocks_released(stub)
