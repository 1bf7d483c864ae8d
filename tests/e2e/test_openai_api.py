"""The OpenAI-compatible HTTP API of a real cluster (Ray actors, NIXL, 1 prefill + 1 decode
worker, ``disaggregation: always``), driven by the official ``openai`` client.

Its answers are the engine's (greedy equal to ``LLM.generate``, seeded equal to the gRPC
answer for the same request), its refusals OpenAI's, and a client that goes away leaves
no KV block in use. The last test drains the cluster with SIGTERM.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import openai
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
from pydantic import BaseModel, ConfigDict, Field

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, collect, request, wait_blocks_released

API_KEY = "e2e-key-0123456789"  # gRPC needs it too (docs/security.md)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    port = free_port()
    config = cluster_config(tiny_model_dir, http_port=port, api_key=API_KEY)
    cluster = start_cluster(config, tmp_path_factory.mktemp("openai"))
    cluster.api_key = API_KEY
    assert f"baton: OpenAI API on http://127.0.0.1:{port}/v1" in cluster.output()
    cluster.base_url = f"http://127.0.0.1:{port}/v1"  # type: ignore[attr-defined]
    yield cluster
    code = stop_cluster(cluster)
    assert code == 0, cluster.output()[-4000:]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from workers import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)


def client(served, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", API_KEY)
    return openai.OpenAI(base_url=served.base_url, max_retries=0, **kw)


@pytest.mark.parametrize("disaggregation", ["always", "never"])
def test_greedy_completions_equal_llm_generate(served, llm, disaggregation):
    from workers import SamplingParams

    out = client(served).completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=24,
        temperature=0.0,
        extra_body={"ignore_eos": True, "disaggregation": disaggregation},
    )
    refs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 24 * len(PROMPTS)
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def test_streamed_completion_equals_the_whole_answer(served):
    c = client(served)
    whole = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, **GREEDY)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_seeded_choices_equal_the_grpc_answers(served):
    """Choice i of a seeded request samples with seed + i, as one gRPC request would."""
    out = client(served).completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=24,
        n=2,
        seed=1234,
        temperature=0.9,
        top_p=0.95,
        extra_body={"ignore_eos": True},
    )
    stub = served.stub()
    for i, choice in enumerate(out.choices):
        sampling = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234 + i)
        _, text, _ = collect(stub, request(PROMPTS[0], sampling=sampling))
        assert choice.text == text
    assert out.choices[0].text != out.choices[1].text


def test_chat_streamed_and_not(served, tiny_model_dir):
    from workers.text.tokenizer import Tokenizer

    c = client(served)
    messages = [{"role": "user", "content": "Tell me about the fox."}]
    whole = c.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=16, **GREEDY
    )
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 16
    # The Llama 3 template make-model wrote: header tokens, BOS once.
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    prompt = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nTell me about the fox."
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_a_stop_string_ends_the_text_before_it(served):
    c = client(served)
    full = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, stop=stop, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


class Answer(BaseModel):
    """Compact JSON (llguidance's option): a random model would indent at length."""

    model_config = ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})
    city: str = Field(max_length=12)
    score: int = Field(ge=0, le=100)
    ok: bool


@pytest.mark.parametrize("disaggregation", ["always", "never"])
def test_parse_with_a_pydantic_model_every_time(served, disaggregation):
    """The official client's chat.completions.parse against the real cluster: every answer
    parses (sampled, several seeds; streamed too), across the hand-off and without it."""
    c = client(served)
    messages = [{"role": "user", "content": "Where is the fox?"}]
    extra = {"disaggregation": disaggregation}
    for seed in range(3):
        out = c.chat.completions.parse(
            model="tiny",
            messages=messages,
            response_format=Answer,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
            extra_body=extra,
        )
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(out.choices[0].message.parsed, Answer)
    with c.chat.completions.stream(
        model="tiny", messages=messages, response_format=Answer, max_tokens=100, extra_body=extra
    ) as stream:
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, Answer)
    wait_blocks_released(served.stub())


