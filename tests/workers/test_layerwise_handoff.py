"""The layer-wise hand-off between two engines, on a real tiny model, over the in-process
backend: the decode engine reserves its blocks first, the prefill engine writes each
layer group of each chunk into them as its forward pass stores it.

What must hold, in every combination (group sizes, chunked prompts, several requests in
one batch, FP8 KV, a decode engine holding the prompt's first blocks): exactly the
tokens of one aggregated engine; no block left in use on either side; a transfer that
fails after some groups is recomputed on the decode side with the same tokens, and
still leaves no block in use.
"""

from __future__ import annotations

import random
from functools import partial

import pytest

from cluster.tools.make_model import make_model
from kvtransfer import KVConnector, KVLayout, KVTransferConfig, KVTransferError
from kvtransfer.faults import FaultConfig, FaultyBackend
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for
from workers.engine.llm_engine import LLMEngine
from workers.protocol.sampling_params import SamplingParams

from .test_engine_roles import BS, aggregated, assert_no_blocks_in_use, make_engine, run, tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("layerwise")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    # One block, a partial block, exactly full blocks, and chunked (budget 32 tokens).
    return [[rng.randrange(1000) for _ in range(n)] for n in (5, 16, 29, 47, 70)]


def connector(engine: LLMEngine, fabric, name: str, faults=None) -> KVConnector:
    layout = KVLayout.from_tensor(engine.kv_cache, model_id="tiny", num_kv_heads=2)
    config = KVTransferConfig(backend="local", direction="push", transfer_timeout_s=20)
    agent = agent_name_for(name, "1")
    backend = LocalBackend(agent, engine.kv_cache, layout, fabric)
    if faults is not None:
        backend = FaultyBackend(backend, faults, name)
    return KVConnector(backend, layout, config, name, "1", lambda rid, why: None)


def hand_off(p, d, p_conn, d_conn, prompts, first_tokens, group_size, writes=None):
    """D reserves, P computes and streams, D decodes; returns D's outputs by request.
    ``writes``: filled with each request's (first_block, num_blocks, layers, is_last)."""
    writes = {} if writes is None else writes

    def write(rid, first_block, block_ids, layers, layers_ready, is_last):
        writes.setdefault(rid, []).append((first_block, len(block_ids), layers, is_last))
        p_conn.write_layers(rid, first_block, block_ids, layers, layers_ready, is_last)

    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, first in zip(ids, prompts, first_tokens, strict=True):
        d.add_request(prompt, GREEDY, rid, remote_first_token=first)
    assert d.step() == []  # admission: blocks reserved, nothing computed
    receives = {r.request_id: r for r in d.take_kv_receives()}
    assert sorted(receives) == sorted(ids)
    waits, sent = {}, {}
    for rid, prompt in zip(ids, prompts, strict=True):
        r = receives[rid]
        reservation, waits[rid] = d_conn.expect_stream(
            rid, r.block_ids, [p_conn.agent_name], first_block=r.first_block
        )
        p.add_request(prompt, GREEDY, rid, prefill_only=True)
        sent[rid] = p_conn.open_stream(rid, [reservation])
        p.layerwise.add(rid, group_size, partial(write, rid))
    held = run(p)
    for rid, first in zip(ids, first_tokens, strict=True):
        assert tokens(held[rid]) == [first]  # P samples what D was told
    outcomes = {}
    for rid in ids:
        try:
            outcomes[rid] = sent[rid].result(10) > 0
        except KVTransferError:
            outcomes[rid] = False
        p.layerwise.remove(rid)
        assert p.release_held(rid)  # nothing reads P's blocks any more
    received = {}
    for rid in ids:
        try:
            waits[rid].result(10)
            received[rid] = True
        except KVTransferError:
            received[rid] = False
        d.kv_received(rid, ok=received[rid])  # a failed one is recomputed on D
    assert received == outcomes
    return run(d), received


@pytest.fixture
def pair(model_dir, request):
    settings = dict(getattr(request, "param", {}))
    faults = settings.pop("_faults", None)
    fabric = LocalFabric()
    p, d = make_engine(model_dir, **settings), make_engine(model_dir, **settings)
    p_conn = connector(p, fabric, "p", faults)
    d_conn = connector(d, fabric, "d")
    p_conn.add_peer(d_conn.metadata())
    d_conn.add_peer(p_conn.metadata())
    yield p, d, p_conn, d_conn
    p_conn.close()
    d_conn.close()


