"""One authentication for both front ends (router/auth.py), TLS (router/tls.py), and a
client that may abort only its own requests; over the real gRPC server and HTTP app, with
scripted workers behind the real router."""

from __future__ import annotations

import ssl

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.tools.make_model import build_tokenizer
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router.auth import ApiKeys, AuthConfigError, Principal
from router.tls import TlsFiles
from tests.pki import make_pki
from tests.router.fuzz_harness import fuzz_router, serve_grpc
from tests.router.http_harness import serve
from tests.router.test_typed_flow import make_router
from workers.text.tokenizer import Tokenizer

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"
KEYS = ApiKeys([(ALICE, Principal("alice", "team-a")), (BOB, Principal("bob", "team-b"))])


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


# ---- the keys ------------------------------------------------------------------------------
def test_keys_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  - {name: alice, key: alice-key-0123456789, tenant: team-a}\n"
        "  - {name: carol, key: carol-key-0123456789}\n"
    )
    env = {"BATON_API_KEYS": "bob=bob-key-0123456789ab", "BATON_API_KEY": "default-key-0123456"}
    keys = ApiKeys.load(path, environ=env)
    assert keys.names == ["alice", "carol", "bob", "default"]
    assert keys.authenticate("Bearer alice-key-0123456789") == Principal("alice", "team-a")
    assert keys.authenticate(b"bearer carol-key-0123456789") == Principal("carol", "carol")
    assert keys.authenticate("Bearer default-key-0123456") == Principal("default", "default")
    for wrong in (None, "", "alice-key-0123456789", "Basic alice-key-0123456789",
                  "Bearer alice-key-012345678", "Bearer alice-key-0123456789x", "Bearer "):  # fmt: skip
        assert keys.authenticate(wrong) is None
    assert ApiKeys.load(None, environ={}) is None  # none at all: open


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("keys: [{name: a, key: short}]", r"keys\[0\] \(a\): an API key must be at least 16"),
        ("keys: [{name: a, key: aaaaaaaaaaaaaaaa, role: admin}]", r"keys\[0\]: expected name"),
        ("keys: {a: b}", "expected a mapping with a list under 'keys'"),
        ("keys: [{name: a, key: aaaaaaaaaaaaaaaa}, {name: a, key: bbbbbbbbbbbbbbbb}]", "unique"),
        ("keys: [{name: a, key: aaaaaaaaaaaaaaaa}, {name: b, key: aaaaaaaaaaaaaaaa}]", "same"),
        (": not yaml: [", "not valid YAML"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_entry(tmp_path, text, error):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(AuthConfigError, match=error):
        ApiKeys.load(path, environ={})


def test_a_bad_environment_entry_is_refused():
    with pytest.raises(AuthConfigError, match="BATON_API_KEYS: entry 1 is not name=key"):
        ApiKeys.load(environ={"BATON_API_KEYS": "a=aaaaaaaaaaaaaaaa,bbbbbbbbbbbbbbbb"})


# ---- gRPC ----------------------------------------------------------------------------------
def generate(stub, key: str | None, request_id: str = "", max_tokens: int = 4, **kw):
    req = pb.GenerateRequest(text="hello", request_id=request_id)
    req.stopping.max_tokens = max_tokens
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return stub.Generate(req, metadata=metadata, **kw)


def test_grpc_needs_a_key_except_health_and_reflection(tokenizer):
    with serve_grpc(fuzz_router(tokenizer), keys=KEYS) as s, grpc.insecure_channel(s.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for key in (None, "wrong-key-0123456789", ALICE[:-1]):
            with pytest.raises(grpc.RpcError) as refused:
                list(generate(stub, key))
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            meta = (("authorization", f"Bearer {key}"),) if key else ()
            for call, request in (
                (stub.GetClusterStatus, pb.GetClusterStatusRequest()),
                (stub.GetModelInfo, pb.GetModelInfoRequest()),
                (stub.Abort, pb.AbortRequest(request_id="x")),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, metadata=meta)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert [m.WhichOneof("kind") for m in generate(stub, ALICE)][-1] == "final"
        auth = (("authorization", f"Bearer {BOB}"),)
        assert stub.GetClusterStatus(pb.GetClusterStatusRequest(), metadata=auth).model == "tiny"
        health = health_pb2_grpc.HealthStub(ch)
        status = health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection.ServerReflectionInfo(iter([ask]))
        names = [svc.name for svc in answer.list_services_response.service]
        assert "baton.v1.Inference" in names


def test_a_client_aborts_only_its_own_requests(tokenizer):
    with serve_grpc(fuzz_router(tokenizer), keys=KEYS) as s, grpc.insecure_channel(s.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        as_bob = (("authorization", f"Bearer {BOB}"),)
        as_alice = (("authorization", f"Bearer {ALICE}"),)
        alices = generate(stub, ALICE, request_id="mine", max_tokens=200)
        next(alices)  # running
        # Another key's request: refused as if there were none (its existence is not told).
        assert not stub.Abort(pb.AbortRequest(request_id="mine"), metadata=as_bob).found
        # Ids are per key: Bob's "mine" is his own request, not "already in use".
        bobs = generate(stub, BOB, request_id="mine", max_tokens=3)
        bob_final = list(bobs)[-1].final
        assert bob_final.finish_reason == pb.FINISH_REASON_LENGTH
        assert bob_final.usage.completion_tokens == 3
        assert stub.Abort(pb.AbortRequest(request_id="mine"), metadata=as_alice).found
        messages = list(alices)
        assert all(m.request_id == "mine" for m in messages)  # the client's id, unscoped
        final = [m for m in messages if m.WhichOneof("kind") == "final"]
        assert final[0].final.finish_reason == pb.FINISH_REASON_ABORT
        # The same key reusing an id in flight is refused.
        again = generate(stub, ALICE, request_id="twice", max_tokens=200)
        next(again)
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(stub, ALICE, request_id="twice"))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "already in use" in refused.value.details()
        again.cancel()


# ---- TLS -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 it signed, and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_grpc_over_tls_and_mutual_tls(tokenizer, pki):
    tls = TlsFiles(str(pki / "server.pem"), str(pki / "server.key"))
    ca = (pki / "ca.pem").read_bytes()
    with serve_grpc(fuzz_router(tokenizer), keys=KEYS, tls=tls) as s:
        with grpc.secure_channel(s.target, grpc.ssl_channel_credentials(ca)) as ch:
            final = list(generate(pb_grpc.InferenceStub(ch), ALICE))[-1]
            assert final.WhichOneof("kind") == "final"
        with grpc.insecure_channel(s.target) as plain:  # plaintext to a TLS port: refused
            with pytest.raises(grpc.RpcError) as refused:
                list(generate(pb_grpc.InferenceStub(plain), ALICE, timeout=5))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    mutual = TlsFiles(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"))
    with serve_grpc(fuzz_router(tokenizer), tls=mutual) as s:
        anonymous = grpc.ssl_channel_credentials(ca)
        with grpc.secure_channel(s.target, anonymous) as ch, pytest.raises(grpc.RpcError):
            list(generate(pb_grpc.InferenceStub(ch), None, timeout=5))
        client = grpc.ssl_channel_credentials(
            ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
        )
        with grpc.secure_channel(s.target, client) as ch:
            assert list(generate(pb_grpc.InferenceStub(ch), None))[-1].WhichOneof("kind")


def test_http_over_tls_with_a_key(tokenizer, pki):
    tls = TlsFiles(str(pki / "server.pem"), str(pki / "server.key"))
    router = make_router(tokenizer)
    with serve(router, keys=KEYS, tls=tls) as s:
        url = s.url.replace("http://", "https://")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        verify = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with httpx.Client(verify=verify, timeout=30) as client:
            refused = client.post(url + "/v1/completions", json=body)
            assert refused.status_code == 401
            ok = client.post(
                url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {BOB}"}
            )
            assert ok.status_code == 200, ok.text
            assert client.get(url + "/health").status_code == 200  # open
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
            httpx.get(s.url + "/health", timeout=5)


# ---- a bug's answer ------------------------------------------------------------------------
def _broken(router):
    def generate(req):
        raise RuntimeError("secret: /srv/models/weights.safetensors at 10.0.0.7")

    router.generate = generate
    return router


def test_a_bug_answers_an_error_id_not_the_exception_text(tokenizer, caplog):
    parts = make_router(tokenizer)
    _broken(parts[0])
    with serve(parts) as s:
        answer = httpx.post(
            s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30
        )
    assert answer.status_code == 500
    message = answer.json()["error"]["message"]
    assert "secret" not in answer.text and message.startswith("internal error ")
    error_id = message.split()[2]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)
    with (
        serve_grpc(_broken(fuzz_router(tokenizer))) as s,
        grpc.insecure_channel(s.target) as ch,
        pytest.raises(grpc.RpcError) as failed,
    ):
        list(generate(pb_grpc.InferenceStub(ch), None))
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in failed.value.details()
    assert failed.value.details().startswith("internal error ")