def test_error_statuses(served):
    c = client(served)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="hi", top_p=1.5)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="hi", max_tokens=600)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="not-served", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        client(served, api_key="wrong").completions.create(model="tiny", prompt="hi")
    response = httpx.post(served.base_url + "/completions", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 401


def test_queue_full_is_429(served):
    """48 requests admitted at most (cluster_config); 64 at once: some get 429. Each asks
    for 400 tokens so that the first ones are still running when the last are sent, even
    when a loaded machine starts the 64 client threads slowly (with 150 all 64 once
    finished without a 429)."""
    c = client(served)

    def one(i: int) -> str:
        try:
            c.completions.create(model="tiny", prompt=f"Flood {i}", max_tokens=400, **GREEDY)
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.status_code == 429
            return "429"

    with ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(one, range(64)))
    assert "429" in outcomes and outcomes.count("ok") >= 32
    wait_blocks_released(served.stub())


def test_a_disconnect_mid_stream_leaves_no_block_in_use(served):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = served.base_url + "/completions"
    for _ in range(4):
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    wait_blocks_released(served.stub())


def test_a_client_timeout_leaves_no_block_in_use(served):
    # A timeout of half what the whole request takes on this machine falls while it is
    # generating (a fixed one fell after the end once decode steps got fast).
    started = time.monotonic()
    client(served).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=450, **GREEDY)
    whole = time.monotonic() - started
    c = client(served, timeout=whole / 2)
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=450, **GREEDY)
    wait_blocks_released(served.stub())


def test_bench_drives_the_http_api_like_grpc(served, tmp_path, monkeypatch):
    """``baton bench --backend openai``: every request completes with its max_tokens, the
    shared prefix is served from the cache, as the gRPC backend's run of the same workload."""
    from cluster.cli import main as baton

    args = [
        "--dataset", "shared-prefix", "--num-groups", "2", "--prefix-len", "32",
        "--num-prompts", "8", "--input-len", "8", "--output-len", "6", "--ignore-eos",
        "--max-concurrency", "4",
    ]  # fmt: skip
    monkeypatch.setenv("BATON_API_KEY", API_KEY)  # the gRPC backend's key (never a flag)
    runs = {}
    for backend, where in (
        ("openai", ["--base-url", served.base_url.removesuffix("/v1"), "--api-key", API_KEY]),
        ("grpc", ["--target", served.address, "--seed", "1"]),
    ):
        out = tmp_path / f"{backend}.json"
        code = baton(["bench", "--backend", backend, *where, "--result-json", str(out), *args])
        assert code == 0
        [runs[backend]] = json.loads(out.read_text())["runs"]
    for run in runs.values():
        assert run["completed"] == 8 and run["failed"] == 0
        assert all(r["output_len"] == r["max_tokens"] == 6 for r in run["requests"])
        assert all(r["ttft_s"] > 0 and len(r["itl_s"]) >= 1 for r in run["requests"])
        assert run["cached_prompt_tokens"] > 0  # 6 of 8 prompts share a cached prefix
    assert "api_key" not in json.loads((tmp_path / "openai.json").read_text())["arguments"]


def test_sigterm_health_503_and_new_requests_503(served):
    """Last in the module: while draining, /health and new requests answer 503; the
    request in flight finishes."""
    c = client(served)
    results: list[str] = []
    started = threading.Event()

    def consume() -> None:
        stream = c.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=300, stream=True, **GREEDY
        )
        for chunk in stream:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                results.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(30)
    served.process.send_signal(signal.SIGTERM)
    health = served.base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 30  # the signal is handled within a few ms
    while httpx.get(health, timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "/health never turned 503 after SIGTERM"
        time.sleep(0.01)
    with pytest.raises(openai.InternalServerError) as info:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert info.value.status_code == 503
    thread.join(60)
    assert results == ["length"]
    assert served.process.wait(90) == 0
