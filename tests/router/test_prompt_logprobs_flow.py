"""Prompt logprobs (echo + logprobs) and logit_bias through the router over real engines
(tests/router/test_router_flow.py's in-process cluster), on gRPC and on HTTP with the
official ``openai`` client, as lm-evaluation-harness's ``local-completions`` asks for a
loglikelihood: ``echo: true, logprobs: 1, max_tokens: 1`` (or 0), reading
``choices[0].logprobs`` (tokens, token_logprobs with null first, top_logprobs,
text_offset). Disaggregated, the prefill worker computes them: the same numbers as
aggregated and as ``LLM.generate``.
"""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from proto.baton.v1 import inference_pb2 as pb
from router.http.chat_template import ChatTemplate
from router.http.server import HttpServer
from router.server import generate_request, generate_response
from tests.router.test_router_flow import LONG_PREFIX, Cluster, model_dir, req, run
from workers import LLM, SamplingParams
from workers.text.tokenizer import Tokenizer

__all__ = ["model_dir"]

PROMPT = LONG_PREFIX


def cluster_for(model_dir, disaggregation: str) -> Cluster:
    num_prefill = 1 if disaggregation == "always" else 0
    return Cluster(model_dir, num_prefill, 1, disaggregation=disaggregation)


async def ask(router, request: pb.GenerateRequest) -> tuple[list, list[int], list[int], pb.Final]:
    """(prompt logprobs, prompt token ids, output token ids, Final) of a gRPC request;
    checks that the prompt logprobs come once, in the first message with tokens."""
    prompt_lps, prompt_ids, tokens, final = [], [], [], None
    async for event in router.generate(generate_request(request)):
        msg = generate_response(event)
        delta = msg.delta if msg.HasField("delta") else msg.final.delta
        if delta.prompt_logprobs:
            assert not prompt_lps and not tokens, "prompt logprobs come once, first"
            prompt_lps, prompt_ids = list(delta.prompt_logprobs), list(delta.prompt_token_ids)
        tokens.extend(delta.token_ids)
        if msg.HasField("final"):
            final = msg.final
    return prompt_lps, prompt_ids, tokens, final


def with_prompt_logprobs(k: int, **kw) -> pb.GenerateRequest:
    request = req(PROMPT, **kw)
    request.output.prompt_logprobs = k
    return request


@pytest.fixture(scope="module")
def want(model_dir):
    """LLM.generate's prompt logprobs and output for PROMPT."""
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    return llm.generate([PROMPT], params)[0]


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_grpc_prompt_logprobs_equal_llm_generate_even_when_cached(model_dir, want, disaggregation):
    cluster = cluster_for(model_dir, disaggregation)

    async def body(router):
        await ask(router, req(PROMPT, max_tokens=2))  # the prompt's blocks are cached now
        got = await ask(router, with_prompt_logprobs(2, max_tokens=4))
        plain = await ask(router, req(PROMPT, max_tokens=4))
        await cluster.settled()
        return got, plain

    (lps, ids, tokens, final), plain = run(cluster, body)
    assert ids == list(want.prompt_token_ids) and tokens == list(want.token_ids)
    assert len(lps) == len(ids) - 1
    for lp, ref in zip(lps, want.prompt_logprobs[1:], strict=True):
        assert lp.token_id == ref.token_id and lp.rank == ref.rank
        assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.token_id for t in lp.top] == list(ref.top_token_ids)
    assert plain[0] == [] and plain[3].usage.cached_prompt_tokens > 0  # others still hit
    if disaggregation == "never":
        assert final.usage.cached_prompt_tokens == 0  # computed whole, though cached
    else:  # the prefill worker computed them (the decode worker's own cache is its own)
        assert final.timing.prefill_worker == "prefill-0"


def test_grpc_logit_bias_forces_a_token_on_both_paths(model_dir, want):
    forced = (want.token_ids[0] + 5) % 1000
    for mode in ("never", "always"):
        cluster = cluster_for(model_dir, mode)

        async def body(router, cluster=cluster):
            request = req(PROMPT, max_tokens=4)
            request.sampling.logit_bias[forced] = 100.0
            sampled = req(PROMPT, max_tokens=4)
            sampled.sampling.temperature = 1.0
            sampled.sampling.seed = 3
            sampled.sampling.logit_bias[forced] = 100.0
            out = [(await ask(router, r))[2] for r in (request, sampled)]
            await cluster.settled()
            return out

        assert run(cluster, body) == [[forced] * 4] * 2, mode


