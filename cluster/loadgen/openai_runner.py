"""``baton bench --backend openai``: the same requests and timings over an OpenAI-compatible
HTTP API (Baton's ``router.http_port``, or any server that speaks it), as
``vllm bench serve --backend openai`` sends them.

Each request is a streamed ``POST /v1/completions`` with the prompt as token ids,
``temperature: 0``, ``stream_options.include_usage`` (the output length and cached tokens
come from the usage chunk) and, as extra body fields, ``ignore_eos`` and
``disaggregation``. One aiohttp session (a connection pool without limit) carries every
request. A message carries tokens when its text is not empty (an SSE chunk does not say
how many tokens it holds), as ``vllm bench serve`` counts them. An HTTP error is recorded
under the router's code name for its status (429 = ``RESOURCE_EXHAUSTED``), so that both
backends' ``errors`` read alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from cluster.loadgen.datasets import BenchRequest
from cluster.loadgen.runner import RequestRecord, drive

_CODE_OF_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


@dataclass(frozen=True)
class OpenAITarget:
    base_url: str  # http://HOST:PORT/v1
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalise_base_url(url: str) -> str:
    """``http://HOST:PORT`` or ``.../v1`` -> ``http://HOST:PORT/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _one(
    session: aiohttp.ClientSession,
    target: OpenAITarget,
    req: BenchRequest,
    record: RequestRecord,
    start: float,
    ignore_eos: bool,
    disaggregation: str | None,
) -> None:
    body: dict = {
        "model": target.model,
        "prompt": list(req.prompt_ids),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if disaggregation is not None:
        body["disaggregation"] = disaggregation
    sent = time.perf_counter()
    record.send_s = sent - start
    last: float | None = None
    try:
        async with session.post(
            target.base_url + "/completions", json=body, headers=target.headers
        ) as response:
            if response.status != 200:
                record.error = _CODE_OF_STATUS.get(response.status, f"HTTP_{response.status}")
                return
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                now = time.perf_counter()
                if data == b"[DONE]":
                    record.e2e_s = now - sent
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("type") or "ERROR"
                    return
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if last is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                if choices and choices[0].get("finish_reason") == "abort":
                    record.error = "ABORTED"
                usage = chunk.get("usage")
                if usage:
                    record.output_len = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_prompt_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = type(exc).__name__
    if record.e2e_s is None and not record.error:
        record.error = "NO_FINAL"  # the stream ended without [DONE]


async def run_requests_openai(
    target: OpenAITarget,
    requests: list[BenchRequest],
    offsets: list[float],
    *,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    disaggregation: str | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """``runner.run_requests`` over HTTP: the records (in request order) and the duration."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # no pool limit: concurrency is ours to set
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(req: BenchRequest, record: RequestRecord, start: float) -> None:
            await _one(session, target, req, record, start, ignore_eos, disaggregation)

        return await drive(requests, offsets, one, max_concurrency, on_done)


def model_info(base_url: str, api_key: str | None, wait_s: float) -> tuple[str, int, int]:
    """(model id, max_model_len, vocab_size) from ``GET /v1/models``, waiting up to
    ``wait_s`` for the server to answer. Raises ValueError naming what is missing."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(base_url + "/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                cards = json.loads(response.read())["data"]
            break
        except (urllib.error.URLError, ConnectionError) as exc:
            if isinstance(exc, urllib.error.HTTPError) or time.monotonic() > deadline:
                raise ConnectionError(f"{base_url}/models: {exc}") from None
            time.sleep(0.5)
    if not cards:
        raise ValueError(f"{base_url}/models lists no model")
    card = cards[0]
    for key in ("max_model_len", "vocab_size"):
        if not isinstance(card.get(key), int):
            raise ValueError(
                f"--base-url: {base_url}/models has no {key} (Baton's model card has it; "
                "prompts are random token ids below the vocabulary size)"
            )
    return card["id"], card["max_model_len"], card["vocab_size"]
