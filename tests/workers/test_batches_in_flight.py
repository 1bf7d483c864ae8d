"""Batches in flight (the pipeline-parallel schedule), in one process.

Rank 0 of a pipeline keeps one batch per stage in flight (workers/engine/batches.py). The same
engine code runs here with ``batches_in_flight`` > 1 and no stages: each batch is
scheduled, then sampled a step later, so everything but the overlap is exercised. The
pipeline itself is tested across processes in test_pipeline_parallel.py.
"""

from __future__ import annotations

import pytest

from cluster.tools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.request import FinishReason
from workers.protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "llama", "tiny", overwrite=True)
    # Small budget and blocks: prompts split into chunks, and the 2nd half of the
    # prompts share a prefix with the 1st (prefix-cache hits).
    return EngineConfig(
        model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=24,
        max_num_seqs=16, max_model_len=256, num_kv_blocks=96,
    )  # fmt: skip


def _prompts() -> list[list[int]]:
    base = [[(13 * i + 7 * j) % 900 + 3 for j in range(n)] for i, n in enumerate((3, 20, 41, 9))]
    return base + [[*p, 5, 6, 7] for p in base]


def _run(engine: LLMEngine, params: SamplingParams, abort_after: int | None = None):
    ids = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(_prompts())]
    tokens = {rid: [] for rid in ids}
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta.finish_reason
        steps += 1
        if steps == abort_after:
            engine.abort_request(["r1", "r6"])
    return tokens, finals


def watch_overlaps(engine: LLMEngine) -> list[str]:
    """Ids of requests sent in a batch while an older batch in flight already carries one
    of their chunks (a prompt's chunks overlapping in the pipeline), as they happen."""
    seen: list[str] = []
    real_launch = engine.runner.launch

    def launch(sched, requests):
        flying = {c.request_id for batch in engine._in_flight._batches for c in batch.sched.chunks}
        seen.extend(c.request_id for c in sched.chunks if c.request_id in flying)
        return real_launch(sched, requests)

    engine.runner.launch = launch
    return seen


@pytest.mark.parametrize("depth", [2, 3])
def test_batches_in_flight_give_the_same_tokens(config, depth):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    for params in (greedy, seeded):
        want, _ = _run(LLMEngine(config), params)
        engine = LLMEngine(config, batches_in_flight=depth)
        overlaps = watch_overlaps(engine)
        got, finals = _run(engine, params)
        assert got == want
        assert overlaps  # some prompt had chunks in two batches at once
        assert set(finals.values()) == {FinishReason.LENGTH}
        bm = engine.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0
    assert engine.scheduler.num_slots == depth


def test_an_abort_while_its_batch_is_in_flight_drops_its_row_and_leaks_nothing(config):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = _run(LLMEngine(config), params)
    engine = LLMEngine(config, batches_in_flight=2)
    seen_in_flight = []
    real_step = engine.step

    def step():
        deltas = real_step()
        seen_in_flight.append({c.request_id for c in engine._in_flight._batches[0].sched.chunks}
                              if engine.num_in_flight else set())  # fmt: skip
        return deltas

    engine.step = step
    got, finals = _run(engine, params, abort_after=3)
    # The aborted requests were in the batch in flight at that moment.
    assert {"r1", "r6"} & seen_in_flight[2]
    assert finals["r1"] is finals["r6"] is FinishReason.ABORT
    assert len(got["r1"]) < 16 and got["r1"] == want["r1"][: len(got["r1"])]
    for rid in set(want) - {"r1", "r6"}:
        assert got[rid] == want[rid]
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert engine.num_in_flight == 0


def test_drain_samples_every_batch_in_flight(config):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(config, batches_in_flight=2)
    for i, prompt in enumerate(_prompts()[:4]):
        engine.add_request(prompt, params, f"r{i}")
    # Slots: r0, r2 -> 0; r1, r3 -> 1. Budget 24: slot 0 = r0's prompt + 21 of r2's;
    # slot 1 = the other 20 of r2's (its prompt has a chunk in flight: it goes on in
    # slot 1's batch, ahead of slot 1's waiting requests) + 4 of r1's. Only complete
    # prompts sample.
    first = engine.step()
    assert [d.request_id for d in first] == ["r0"]
    assert engine.num_in_flight == 1  # slot 1's batch
    engine.drain()
    assert engine.num_in_flight == 0
    # The drained batch's delta (r2's first token) comes with the next step, before that
    # step's own (slot 0 again: r0 and r2 decode).
    second = engine.step()
    assert [d.request_id for d in second] == ["r2", "r0", "r2"]


def test_a_failing_batch_cancels_every_batch_in_flight_and_loses_nothing(config):
    """The model raises while a prompt has chunks in two batches: neither advances (the
    later chunk needs the failed one's KV), and a retry gives the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want, _ = _run(LLMEngine(config), params)
    engine = LLMEngine(config, batches_in_flight=2)
    overlaps = watch_overlaps(engine)
    real_run = engine.runner.run
    failed: list[list[str]] = []

    def run(inputs):
        if overlaps and not failed:
            failed.append(list(overlaps))
            raise RuntimeError("device fault")
        return real_run(inputs)

    engine.runner.run = run
    ids = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(_prompts())]
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        try:
            deltas = engine.step()
        except RuntimeError as exc:
            assert "device fault" in str(exc)
            assert engine.num_in_flight == 0
            assert all(r.num_in_flight_tokens == 0 for r in engine.scheduler.requests.values())
            continue
        for delta in deltas:
            tokens[delta.request_id].extend(delta.token_ids)
    assert failed and failed[0]  # it failed with a prompt in two batches
    assert tokens == want
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