async def http(router) -> tuple[HttpServer, openai.AsyncOpenAI, str]:
    server = HttpServer(router, "127.0.0.1", 0)
    await server.start()
    base = f"http://{server.address}/v1"
    return server, openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0), base


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_echo_with_logprobs_is_openais_and_vllms_shape(model_dir, want, disaggregation):
    tokenizer = Tokenizer.from_dir(model_dir)
    cluster = cluster_for(model_dir, disaggregation)
    ask_for = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}

    async def body(router):
        server, client, base = await http(router)
        try:
            one = await client.completions.create(**ask_for, max_tokens=1)
            zero = await client.completions.create(**ask_for, max_tokens=0)
            chunks = [
                c
                async for c in await client.completions.create(**ask_for, max_tokens=3, stream=True)
            ]
            async with httpx.AsyncClient(base_url=base) as raw:
                refusals = [
                    await raw.post("/completions", json={**ask_for, **bad})
                    for bad in (
                        {"logprobs": 21},
                        {"logit_bias": {"abc": 1}},
                        {"logit_bias": {"5": 101}},
                        {"logit_bias": {"99999": 1}},
                    )
                ]
            await cluster.settled()
            return one, zero, chunks, refusals
        finally:
            await server.stop()

    one, zero, chunks, refusals = run(cluster, body)
    prompt_ids = list(want.prompt_token_ids)
    num = len(prompt_ids)
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    # max_tokens 1 (lm-eval): the prompt's tokens, then the one generated.
    choice = one.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == num + 1
    assert lp.tokens[:num] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1:] == [sum(len(t) for t in (lp.tokens[:i])) for i in range(1, num + 1)]
    for got, ref in zip(lp.token_logprobs[1:num], want.prompt_logprobs[1:], strict=True):
        assert got == pytest.approx(ref.logprob, abs=1e-4)
    for top, ref in zip(lp.top_logprobs[1:num], want.prompt_logprobs[1:], strict=True):
        assert list(top.values()) == pytest.approx([ref.top_logprobs[0]], abs=1e-4)
    assert lp.tokens[num] == tokenizer.decode([want.token_ids[0]], skip_special_tokens=False)
    assert choice.finish_reason == "length"
    assert one.usage.prompt_tokens == num and one.usage.completion_tokens == 1
    # max_tokens 0: the prompt only, nothing generated (vLLM's answer).
    z = zero.choices[0]
    assert z.text == PROMPT and z.finish_reason == "length"
    assert (
        z.logprobs.tokens == lp.tokens[:num]
        and z.logprobs.token_logprobs == lp.token_logprobs[:num]
    )
    assert z.logprobs.text_offset == lp.text_offset[:num]
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == num
    # Streamed: the prompt's part in the first chunk, then the output's.
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.tokens[:num] == texts
    assert first.logprobs.token_logprobs[:num] == lp.token_logprobs[:num]
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert len(streamed) == num + 3
    assert offsets == [sum(len(t) for t in streamed[:i]) for i in range(num + 3)]
    # Refusals name the OpenAI field.
    params = [r.json()["error"]["param"] for r in refusals]
    assert [r.status_code for r in refusals] == [400] * 4, [r.text for r in refusals]
    assert params == ["logprobs", "logit_bias", "logit_bias", "logit_bias"]
    assert "vocabulary" in refusals[3].json()["error"]["message"]


def test_chat_prompt_logprobs_and_logit_bias(model_dir, want):
    tokenizer = Tokenizer.from_dir(model_dir)
    forced = (want.token_ids[0] + 5) % 1000
    cluster = cluster_for(model_dir, "never")
    messages = [{"role": "user", "content": "Tell me a story."}]

    async def body(router):
        server = HttpServer(router, "127.0.0.1", 0, chat_template=ChatTemplate.from_dir(model_dir))
        await server.start()
        base = f"http://{server.address}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        try:
            asked = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, extra_body={"prompt_logprobs": 1}
            )
            plain = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=1
            )
            biased = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, temperature=1.0, seed=1,
                logprobs=True, logit_bias={str(forced): 100},
            )  # fmt: skip
            async with httpx.AsyncClient(base_url=base) as raw:
                streamed = await raw.post(
                    "/chat/completions",
                    json={"model": "tiny", "messages": messages, "stream": True,
                          "prompt_logprobs": 1},
                )  # fmt: skip
            await cluster.settled()
            return asked, plain, biased, streamed
        finally:
            await server.stop()

    asked, plain, biased, streamed = run(cluster, body)
    prompt = asked.model_extra["prompt_logprobs"]
    assert len(prompt) == asked.usage.prompt_tokens and prompt[0] is None
    for entry in prompt[1:]:
        assert 1 <= len(entry) <= 2  # the prompt's own token, and the top-1 when another
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
        assert any(e["rank"] == 1 for e in entry.values())
    assert "prompt_logprobs" not in plain.model_extra
    text = tokenizer.decode([forced], skip_special_tokens=False)
    assert [c.token for c in biased.choices[0].logprobs.content] == [text] * 3
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
