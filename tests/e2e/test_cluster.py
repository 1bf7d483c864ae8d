"""Whole-cluster tests: real Ray actors, real NIXL transfers, real gRPC, a tiny model.

One cluster (1 prefill + 1 decode worker, ``disaggregation: always``) serves the whole
module; the last test drains it with SIGTERM.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.baton.v1 import inference_pb2 as pb

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    "A longer prompt that crosses several blocks of eight tokens each, to be sure "
    "that the hand-off moves more than one block and a partial last one",
]
TOKEN_PROMPT = [5, 17, 300, 42, 8, 99, 1000, 3, 250, 77, 64]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from workers import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)


def request(prompt, *, max_tokens=24, disaggregation=pb.DISAGGREGATION_UNSPECIFIED, **kw):
    req = pb.GenerateRequest(disaggregation=disaggregation, **kw)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    if "sampling" not in kw:
        req.sampling.temperature = 0.0
    return req


def collect(stub, req, timeout=60):
    """(token ids, text, final) of one streamed request; checks the stream's shape."""
    token_ids, text, final = [], [], None
    for msg in stub.Generate(req, timeout=timeout):
        assert final is None, "nothing may follow the Final"
        kind = msg.WhichOneof("kind")
        body = msg.delta if kind == "delta" else msg.final.delta
        token_ids.extend(body.token_ids)
        text.append(body.text)
        if kind == "final":
            final = msg.final
    assert final is not None, "the stream must end with a Final"
    return token_ids, "".join(text), final


def wait_blocks_released(stub, timeout_s=20.0):
    """Every worker's block accounting back to nothing in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        used = {w.name: w.kv_blocks_used for p in status.pools for w in p.workers}
        if all(v == 0 for v in used.values()):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {used}")
        time.sleep(0.1)


def test_the_ray_instance_baton_started_requires_a_token(cluster):
    """`baton serve` started its own Ray (RAY_ADDRESS=local): its GCS runs with token
    authentication (docs/security.md), whose token only this process tree has."""
    gcs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                if b"gcs_server" in cmd.split(b"\0")[0]:
                    environ = (entry / "environ").read_bytes().split(b"\0")
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    gcs.append((parent, environ))
            except (OSError, ValueError):
                continue
    mine = [env for parent, env in gcs if parent == cluster.process.pid]
    assert mine, "no GCS started by the serving process"
    assert b"RAY_AUTH_MODE=token" in mine[0]
    assert any(v.startswith(b"RAY_AUTH_TOKEN=") and len(v) > 40 for v in mine[0])


def test_stream_of_deltas_then_final_with_usage_and_timing(cluster):
    stub = cluster.stub()
    req = request(PROMPTS[2], max_tokens=12)
    req.output.return_timing = True
    messages = list(stub.Generate(req, timeout=60))
    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds[-1] == "final" and set(kinds[:-1]) == {"delta"} and len(kinds) >= 2
    final = messages[-1].final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    tokens = [t for m in messages[:-1] for t in m.delta.token_ids] + list(final.delta.token_ids)
    assert len(tokens) == final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens > 16
    timing = final.timing
    assert timing.prefill_worker == "prefill-0" and timing.decode_worker == "decode-0"
    assert timing.kv_transfer_bytes > 0 and timing.kv_transfer_seconds > 0
    assert 0 < timing.ttft_seconds <= timing.e2e_seconds
    assert all(m.request_id == messages[0].request_id for m in messages)


@pytest.mark.parametrize("prompt", [*PROMPTS, TOKEN_PROMPT], ids=["fox", "hello", "long", "ids"])
def test_disaggregated_aggregated_and_llm_agree(cluster, llm, prompt):
    from workers import SamplingParams

    stub = cluster.stub()
    disagg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS))
    agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
    ref = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert disagg[0] == agg[0] == list(ref[0].token_ids)
    assert disagg[1] == agg[1] == ref[0].text
    assert disagg[2].finish_reason == agg[2].finish_reason == pb.FINISH_REASON_LENGTH


def test_seeded_sampling_agrees_across_paths(cluster, llm):
    from workers import SamplingParams

    stub = cluster.stub()
    sampling = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    outs = [
        collect(stub, request(PROMPTS[0], sampling=sampling, disaggregation=mode))[0]
        for mode in (pb.DISAGGREGATION_ALWAYS, pb.DISAGGREGATION_NEVER)
    ]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    assert outs[0] == outs[1] == list(llm.generate([PROMPTS[0]], params)[0].token_ids)


def test_decode_worker_receives_only_what_its_prefix_cache_lacks(cluster, llm):
    """The second prompt continues the first: the decode worker holds the first's 6 blocks
    (received then) and pulls only the 3 after them; the tokens are LLM.generate's."""
    from workers import SamplingParams

    stub = cluster.stub()
    first = [(13 * j) % 900 + 4 for j in range(48)]  # 6 blocks of 8
    second = first + [(29 * j) % 700 + 6 for j in range(24)]  # 9 blocks
    timing = pb.OutputOptions(return_timing=True)
    always = pb.DISAGGREGATION_ALWAYS
    _, _, one = collect(stub, request(first, disaggregation=always, output=timing))
    tokens, _, two = collect(stub, request(second, disaggregation=always, output=timing))
    ref = llm.generate([second], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert tokens == list(ref[0].token_ids)
    assert two.usage.cached_prompt_tokens == 48
    assert one.timing.kv_transfer_bytes > 0
    assert two.timing.kv_transfer_bytes * 2 == one.timing.kv_transfer_bytes  # 3 of 6 blocks


def test_32_concurrent_streams(cluster, llm):
    from workers import SamplingParams

    stub = cluster.stub()
    prompts = [f"Request number {i} asks about {'many ' * (i % 7)}things" for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: collect(stub, request(p, max_tokens=16)), prompts))
    refs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [r[0] for r in results] == [list(r.token_ids) for r in refs]
    wait_blocks_released(stub)


