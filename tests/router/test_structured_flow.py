"""Structured outputs and tool calls over real engines, through the router and the real
HTTP front end, driven by the official ``openai`` client (tests/router/test_router_flow.py's
in-process cluster: real engines, the real event channel and KV hand-off).

What must hold: ``chat.completions.parse`` with a pydantic model gets an object that
parses, every time, streamed and not, aggregated and disaggregated (the grammar's state
crosses the hand-off: the prefill worker samples the first token under it, the decode
worker carries on from there); the constrained tokens are the same disaggregated as
aggregated and as ``LLM.generate`` with the same constraint; a forced tool call comes back
as ``tool_calls`` whose arguments match the function's parameters, and the conversation
goes on with the tool's result. A random-weight model would rarely write JSON by itself:
whatever parses here, the grammar made.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from router.http.chat_template import ChatTemplate
from router.http.server import HttpServer
from tests.router.test_router_flow import Cluster, collect, model_dir, req, run
from workers import LLM, SamplingParams
from workers.protocol.structured_output import StructuredOutput

__all__ = ["model_dir"]


# Compact JSON (llguidance's option): a random model spends a token per space of
# indentation, and would run out of max_model_len in pretty-printed output.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


class Person(BaseModel):
    model_config = ConfigDict(json_schema_extra=COMPACT)
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    pets: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


SCHEMA = {
    **COMPACT,
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person."}]


def cluster_for(model_dir, disaggregation: str) -> Cluster:
    num_prefill = 1 if disaggregation == "always" else 0
    return Cluster(model_dir, num_prefill, 1, disaggregation=disaggregation)


async def http(router, model_dir) -> tuple[HttpServer, openai.AsyncOpenAI]:
    server = HttpServer(router, "127.0.0.1", 0, chat_template=ChatTemplate.from_dir(model_dir))
    await server.start()
    base = f"http://{server.address}/v1"
    return server, openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_parse_with_a_pydantic_model_every_time(model_dir, disaggregation):
    cluster = cluster_for(model_dir, disaggregation)

    async def body(router):
        server, client = await http(router, model_dir)
        try:
            parsed = []
            for seed in range(3):  # sampled: a different object each time, each one valid
                out = await client.chat.completions.parse(
                    model="tiny",
                    messages=ASK,
                    response_format=Person,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=200,
                )
                assert out.choices[0].finish_reason == "stop", out
                parsed.append(out.choices[0].message.parsed)
            async with client.chat.completions.stream(
                model="tiny", messages=ASK, response_format=Person, temperature=0, max_tokens=200
            ) as stream:
                streamed = (await stream.get_final_completion()).choices[0].message.parsed
            await cluster.settled()
            return parsed, streamed
        finally:
            await server.stop()

    parsed, streamed = run(cluster, body)
    assert all(isinstance(p, Person) for p in [*parsed, streamed])
    assert len({p.model_dump_json() for p in parsed}) > 1  # sampled, not one fixed answer


def test_disaggregated_tokens_equal_aggregated_and_the_engines_own(model_dir):
    structured = StructuredOutput.json_schema(SCHEMA)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=120, temperature=0, structured=structured)
    prompt = "Once upon a time"
    want = list(llm.generate([prompt], params)[0].token_ids)
    del llm
    got = {}
    for mode in ("never", "always"):
        cluster = cluster_for(model_dir, mode)

        async def body(router, cluster=cluster):
            request = req(prompt, max_tokens=120)
            request.stopping.ignore_eos = False
            request.structured.json_schema = json.dumps(SCHEMA)
            tokens, text, final = await collect(router, request)
            await cluster.settled()
            return tokens, text, final

        got[mode] = run(cluster, body)
    for mode, (tokens, text, final) in got.items():
        assert tokens == want, mode
        assert json.loads(text)["n"] in range(10)
        assert final.finish_reason == 1  # FINISH_REASON_STOP: the grammar ended it


def test_a_forced_tool_call_and_the_conversation_after_it(model_dir):
    cluster = cluster_for(model_dir, "always")
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }

    async def body(router):
        server, client = await http(router, model_dir)
        try:
            outs = []
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                outs.append(
                    await client.chat.completions.create(
                        model="tiny",
                        messages=ASK,
                        tools=[weather],
                        tool_choice=choice,
                        parallel_tool_calls=False,  # a random model would list calls on
                        max_tokens=120,
                        temperature=0,
                    )
                )
            call = outs[0].choices[0].message.tool_calls[0]
            after = await client.chat.completions.create(
                model="tiny",
                messages=[
                    *ASK,
                    {"role": "assistant", "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                ],
                max_tokens=4,
            )
            await cluster.settled()
            return outs, after
        finally:
            await server.stop()

    outs, after = run(cluster, body)
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls[:1]
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city"} and len(arguments["city"]) <= 10
    assert after.choices[0].message.content is not None


def test_concurrent_constrained_and_free_requests(model_dir):
    """A constrained request beside free ones in the same batches: each keeps its own."""
    cluster = cluster_for(model_dir, "always")

    async def body(router):
        free = req("Once upon a time", max_tokens=12)
        constrained = req("Once upon a time", max_tokens=40)
        constrained.stopping.ignore_eos = False
        constrained.structured.regex = "[a-c]{3}-[0-9]{2}"
        results = await asyncio.gather(
            collect(router, free), collect(router, constrained), collect(router, free)
        )
        await cluster.settled()
        return results

    (free_a, _, _), (_, text, final), (free_b, _, _) = run(cluster, body)
    assert free_a == free_b and len(free_a) == 12
    assert len(text) == 6 and text[3] == "-" and set(text[:3]) <= set("abc"), text
    assert text[4:].isdigit() and final.finish_reason == 1
