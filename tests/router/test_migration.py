"""Request migration (router/migration.py) over real engines in one process.

The in-process cluster of test_router_flow: real EngineServices and event channels, only
Ray's control calls replaced. A worker is lost mid-request the two ways the router
notices: its engine loop dies (a failed event with the report that says so) or its event
channel closes (the process is gone). The client's stream must continue on another
worker with exactly the tokens and text of an undisturbed ``LLM.generate`` (greedy, and
seeded sampling with penalties), count the migration by cause, and past
``router.migration_limit`` end with UNAVAILABLE naming the worker.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from proto.baton.v1 import inference_pb2 as pb
from router.errors import RouterError
from tests.router.test_router_flow import LONG_PREFIX, Cluster, collect, req, run
from workers import LLM, SamplingParams
from workers.protocol.structured_output import StructuredOutput

SEEDED = dict(temperature=0.9, seed=5, repetition_penalty=1.2, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("migrate") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=256)


def migrations(cause: str) -> float:
    labels = {"role": "router", "model": "tiny", "instance": "router", "cause": cause}
    return REGISTRY.get_sample_value("baton_router_migrations_total", labels) or 0.0


def crash_after(cluster: Cluster, role: str, num_output_tokens: int, times: int = 1) -> list:
    """The first ``times`` engines of ``role`` to hold a request with ``num_output_tokens``
    output tokens die at that step ("device lost"); returns the crashed workers' names."""
    crashed: list[str] = []
    for name, service in cluster.services.items():
        if service.role != role:
            continue
        engine, real_step = service.engine, service.engine.step

        def step(engine=engine, real_step=real_step, name=name):
            requests = engine.scheduler.requests.values()
            if len(crashed) < times and any(
                r.num_output_tokens >= num_output_tokens for r in requests
            ):
                crashed.append(name)
                raise RuntimeError("device lost")
            return real_step()

        engine.step = step
    return crashed


def seeded_req(prompt: str, max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    r = req(prompt, max_tokens=max_tokens, request_id=request_id)
    for key, value in SEEDED.items():
        setattr(r.sampling, key, value)
    return r


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_a_decode_worker_dying_mid_stream_continues_seeded_token_for_token(
    model_dir, llm, disaggregation
):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **SEEDED)
    ref = llm.generate([LONG_PREFIX], params)[0]
    num_prefill = 1 if disaggregation == "always" else 0
    cluster = Cluster(model_dir, num_prefill, 2, disaggregation=disaggregation)
    crashed = crash_after(cluster, "decode", 6)
    before = migrations("decode_worker_died")

    async def body(router):
        result = await collect(router, seeded_req(LONG_PREFIX, 24))
        survivor = next(v for v in router.decode if v.is_alive)
        while survivor.routed or router.num_in_flight:  # its load counts end with it
            await asyncio.sleep(0.01)
        used = cluster.used_blocks()[survivor.name]
        return result, survivor.name, used

    (tokens, text, final), survivor, used = run(cluster, body)
    assert len(crashed) == 1 and survivor != crashed[0]
    assert tokens == list(ref.token_ids) and text == ref.text
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 24
    assert final.timing.decode_worker == survivor
    assert migrations("decode_worker_died") == before + 1
    assert used == 0