def _bad(field, value):
    req = request("hello")
    parent, name = field.split(".")
    setattr(getattr(req, parent), name, value)
    return req


BAD_REQUESTS = {
    "sampling.temperature": _bad("sampling.temperature", -1.0),
    "sampling.top_p": _bad("sampling.top_p", 1.5),
    "sampling.top_k": _bad("sampling.top_k", -5),
    "sampling.min_p": _bad("sampling.min_p", 2.0),
    "sampling.repetition_penalty": _bad("sampling.repetition_penalty", 0.0),
    "sampling.presence_penalty": _bad("sampling.presence_penalty", 3.0),
    "sampling.frequency_penalty": _bad("sampling.frequency_penalty", -3.0),
    "stopping.min_tokens": _bad("stopping.min_tokens", 100),  # > max_tokens (24)
    "output.logprobs": _bad("output.logprobs", 50),
    "stopping.max_tokens": _bad("stopping.max_tokens", 600),  # prompt + 600 > 512
}


@pytest.mark.parametrize("field", sorted(BAD_REQUESTS))
def test_bad_sampling_fields_are_invalid_argument(cluster, field):
    stub = cluster.stub()
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, BAD_REQUESTS[field])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


@pytest.mark.parametrize(
    ("req", "named"),
    [
        (pb.GenerateRequest(text=""), "text"),
        (pb.GenerateRequest(), "prompt"),
        (request("hi", model="no-such-model"), "model"),
        (request([7] * 600), "prompt"),  # longer than max_model_len: oversized
        (request([10**6]), "token_ids"),  # outside the vocabulary
        (request("x" * 3000, max_tokens=1), "prompt"),  # oversized text
    ],
    ids=["empty-text", "no-prompt", "unknown-model", "too-long", "bad-token", "huge-text"],
)
def test_bad_requests_are_invalid_argument_and_server_keeps_serving(cluster, req, named):
    stub = cluster.stub()
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(named)
    tokens, _, final = collect(stub, request("still serving", max_tokens=4))
    assert len(tokens) == 4 and final.finish_reason == pb.FINISH_REASON_LENGTH


def test_cancel_mid_stream_releases_blocks_on_both_workers(cluster):
    stub = cluster.stub()
    for mode in (pb.DISAGGREGATION_ALWAYS, pb.DISAGGREGATION_NEVER):
        call = stub.Generate(request(PROMPTS[2], max_tokens=400, disaggregation=mode), timeout=60)
        seen = 0
        for msg in call:
            seen += len(msg.delta.token_ids)
            if seen >= 3:
                break
        call.cancel()
        status = wait_blocks_released(stub)
        assert all(w.num_running == 0 for p in status.pools for w in p.workers)


