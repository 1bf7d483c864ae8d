"""The layer-wise hand-off's serving pieces on one worker: who frees a streaming prefill
request's blocks (KVHandoff: never while a write may read them: not at its end, not on
abort, not by preemption), the decode engine waiting for its first token, and the
prefill worker's measured numbers (LayerwiseStats)."""

from __future__ import annotations

import random

import pytest

from cluster.tools.make_model import make_model
from workers.engine.handoff import HandoffState
from workers.protocol.sampling_params import SamplingParams
from workers.serving.layerwise_stats import LayerwiseStats

from .test_engine_roles import BS, aggregated, assert_no_blocks_in_use, make_engine, run, tokens

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("layerwise-serving")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(3)
    return [rng.randrange(1000) for _ in range(70)]  # 3 chunks of a 32-token budget


def writes_to(log):
    return lambda *args: log.append(args)


def test_first_token_ending_the_request_keeps_its_blocks_until_the_stream_ends(model_dir, prompt):
    p = make_engine(model_dir)
    log = []
    p.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), "r", prefill_only=True)
    p.layerwise.open("r", 1, writes_to(log))
    out = run(p)["r"]
    assert out[-1].finished and out[-1].held_block_ids is None  # ended here, not held
    assert log and log[-1][-1] is True  # its last write went out
    assert p.handoff.state("r") is HandoffState.STREAMING
    assert p.block_manager.num_used_blocks == -(-len(prompt) // BS)  # still read
    assert p.layerwise.ended("r")
    assert_no_blocks_in_use(p)


def test_abort_while_streaming_keeps_the_blocks_until_the_stream_ends(model_dir, prompt):
    p = make_engine(model_dir)
    p.add_request(prompt, GREEDY, "r", prefill_only=True)
    p.layerwise.open("r", 2, writes_to([]))
    p.step()  # the first chunk: its blocks' writes may be in flight
    p.abort_request("r")
    p.step()
    assert p.handoff.state("r") is HandoffState.STREAMING
    assert p.block_manager.num_used_blocks > 0
    assert p.layerwise.ended("r")
    assert_no_blocks_in_use(p)


def test_a_held_streaming_request_is_freed_by_the_stream_not_by_abort(model_dir, prompt):
    p = make_engine(model_dir)
    p.add_request(prompt, GREEDY, "r", prefill_only=True)
    p.layerwise.open("r", 2, writes_to([]))
    out = run(p)["r"]
    assert out[-1].held_block_ids is not None
    p.abort_request("r")  # HELD, but a write may still read the blocks
    assert p.handoff.state("r") is HandoffState.HELD
    assert p.block_manager.num_used_blocks > 0
    assert p.layerwise.ended("r")
    assert_no_blocks_in_use(p)


def test_a_stream_ending_early_leaves_the_request_running(model_dir, prompt):
    p = make_engine(model_dir)
    p.add_request(prompt, GREEDY, "r", prefill_only=True)
    p.layerwise.open("r", 2, writes_to([]))
    p.step()
    assert not p.layerwise.ended("r")  # it failed: the request goes on, unstreamed
    assert "r" not in p.layerwise and not p.handoff.is_streaming("r")
    out = run(p)["r"]
    assert out[-1].held_block_ids is not None
    assert p.release_held("r")
    assert_no_blocks_in_use(p)


@pytest.mark.parametrize("streamed", [False, True])
def test_streaming_requests_are_never_preempted(model_dir, streamed):
    rng = random.Random(4)
    # 16 blocks: two 70-token prompts (9 blocks each) cannot both be computed at once.
    p = make_engine(model_dir, num_kv_blocks=16)
    prompts = [[rng.randrange(1000) for _ in range(70)] for _ in range(2)]
    p.add_request(prompts[0], GREEDY, "a", prefill_only=True)
    p.add_request(prompts[1], GREEDY, "b", prefill_only=True)
    if streamed:
        p.layerwise.open("a", 2, writes_to([]))
        p.layerwise.open("b", 2, writes_to([]))
    for _ in range(6):
        p.step()
    assert (p.scheduler.num_preemptions == 0) == streamed  # pressure enough to preempt
    for rid in ("a", "b"):
        p.abort_request(rid)
    p.step()
    for rid in ("a", "b"):
        p.layerwise.ended(rid)
    assert_no_blocks_in_use(p)


def test_decode_waits_for_its_first_token(model_dir, prompt):
    want = tokens(aggregated(make_engine(model_dir), [prompt], [GREEDY])[0])
    d = make_engine(model_dir)
    d.add_request(prompt, GREEDY, "r", await_first_token=True)
    d.step()
    assert len(d.take_kv_receives()) == 1
    with pytest.raises(ValueError):
        d.set_remote_first_token("other", want[0])
    d.set_remote_first_token("r", want[0])
    with pytest.raises(ValueError):
        d.set_remote_first_token("r", want[0])  # once
    d.kv_received("r", ok=False)  # nothing landed: recomputed, after the given token
    assert tokens(run(d)["r"]) == want[1:]
    assert_no_blocks_in_use(d)


def stats(**kw) -> LayerwiseStats:
    args = dict(num_layers=8, block_size=16, block_layer_bytes=65536, chunk_tokens=512,
                max_prompt_tokens=8191)  # fmt: skip
    return LayerwiseStats(**{**args, **kw})


def test_stats_need_every_number_before_anything_streams():
    s = stats()
    assert s.plan(4096) is None and s.min_tokens() == 0 and s.group_size(4096) == 8
    s.observe_step(4, 4, (0.0, 0.0, 1.0, 0.0, 0.0))  # a decode step: ignored
    assert s.layer_s_per_token is None
    s.observe_step(1, 513, (0.0, 0.0, 0.0512, 0.0, 0.0))
    assert s.layer_s_per_token == pytest.approx(0.0512 / (513 * 8))
    s.observe_link(1_000_000, 0.01)
    assert s.link() is None  # one size: the fixed cost is unknown
    s.observe_link(3_000_000, 0.03)
    bandwidth, per_transfer = s.link()
    assert bandwidth == pytest.approx(1e8) and per_transfer == pytest.approx(0.0, abs=1e-9)


def test_stats_stream_long_prompts_only():
    s = stats()
    s.layer_s_per_token = 2e-6  # 1 ms per layer of a 512-token chunk
    s.observe_link(1_000_000, 0.002)
    s.observe_link(100_000_000, 0.101)  # 1 GB/s, 1 ms per transfer
    limit = s.min_tokens()
    assert 0 < limit < 8191
    assert s.plan(limit).group_size is not None
    assert s.plan(limit - 1).group_size is None
    assert s.group_size(8) == 8  # the numbers say whole request: one group per chunk
    fast = stats()
    fast.layer_s_per_token = 2e-6
    fast.observe_link(100_000, 0.00501)
    fast.observe_link(10_000_000, 0.006)  # 10 GB/s, 5 ms per transfer: nothing gained
    assert fast.min_tokens() == 0


def test_the_threshold_skips_the_dips_past_chunk_boundaries():
    s = stats(chunk_tokens=128, max_prompt_tokens=1023)
    s.layer_s_per_token = 2e-5
    s.observe_link(1_000_000, 0.004)
    s.observe_link(100_000_000, 0.103)  # 1 GB/s, 3 ms per transfer
    limit = s.min_tokens()
    assert 0 < limit <= 1023
    for n in range(limit, 1024, 7):  # every prompt from the threshold on streams
        assert s.plan(n).group_size is not None, n
