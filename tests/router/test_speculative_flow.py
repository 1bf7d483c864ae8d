"""Speculative decoding through the router's flow over real engines (in one process; the
Cluster of test_router_flow.py): a request handed off from prefill speculates on its
decode worker with the same greedy tokens as ``LLM.generate`` without speculation, the
decode worker's counts reach the status snapshot and its metrics, and a request that
opts out (``sampling.speculative: false``) moves none of them.
tests/e2e/test_speculative_cluster.py repeats this through Ray, NIXL and gRPC."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from proto.baton.v1 import inference_pb2 as pb
from router.status import cluster_status
from tests.router.test_router_flow import Cluster, collect, run
from workers import LLM, SamplingParams

# A prompt whose greedy continuation on the tiny random model falls into a cycle: the
# n-gram lookup finds its proposals in the output's own history.
PROMPT_IDS = [5, 17, 300, 42, 8, 99, 1000, 3, 250, 77, 64]
MAX_TOKENS = 40
NGRAM = {"speculative_method": "ngram", "speculative_num_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("spec-flow") / "tiny", "llama", "tiny")


def request(speculative: bool | None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(disaggregation=pb.DISAGGREGATION_ALWAYS)
    req.token_ids.ids.extend(PROMPT_IDS)
    req.sampling.temperature = 0.0
    if speculative is not None:
        req.sampling.speculative = speculative
    req.stopping.max_tokens = MAX_TOKENS
    req.stopping.ignore_eos = True
    req.output.return_timing = True
    return req


def counts(router, name: str) -> tuple[int, int, int]:
    worker = next(w for p in cluster_status(router).pools for w in p.workers if w.name == name)
    return (worker.spec_num_steps, worker.spec_num_draft_tokens, worker.spec_num_accepted_tokens)


def test_handed_off_requests_speculate_on_decode_with_the_same_tokens(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = list(llm.generate([PROMPT_IDS], params)[0].token_ids)
    cluster = Cluster(model_dir, decode_settings=NGRAM)
    decode = cluster.services["decode-0"]
    # Speculate at every step the proposer has tokens for, whatever the engine's gate
    # measured (workers/engine/speculative/gate.py): accepted tokens for sure.
    decode.engine.spec.adaptive = False
    labels = {"role": "decode", "model": "tiny", "instance": f"decode-0-{id(cluster)}"}

    async def body(router):
        tokens, _, final = await collect(router, request(None))
        assert tokens == expected
        assert final.timing.prefill_worker == "prefill-0"  # handed off
        steps, proposed, accepted = counts(router, "decode-0")
        assert steps > 0 and proposed > 0 and 0 < accepted <= proposed
        # The report that came with the Final carries the engine's totals.
        stats = decode.engine.spec_stats
        assert (steps, proposed, accepted) == (
            stats.num_steps,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
        )
        names = ("verify_steps", "draft_tokens", "accepted_tokens")
        recorded = [
            REGISTRY.get_sample_value(f"baton_spec_decode_{n}_total", labels) for n in names
        ]
        assert recorded == [steps, proposed, accepted]
        assert counts(router, "prefill-0") == (0, 0, 0)  # prefill never speculates

        tokens, _, _ = await collect(router, request(False))  # opted out
        assert tokens == expected
        assert counts(router, "decode-0") == (steps, proposed, accepted)
        await cluster.settled()

    run(cluster, body)