def test_abort_rpc_ends_the_stream_and_releases_blocks(cluster):
    stub = cluster.stub()
    req = request(PROMPTS[0], max_tokens=400, request_id="abort-me")
    finals = []

    def consume():
        finals.append(collect(stub, req)[2])

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 30
    while True:  # wait until the request is in flight, then abort it
        found = stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=5).found
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    thread.join(30)
    assert found and finals and finals[0].finish_reason == pb.FINISH_REASON_ABORT
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=5).found
    wait_blocks_released(stub)


def test_deadline_exceeded_releases_blocks(cluster):
    stub = cluster.stub()
    # A deadline of half what the whole request takes on this machine expires while it is
    # generating (a fixed one fell after the end once decode steps got fast).
    started = time.monotonic()
    collect(stub, request(PROMPTS[1], max_tokens=500))
    whole = time.monotonic() - started
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, request(PROMPTS[1], max_tokens=500), timeout=whole / 2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_blocks_released(stub)


def flood(stub, num_requests: int, max_tokens: int) -> list[str]:
    """Send ``num_requests`` at once; each one's status code name ("OK" if it finished).

    The calls wait for each other and then start together, so the router has them all
    before any can finish (each lives for ``max_tokens`` decode steps at least)."""
    codes = []
    start = threading.Barrier(num_requests)

    def one(i):
        start.wait(timeout=30)
        try:
            collect(stub, request(f"flood {i}", max_tokens=max_tokens), timeout=120)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)

    with ThreadPoolExecutor(num_requests) as pool:
        list(pool.map(one, range(num_requests)))
    return codes


def test_queue_overflow_is_resource_exhausted(cluster):
    stub = cluster.stub()
    # Twice the 48 the router admits, each living >= 400 decode steps: on a fast, idle
    # machine 64 requests of 150 tokens were once all finished before the last arrived.
    codes = flood(stub, 96, max_tokens=400)
    assert "RESOURCE_EXHAUSTED" in codes, codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert codes.count("OK") >= 32
    wait_blocks_released(stub)


def test_status_and_model_info(cluster):
    stub = cluster.stub()
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.name == "tiny" and info.max_model_len == 512 and info.vocab_size > 0
    status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
    assert status.kv_transfer_backend == "nixl" and status.policy == "kv_aware"
    pools = {p.role: p for p in status.pools}
    assert pools["prefill"].healthy_replicas == 1 and pools["decode"].healthy_replicas == 1
    assert pools["decode"].workers[0].kv_blocks_total == 1024
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster.address))
    answer = health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Inference"), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(cluster):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    services = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(cluster.address))
    assert {"baton.v1.Inference", "grpc.health.v1.Health"} <= set(services.get_services())


def test_cli_generate_and_status_against_the_cluster(cluster, capsys, llm):
    from cluster import cli
    from workers import SamplingParams

    argv = ["generate", "--target", cluster.address, "--max-tokens", "12", "--temperature", "0"]
    assert cli.main([*argv, "--ignore-eos", "--timing", PROMPTS[0]]) == 0
    out, err = capsys.readouterr()
    ref = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out.rstrip("\n") == ref[0].text
    assert "prefill-0" in err and "decode-0" in err
    assert cli.main(["status", "--target", cluster.address]) == 0
    out = capsys.readouterr().out
    assert "prefill-0" in out and "decode-0" in out and "nixl" in out


def test_sigterm_drains_in_flight_requests_then_exits(cluster):
    """Last in the module: SIGTERM lets a running request finish, refuses new ones, exits 0."""
    stub = cluster.stub()
    results = []
    started = threading.Event()

    def consume():
        tokens = []
        for msg in stub.Generate(request(PROMPTS[0], max_tokens=40), timeout=60):
            tokens.extend(
                msg.delta.token_ids if msg.HasField("delta") else msg.final.delta.token_ids
            )
            started.set()
            if msg.HasField("final"):
                results.append((len(tokens), msg.final.finish_reason))

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(30)
    cluster.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert results == [(40, pb.FINISH_REASON_LENGTH)]
    assert cluster.process.wait(90) == 0
    assert "baton: draining" in cluster.output() and "baton: stopped" in cluster.output()
