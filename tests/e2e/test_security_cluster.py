"""A cluster exposed as docs/security.md says: API keys of two tenants and TLS on both
front ends, a certificate made by the test's own CA (Ray, NIXL, disaggregated hand-off).

What must hold, on gRPC and HTTP alike: no key and a wrong key are refused
(UNAUTHENTICATED / 401) and the right key is served; plaintext to the TLS ports gets
nothing; health stays open; a key cannot abort another key's request (it is told there is
none), only its own; a prompt one tenant cached is never a hit for the other tenant (nor
for the same tenant under another ``cache_salt``), while the tenant's own repeat is, and no
block stays in use. The engine-level tier tests (tests/workers/kv_tiers/test_cache_salt.py)
and tests/router/test_peer_prefix.py show the same isolation in the host and disk tiers and
in peer pull.
"""

from __future__ import annotations

import ssl
import threading

import grpc
import httpx2 as httpx
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import yaml

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster
from tests.e2e.test_cluster import wait_blocks_released
from tests.pki import make_pki

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
WRONG = "mallory-key-0123456789abcdef"
LONG = "The committee met on a grey morning to settle the budget for the coming year. " * 3


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("secured")
    pki = make_pki(root)
    keys = root / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "alice", "key": ALICE, "tenant": "team-a"},
                    {"name": "bob", "key": BOB, "tenant": "team-b"},
                ]
            }
        )
    )
    keys.chmod(0o600)
    port = free_port()
    config = cluster_config(
        tiny_model_dir,
        http_port=port,
        api_keys_file=str(keys),
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
    )
    served = start_cluster(config, root)
    ca = (pki / "ca.pem").read_bytes()
    channel = grpc.secure_channel(served.address, grpc.ssl_channel_credentials(ca))
    yield served, pb_grpc.InferenceStub(channel), f"https://127.0.0.1:{port}", pki
    channel.close()
    code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]


def as_key(key: str | None) -> tuple:
    return (("authorization", f"Bearer {key}"),) if key else ()


def generate(stub, key, text="Hello there", request_id="", max_tokens=4, salt="", timeout=60):
    req = pb.GenerateRequest(text=text, request_id=request_id, cache_salt=salt)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    req.sampling.temperature = 0.0
    return stub.Generate(req, metadata=as_key(key), timeout=timeout)


def final(stub, key, **kw):
    return list(generate(stub, key, **kw))[-1].final


def test_both_front_ends_serve_only_the_right_key_over_tls(secured):
    served, stub, url, pki = secured
    for key in (None, WRONG, ALICE[:-1]):
        with pytest.raises(grpc.RpcError) as refused:
            final(stub, key)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, key
    assert final(stub, ALICE).usage.completion_tokens == 4
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetClusterStatus(pb.GetClusterStatusRequest(), metadata=as_key(BOB)).pools
    with grpc.insecure_channel(served.address) as plain:  # plaintext to the TLS port
        with pytest.raises(grpc.RpcError) as refused:
            final(pb_grpc.InferenceStub(plain), ALICE, timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4}
    verify = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with httpx.Client(verify=verify, timeout=60) as client:
        for key in (None, WRONG):
            answer = client.post(url + "/v1/completions", json=body, headers=_bearer(key))
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "invalid_api_key"
        answer = client.post(url + "/v1/completions", json=body, headers=_bearer(BOB))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert client.get(url + "/health").status_code == 200  # open
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)


def _bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_a_key_aborts_only_its_own_requests(secured):
    _, stub, _, _ = secured
    stream = generate(stub, ALICE, request_id="mine", max_tokens=400, timeout=120)
    first = next(stream)  # running
    assert first.request_id == "mine"
    rest: list = []
    reader = threading.Thread(target=lambda: rest.extend(stream))
    reader.start()
    refused = stub.Abort(pb.AbortRequest(request_id="mine"), metadata=as_key(BOB))
    assert not refused.found  # another key's: as if there were none
    assert stub.Abort(pb.AbortRequest(request_id="mine"), metadata=as_key(ALICE)).found
    reader.join(60)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].final.usage.completion_tokens < 400


def test_no_cache_hit_across_tenants_or_salts(secured):
    _, stub, _, _ = secured
    cached = {}
    cached["alice"] = final(stub, ALICE, text=LONG).usage.cached_prompt_tokens
    cached["alice again"] = final(stub, ALICE, text=LONG).usage.cached_prompt_tokens
    cached["bob"] = final(stub, BOB, text=LONG).usage.cached_prompt_tokens
    cached["alice, salted"] = final(stub, ALICE, text=LONG, salt="s1").usage.cached_prompt_tokens
    cached["bob again"] = final(stub, BOB, text=LONG).usage.cached_prompt_tokens
    assert cached["alice"] == 0 and cached["alice again"] >= 32, cached
    assert cached["bob"] == 0 and cached["alice, salted"] == 0, cached
    assert cached["bob again"] >= 32, cached  # bob's own cache works
    wait_blocks_released(_Keyed(stub, ALICE))


class _Keyed:
    """The stub with alice's key on every call (wait_blocks_released calls the status)."""

    def __init__(self, stub, key: str):
        self._stub, self._md = stub, as_key(key)

    def GetClusterStatus(self, request, **kw):
        return self._stub.GetClusterStatus(request, metadata=self._md, **kw)
