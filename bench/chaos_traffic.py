"""The traffic of the chaos campaign (bench/chaos.py): steady load with known answers, and
hostile requests.

- :class:`Workload`: prompts (token ids) with their reference outputs, computed by the
  ``LLM`` API on the same weights before the cluster starts; greedy and seeded sampling.
- :class:`SteadyLoad`: client threads that send the workload over gRPC and HTTP until
  stopped and classify every request: ``equal`` (tokens, or the text over HTTP, equal to
  the reference), ``WRONG`` (completed with other output), or ``error:CODE`` (the gRPC
  status name; HTTP statuses are mapped back to the router's codes).
- :func:`hostile_round`: malformed and hostile requests over both front ends, each
  expected to be refused with a client error while the router keeps serving.
- :func:`overload_probe`: a burst beyond ``router.max_queued_requests``; how long the
  refused requests took to be refused.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from cluster.client import make_request
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

# HTTP status -> the router's code it stands for (router/http/errors.py), for the tallies.
HTTP_CODES = {
    400: "INVALID_ARGUMENT",
    404: "INVALID_ARGUMENT",  # unknown model / route
    413: "INVALID_ARGUMENT",  # body too large
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    """One prompt with its sampling and the reference answer."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int | None
    token_ids: tuple[int, ...]  # the reference output
    text: str


def build_workload(
    model_dir: str, num_prompts: int, vocab_size: int, seed: int, engine_args: dict
) -> list[Case]:
    """Random prompts (half greedy, half seeded sampling) and the LLM API's answers, each
    computed alone; ``engine_args``: the cluster's ``dtype`` and ``deterministic``."""
    from workers import LLM, SamplingParams

    rng = random.Random(seed)
    specs = []
    for i in range(num_prompts):
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 120)))
        sampled = i % 2 == 1
        specs.append((prompt, rng.randint(4, 24), 0.8 if sampled else 0.0, i if sampled else None))
    llm = LLM(model_dir, max_model_len=512, **engine_args)
    cases = []
    for prompt, max_tokens, temperature, req_seed in specs:
        params = SamplingParams(
            temperature=temperature, seed=req_seed, max_tokens=max_tokens, ignore_eos=True
        )
        (out,) = llm.generate([list(prompt)], params)
        cases.append(
            Case(prompt, max_tokens, temperature, req_seed, tuple(out.token_ids), out.text)
        )
    return cases


@dataclass
class Outcomes:
    """Every steady-load request's class, thread-safe."""

    counts: Counter = field(default_factory=Counter)  # (frontend, outcome) -> n
    wrong: list[dict] = field(default_factory=list)  # the first few, for the report
    errors: dict[str, str] = field(default_factory=dict)  # code -> one message
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, frontend: str, outcome: str, detail: dict | None = None, message: str = ""):
        with self._lock:
            self.counts[(frontend, outcome)] += 1
            if outcome == "WRONG" and len(self.wrong) < 200:  # each diagnosed at the end
                self.wrong.append({"frontend": frontend, **(detail or {})})
            if outcome.startswith("error:") and message:
                self.errors.setdefault(outcome, message[:300])

    def total(self, outcome: str | None = None) -> int:
        with self._lock:
            return sum(n for (_, o), n in self.counts.items() if outcome is None or o == outcome)

    def by_outcome(self) -> dict[str, int]:
        with self._lock:
            out: Counter = Counter()
            for (_, o), n in self.counts.items():
                out[o] += n
            return dict(sorted(out.items()))