def test_a_closed_event_channel_migrates_a_greedy_stream_with_a_stop_string(model_dir, llm):
    greedy = dict(max_tokens=40, temperature=0, ignore_eos=True)
    text = llm.generate([LONG_PREFIX], SamplingParams(**greedy))[0].text
    stop = text[len(text) * 3 // 4 : len(text) * 3 // 4 + 3]
    ref = llm.generate([LONG_PREFIX], SamplingParams(**greedy, stop=[stop]))[0]
    cluster = Cluster(model_dir, 0, 2, disaggregation="never")
    before = migrations("decode_worker_died")

    async def body(router):
        task = asyncio.ensure_future(
            collect(router, req(LONG_PREFIX, 40, request_id="r", stop=[stop]))
        )
        while not any(
            r.num_output_tokens >= 5
            for s in cluster.services.values()
            for r in list(s.engine.scheduler.requests.values())
        ):
            await asyncio.sleep(0.002)
        victim = next(v for v in router.decode if "r" in v.active)
        victim.client.sender.close()  # as if its process died: the channel closes
        result = await task
        return result, victim

    (tokens, text_out, final), victim = run(cluster, body)
    assert not victim.is_alive and final.timing.decode_worker != victim.name
    assert tokens == list(ref.token_ids) and text_out == ref.text
    assert final.finish_reason == pb.FINISH_REASON_STOP and final.stop_string == stop
    assert migrations("decode_worker_died") == before + 1


def test_a_prefill_worker_dying_during_prefill_reroutes_the_prefill(model_dir, llm):
    ref = llm.generate([LONG_PREFIX], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    cluster = Cluster(model_dir, 2, 1, disaggregation="always")
    crashed = crash_after(cluster, "prefill", 0)  # its first step: the prompt's prefill
    before = migrations("prefill_worker_died")

    async def body(router):
        result = await collect(router, req(LONG_PREFIX, 12))
        await cluster.settled_except(crashed)
        return result

    tokens, text, final = run(cluster, body)
    assert len(crashed) == 1 and final.timing.prefill_worker != crashed[0]
    assert tokens == list(ref[0].token_ids) and text == ref[0].text
    assert migrations("prefill_worker_died") == before + 1


def test_the_migration_limit(model_dir):
    # Limit 0: no migration, UNAVAILABLE naming the worker.
    cluster = Cluster(model_dir, 0, 2, disaggregation="never", migration_limit=0)
    crashed = crash_after(cluster, "decode", 3)

    async def body(router):
        with pytest.raises(RouterError) as info:
            await collect(router, req(LONG_PREFIX, 20))
        return info.value

    error = run(cluster, body)
    assert error.code == "UNAVAILABLE"
    assert f"worker {crashed[0]} failed" in error.message and "device lost" in error.message
    assert "router.migration_limit=0" in error.message

    # Limit 1: the second death in one request is one too many.
    cluster = Cluster(model_dir, 0, 3, disaggregation="never", migration_limit=1)
    crashed = crash_after(cluster, "decode", 3, times=2)

    async def body(router):
        with pytest.raises(RouterError) as info:
            await collect(router, req(LONG_PREFIX, 20))
        return info.value

    error = run(cluster, body)
    assert len(crashed) == 2 and error.code == "UNAVAILABLE"
    assert f"worker {crashed[1]} failed" in error.message
    assert error.message.endswith("(router.migration_limit=1); migrated 1 time already")


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_a_migration_mid_json_still_yields_the_same_valid_json(model_dir, llm, disaggregation):
    """A schema-constrained, seeded stream whose decode worker dies mid-object: the new
    worker's request rebuilds the grammar from the tokens so far (the router resends
    them), so the JSON is the undisturbed run's and parses."""
    schema = {
        "x-guidance": {"whitespace_flexible": False},
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    }
    structured = StructuredOutput.json_schema(schema)
    params = SamplingParams(max_tokens=120, structured=structured, **SEEDED)
    ref = llm.generate([LONG_PREFIX], params)[0]
    assert len(ref.token_ids) > 8  # the crash below is mid-object
    num_prefill = 1 if disaggregation == "always" else 0
    cluster = Cluster(model_dir, num_prefill, 2, disaggregation=disaggregation)
    crashed = crash_after(cluster, "decode", 5)

    async def body(router):
        request = seeded_req(LONG_PREFIX, 120)
        request.stopping.ignore_eos = False
        request.structured.json_schema = json.dumps(schema)
        result = await collect(router, request)
        await cluster.settled_except(crashed)
        return result

    tokens, text, final = run(cluster, body)
    assert len(crashed) == 1
    assert tokens == list(ref.token_ids) and text == ref.text
    assert set(json.loads(text)) == {"title", "tags"}
    assert final.finish_reason == pb.FINISH_REASON_STOP
