"""Speculative decoding on a real disaggregated cluster: 1 prefill + 1 decode worker (Ray
actors, NIXL hand-off, gRPC), ``decode.speculative: {method: ngram, num_tokens: 4}``,
``disaggregation: always``.

Every request is prefilled on the prefill worker and handed off; the decode worker
speculates on it and must still give exactly the greedy tokens of ``LLM.generate``
without speculation. Its counters move in ``GetClusterStatus`` and on ``/metrics`` (the
same numbers), the prefill worker's stay at zero, and a request that opts out moves none.
tests/router/test_speculative_flow.py is the quick in-process version. The same with a
draft model (the served model as its own draft) is ``slow``.
"""

from __future__ import annotations

import os
from pathlib import Path

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from cluster.client import format_status
from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import ROOT, cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released
from tests.e2e.test_metrics import DECODE, PREFILL, scrape

# Long enough for the tiny model's greedy outputs to repeat themselves, which is what the
# n-gram lookup proposes from.
MAX_TOKENS = 48
COUNTERS = ("verify_steps", "draft_tokens", "accepted_tokens")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    config = cluster_config(tiny_model_dir)
    config["decode"]["speculative"] = {"method": "ngram", "num_tokens": 4}
    served = start_cluster(config, tmp_path_factory.mktemp("speculative"))
    yield served
    code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    """The single-process engine's greedy tokens, no speculation."""
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate([*PROMPTS, TOKEN_PROMPT], params)]


def spec_counts(status: pb.ClusterStatus, name: str) -> tuple[int, int, int]:
    worker = next(w for p in status.pools for w in p.workers if w.name == name)
    return (worker.spec_num_steps, worker.spec_num_draft_tokens, worker.spec_num_accepted_tokens)


def status(cluster) -> pb.ClusterStatus:
    return cluster.stub().GetClusterStatus(pb.GetClusterStatusRequest(), timeout=10)


def test_handed_off_requests_speculate_with_the_same_greedy_tokens(cluster, expected):
    stub = cluster.stub()
    for prompt, tokens in zip([*PROMPTS, TOKEN_PROMPT], expected, strict=True):
        got, _, final = collect(stub, request(prompt, max_tokens=MAX_TOKENS))
        assert got == tokens, prompt
        assert final.usage.completion_tokens == MAX_TOKENS
    after = wait_blocks_released(stub)  # no block left behind by the rolled-back proposals
    assert after.speculative == "ngram, 4 tokens"
    steps, proposed, accepted = spec_counts(after, "decode-0")
    # The engine speculates until it has measured a speculative step of a batch size, then
    # where that pays (workers/engine/speculative/gate.py): proposals are certain
    # (the outputs repeat themselves), accepted ones depend on the timing measured, unlike
    # tests/router/test_speculative_flow.py, which turns the gate off.
    assert steps > 0 and proposed > 0 and 0 <= accepted <= proposed
    assert spec_counts(after, "prefill-0") == (0, 0, 0)  # prefill never speculates
    # /metrics shows the same counts as the status (both from the worker's reports).
    s = scrape(cluster)
    names = [f"baton_spec_decode_{n}_total" for n in COUNTERS]
    assert [s.get(n, **DECODE) for n in names] == [steps, proposed, accepted]
    assert [s.get(n, **PREFILL) for n in names] == [0, 0, 0]
    # `baton status` shows the decode worker's acceptance rate and mean accepted length.
    lines = format_status(after).splitlines()
    (row,) = [line for line in lines if line.lstrip().startswith("decode-0")]
    assert row.split()[-2:] == [f"{100 * accepted / proposed:.1f}%", f"{accepted / steps + 1:.2f}"]


def test_a_request_that_opts_out_does_not_speculate(cluster, expected):
    stub = cluster.stub()
    before = spec_counts(status(cluster), "decode-0")
    req = request(
        TOKEN_PROMPT, max_tokens=MAX_TOKENS, sampling=pb.SamplingParams(speculative=False)
    )
    req.sampling.temperature = 0.0
    got, _, _ = collect(stub, req)
    assert got == expected[-1]
    # The report that came with the request's last tokens already counts every step of it.
    assert spec_counts(status(cluster), "decode-0") == before


@pytest.fixture(scope="module")
def draft_cluster(tiny_model_dir, tmp_path_factory):
    """The same layout with ``method: draft``: the served model as its own draft, named by
    a path relative to the serving process's directory (bring-up hands the workers an
    absolute one)."""
    config = cluster_config(tiny_model_dir)
    draft = os.path.relpath(tiny_model_dir, ROOT)  # the cluster runs with cwd=ROOT
    config["decode"]["speculative"] = {"method": "draft", "draft_model": draft, "num_tokens": 3}
    served = start_cluster(config, tmp_path_factory.mktemp("speculative-draft"))
    yield served
    code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]


@pytest.mark.slow
def test_a_draft_model_speculates_with_the_same_greedy_tokens(draft_cluster, expected):
    stub = draft_cluster.stub()
    for prompt, tokens in zip([*PROMPTS, TOKEN_PROMPT], expected, strict=True):
        got, _, _ = collect(stub, request(prompt, max_tokens=MAX_TOKENS))
        assert got == tokens, prompt
    after = wait_blocks_released(stub)
    assert after.speculative == f"draft {Path(draft_cluster.model_dir).name}, 3 tokens"
    steps, proposed, accepted = spec_counts(after, "decode-0")
    # Its own draft: the target accepts (nearly) everything it proposes.
    assert steps > 0 and proposed > 0 and accepted > proposed // 2