def grpc_case(stub, case: Case, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[str, dict, str]:
    """Send one case over gRPC: (outcome, detail, error message)."""
    req = make_request(
        list(case.prompt),
        max_tokens=case.max_tokens,
        temperature=case.temperature,
        seed=case.seed,
        ignore_eos=True,
    )
    req.output.return_timing = True  # a WRONG answer's path: which workers, how much KV moved
    tokens: list[int] = []
    timing = None
    try:
        for resp in stub.Generate(req, timeout=timeout_s):
            kind = resp.WhichOneof("kind")
            delta = resp.delta if kind == "delta" else resp.final.delta
            tokens.extend(delta.token_ids)
            if kind == "final":
                timing = resp.final.timing
    except grpc.RpcError as exc:
        return f"error:{exc.code().name}", {}, exc.details() or ""
    if tuple(tokens) == case.token_ids:
        return "equal", {}, ""
    detail = {"case": case, "expected": list(case.token_ids), "got": tokens}
    if timing is not None:
        detail["path"] = {
            "prefill_worker": timing.prefill_worker or "(local)",
            "decode_worker": timing.decode_worker,
            "kv_transfer_bytes": timing.kv_transfer_bytes,
            "kv_transfer_seconds": round(timing.kv_transfer_seconds, 4),
        }
    return "WRONG", detail, ""


def http_post(base: str, path: str, body: bytes, timeout_s: float = REQUEST_TIMEOUT_S):
    """POST raw bytes; (status, parsed JSON or None, raw text)."""
    host = base.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    return resp.status, data, raw.decode("utf-8", "replace")


def http_case(base: str, case: Case) -> tuple[str, dict, str]:
    """Send one case to /v1/completions (token-id prompt): compare the text."""
    body = {
        "prompt": list(case.prompt),
        "max_tokens": case.max_tokens,
        "temperature": case.temperature,
        "ignore_eos": True,
    }
    if case.seed is not None:
        body["seed"] = case.seed
    try:
        status, data, raw = http_post(base, "/v1/completions", json.dumps(body).encode())
    except (OSError, http.client.HTTPException) as exc:
        return "error:CONNECTION", {}, f"{type(exc).__name__}: {exc}"
    if status != 200 or data is None:
        return f"error:{HTTP_CODES.get(status, f'HTTP_{status}')}", {}, raw
    text = data["choices"][0]["text"]
    num_tokens = data["usage"]["completion_tokens"]
    if text == case.text and num_tokens == len(case.token_ids):
        return "equal", {}, ""
    return "WRONG", {"expected": case.text, "got": text, "num_tokens": num_tokens}, ""


class SteadyLoad:
    """``concurrency`` client threads, each sending one request after another (a share
    ``http_share`` over HTTP) until :meth:`stop`."""

    def __init__(self, address, http_url, cases, concurrency, http_share, seed):
        self.outcomes = Outcomes()
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(address)
        stub = pb_grpc.InferenceStub(self._channel)
        self._threads = [
            threading.Thread(
                target=self._client,
                args=(stub, http_url, cases, http_share, random.Random(seed + i)),
                daemon=True,
            )
            for i in range(concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def _client(self, stub, http_url, cases, http_share, rng) -> None:
        while not self._stop.is_set():
            case = rng.choice(cases)
            use_http = bool(http_url) and rng.random() < http_share
            start = time.monotonic()
            if use_http:
                outcome, detail, message = http_case(http_url, case)
            else:
                outcome, detail, message = grpc_case(stub, case)
            self.latencies.append(time.monotonic() - start)
            self.outcomes.add("http" if use_http else "grpc", outcome, detail, message)
            if outcome.startswith("error:") and outcome != "error:INVALID_ARGUMENT":
                self._stop.wait(0.2)  # a refused client backs off a little, as real ones do

    def stop(self, timeout_s: float = REQUEST_TIMEOUT_S + 10) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._channel.close()


# ---- hostile requests ------------------------------------------------------------------
def _raw_generate(channel, payload: bytes, timeout_s: float = 10.0) -> str:
    """A Generate call with a hand-made (possibly invalid) protobuf body; its status name."""
    call = channel.unary_stream(
        "/baton.v1.Inference/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    try:
        for _ in call(payload, timeout=timeout_s):
            pass
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def _grpc_hostile(vocab_size: int, rng: random.Random) -> list[tuple[str, object]]:
    """(name, request or raw bytes) of the gRPC hostile mix."""
    valid = list(range(3, 20))
    text_field = pb.GenerateRequest(text="x").SerializeToString()
    huge = "\U0001f600" * 300_000  # 1.2 MB of 4-byte characters, well past max_model_len
    cases: list[tuple[str, object]] = [
        ("top_p=7", make_request(valid, top_p=7.0)),
        ("temperature=-1", make_request(valid, temperature=-1.0)),
        ("top_k=-5", make_request(valid, top_k=-5)),
        ("empty prompt", pb.GenerateRequest()),
        ("token id = vocab", make_request([*valid, vocab_size])),
        ("token id = 2^32-1", make_request([*valid, 2**32 - 1])),
        ("max_tokens=2^32-1", make_request(valid, max_tokens=2**32 - 1)),
        ("huge text prompt", make_request(huge)),
        ("100k stop strings", make_request(valid, stop=["ab"] * 100_000)),
        ("long stop string", make_request(valid, stop=["z" * 200_000])),
        ("random token ids", make_request([rng.randrange(0, 2**31) for _ in range(64)])),
    ]
    # The text field's bytes replaced by invalid UTF-8 (protobuf requires valid UTF-8).
    tag = text_field[: text_field.index(b"x") - 1]
    cases.append(("invalid UTF-8 text", tag + bytes([4]) + b"\xff\xfe\xc0\x80"))
    cases.append(("truncated protobuf", make_request(valid).SerializeToString()[:-3]))
    cases.append(("random bytes", bytes(rng.randrange(256) for _ in range(200))))
    return cases


def _http_hostile(vocab_size: int, rng: random.Random) -> list[tuple[str, str, bytes]]:
    """(name, path, body) of the HTTP hostile mix."""
    ok = {"prompt": [5, 6, 7], "max_tokens": 2}

    def body(**changes) -> bytes:
        return json.dumps({**ok, **changes}).encode()

    return [
        ("not JSON", "/v1/completions", b"{not json"),
        ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe\xc0", "max_tokens": 2}'),
        ("JSON array", "/v1/completions", b"[1, 2, 3]"),
        ("deep nesting", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
        ("huge prompt", "/v1/completions", body(prompt="a" * 2_000_000)),
        ("token id -1", "/v1/completions", body(prompt=[5, -1])),
        ("token id = vocab", "/v1/completions", body(prompt=[5, vocab_size])),
        ("n=1000", "/v1/completions", body(n=1000)),
        ("max_tokens=-5", "/v1/completions", body(max_tokens=-5)),
        ("temperature string", "/v1/completions", body(temperature="hot")),
        ("unknown model", "/v1/completions", body(model="gpt-9")),
        ("logit_bias", "/v1/completions", body(logit_bias={"5": 100})),
        ("empty messages", "/v1/chat/completions", json.dumps({"messages": []}).encode()),
        ("bad role", "/v1/chat/completions", json.dumps({"messages": [{"role": "x"}]}).encode()),
        ("seed 2^70", "/v1/completions", body(seed=2**70)),
        ("random bytes", "/v1/completions", bytes(rng.randrange(256) for _ in range(300))),
    ]


def hostile_round(channel, http_url: str, vocab_size: int, rng: random.Random) -> Counter:
    """Send the whole hostile mix once; ``(frontend, name, outcome)`` -> 1."""
    seen: Counter = Counter()
    for name, req in _grpc_hostile(vocab_size, rng):
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        seen[("grpc", name, _raw_generate(channel, payload))] += 1
    if http_url:
        for name, path, data in _http_hostile(vocab_size, rng):
            try:
                status, _, _ = http_post(http_url, path, data, timeout_s=30.0)
                outcome = str(status)
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
            seen[("http", name, outcome)] += 1
    # A client that goes away mid-stream: the router must abort the request (no leak).
    stub = pb_grpc.InferenceStub(channel)
    call = stub.Generate(make_request([5, 6, 7, 8], max_tokens=200, ignore_eos=True), timeout=30)
    try:
        next(call)
        call.cancel()
        seen[("grpc", "cancel mid-stream", "CANCELLED")] += 1
    except grpc.RpcError as exc:
        seen[("grpc", "cancel mid-stream", exc.code().name)] += 1
    return seen


# ---- overload -----------------------------------------------------------------------------
def overload_probe(
    channel, num_calls: int, num_probes: int = 20, settle_s: float = 1.0
) -> tuple[list[float], list[float], int]:
    """Overload the router: start ``num_calls`` long requests at once, then, while they
    hold the queue, send ``num_probes`` more one after another.

    Returns (seconds each burst refusal took, from its call's start to its end on gRPC's
    thread; seconds each refused probe took, start to RESOURCE_EXHAUSTED; number of burst
    calls not refused). Every call still running is cancelled at the end.
    """
    stub = pb_grpc.InferenceStub(channel)
    req = make_request([5, 6, 7, 8, 9], max_tokens=500, ignore_eos=True)
    burst: list[float] = []
    lock = threading.Lock()
    calls = []

    def on_done(call, start: float) -> None:
        if call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            with lock:
                burst.append(time.monotonic() - start)

    for _ in range(num_calls):
        start = time.monotonic()
        call = stub.Generate(req, timeout=60.0)
        call.add_done_callback(lambda c, start=start: on_done(c, start))
        calls.append(call)
    time.sleep(settle_s)
    probes: list[float] = []
    for _ in range(num_probes):
        start = time.monotonic()
        call = stub.Generate(req, timeout=60.0)
        calls.append(call)
        try:
            next(call)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                probes.append(time.monotonic() - start)
    for call in calls:
        call.cancel()
    with lock:
        return list(burst), probes, num_calls - len(burst)