@pytest.mark.parametrize("group_size", [1, 2, None])
def test_layer_groups_give_the_tokens_of_one_engine(model_dir, prompts, pair, group_size):
    p, d, p_conn, d_conn = pair
    want = [tokens(o) for o in aggregated(make_engine(model_dir), prompts, [GREEDY] * 5)]
    num_layers = p.kv_cache.shape[1]
    assert num_layers >= 2
    writes = {}
    out, received = hand_off(p, d, p_conn, d_conn, prompts, [w[0] for w in want],
                             group_size or num_layers, writes)  # fmt: skip
    assert all(received.values())
    # Each chunk writes every group of the blocks it completed; the chunks tile the
    # prompt's blocks once; the last write alone says so.
    size = group_size or num_layers
    groups = [(s, min(s + size, num_layers)) for s in range(0, num_layers, size)]
    for rid, prompt in zip(sorted(writes), prompts, strict=True):
        ws = writes[rid]
        assert len(ws) % len(groups) == 0
        chunks = [ws[i : i + len(groups)] for i in range(0, len(ws), len(groups))]
        covered = 0
        for chunk in chunks:
            assert [w[2] for w in chunk] == groups
            assert {(w[0], w[1]) for w in chunk} == {(covered, chunk[0][1])}
            covered += chunk[0][1]
        assert covered == -(-len(prompt) // BS)
        assert [w[3] for w in ws] == [False] * (len(ws) - 1) + [True]
    assert len(writes["r4"]) > len(groups)  # the 70-token prompt went in several chunks
    assert [tokens(out[f"r{i}"]) for i in range(5)] == [w[1:] for w in want]
    assert_no_blocks_in_use(p, d)
    assert p_conn.stats().num_streams == 0 and d_conn.stats().num_streams == 0


def test_fp8_kv(model_dir, prompts):
    fabric = LocalFabric()
    engines = [make_engine(model_dir, kv_cache_dtype="fp8_e4m3") for _ in range(3)]
    want = [tokens(o) for o in aggregated(engines[0], prompts, [GREEDY] * 5)]
    p, d = engines[1:]
    p_conn, d_conn = connector(p, fabric, "p"), connector(d, fabric, "d")
    try:
        p_conn.add_peer(d_conn.metadata())
        d_conn.add_peer(p_conn.metadata())
        out, _ = hand_off(p, d, p_conn, d_conn, prompts, [w[0] for w in want], 1)
        assert [tokens(out[f"r{i}"]) for i in range(5)] == [w[1:] for w in want]
        assert_no_blocks_in_use(p, d)
    finally:
        p_conn.close()
        d_conn.close()


def test_decode_holding_the_prefix_receives_only_the_rest(model_dir, prompts, pair):
    p, d, p_conn, d_conn = pair
    prompt = prompts[4]  # 70 tokens: 8 full blocks and a partial one
    want = tokens(aggregated(make_engine(model_dir), [prompt], [GREEDY])[0])
    aggregated(d, [[*prompt[: 3 * BS], 7]], [GREEDY])  # D caches the first 3 blocks
    before = d.kv_cache.clone()
    writes = {}
    out, received = hand_off(p, d, p_conn, d_conn, [prompt], [want[0]], 2, writes)
    assert received == {"r0": True} and tokens(out["r0"]) == want[1:]
    assert d.handoff.num_reused_blocks == 3  # D reserved blocks 3..8 only
    hit = d.block_manager.find_prefix(prompt)
    assert hit.num_blocks == 8  # what D holds now, the 3 it had among them
    assert (d.kv_cache[list(hit.block_ids[:3])] == before[list(hit.block_ids[:3])]).all()
    assert_no_blocks_in_use(p, d)


@pytest.mark.parametrize("pair", [{"_faults": FaultConfig(fail_every=4)}], indirect=True)
def test_a_failure_after_some_groups_recomputes_and_leaks_no_block(model_dir, prompts, pair):
    p, d, p_conn, d_conn = pair
    want = [tokens(o) for o in aggregated(make_engine(model_dir), prompts, [GREEDY] * 5)]
    out, received = hand_off(p, d, p_conn, d_conn, prompts, [w[0] for w in want], 1)
    assert not all(received.values())  # some streams failed midway ...
    assert [tokens(out[f"r{i}"]) for i in range(5)] == [w[1:] for w in want]  # ... recomputed
    assert_no_blocks_in_use(p, d)
    assert p_conn.stats().num_streams == 0 and d_conn.stats().num_streams == 0
