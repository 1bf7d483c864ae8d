"""The engine's prefill and decode roles, handed off in one process on a real tiny model.

A prefill engine (``prefill_only``) holds each prompt's KV blocks; the test copies them into
the blocks a decode engine (``remote_first_token``) allocated for the request, with plain
tensor indexing where the cluster would run a KV transfer. Every path must give exactly the
tokens of one aggregated engine and leave no block in use.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from cluster.tools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.engine.request import FinishReason
from workers.protocol.sampling_params import SamplingParams

BS = 8
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("roles")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    args = dict(
        dtype="float32",
        block_size=BS,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=16,
    )
    args.update(kwargs)
    return LLMEngine(EngineConfig(model=model_dir, **args))


@pytest.fixture(scope="module")
def engines(model_dir):
    """(aggregated, prefill, decode): separate KV caches and block managers."""
    return make_engine(model_dir), make_engine(model_dir), make_engine(model_dir)


@pytest.fixture(scope="module")
def prompts(engines):
    rng = random.Random(3)
    vocab = engines[0].vocab_size
    # Around the block size of 8: inside one block, exactly full blocks, one past them.
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 8, 9, 16, 17, 33)]


def run(engine: LLMEngine) -> dict[str, list[StreamDelta]]:
    deltas: dict[str, list[StreamDelta]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


def tokens(deltas: list[StreamDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_no_blocks_in_use(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
        assert not engine.scheduler.requests and engine.num_held == 0
        assert engine.num_receiving == 0


def aggregated(engine: LLMEngine, prompts, params) -> list[list[StreamDelta]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out = run(engine)
    return [out[i] for i in ids]


def prefill(engine: LLMEngine, prompts, params) -> list[StreamDelta]:
    """The held final delta of each prompt (prefill_only emits nothing else)."""
    ids = [
        engine.add_request(p, sp, prefill_only=True) for p, sp in zip(prompts, params, strict=True)
    ]
    out = run(engine)
    assert engine.num_held == len(ids)
    finals = []
    for request_id, prompt in zip(ids, prompts, strict=True):
        (final,) = out[request_id]
        assert final.finished and final.finish_reason is None and len(final.token_ids) == 1
        assert len(final.held_block_ids) == -(-len(prompt) // BS)
        assert list(final.held_block_ids) == engine.block_manager.block_table(request_id)
        finals.append(final)
    return finals


def decode(
    p: LLMEngine, d: LLMEngine, prompts, params, held: list[StreamDelta], ok: bool = True
) -> dict[str, list[StreamDelta]]:
    """A decode worker's loop: step, start the transfers it asks for, report them done."""
    src_blocks = {h.request_id: h.held_block_ids for h in held}
    for prompt, sp, h in zip(prompts, params, held, strict=True):
        d.add_request(prompt, sp, h.request_id, remote_first_token=h.token_ids[0])
    out: dict[str, list[StreamDelta]] = defaultdict(list)
    while d.has_unfinished_requests():
        for delta in d.step():
            out[delta.request_id].append(delta)
        for receive in d.take_kv_receives():
            request_id, dst = receive.request_id, receive.block_ids
            src = src_blocks.pop(request_id)[receive.first_block :]  # D holds the ones before
            assert len(dst) == len(src)
            if ok:
                d.kv_cache[list(dst)] = p.kv_cache[list(src)]
            assert p.release_held(request_id)  # the prefill side frees once pulled
            d.kv_received(request_id, ok)
    assert not src_blocks
    return out


def decode_over_connectors(
    p: LLMEngine, d: LLMEngine, p_conn, d_conn, prompts, held: list[StreamDelta]
) -> tuple[dict[str, list[StreamDelta]], dict[str, int]]:
    """``decode`` with the blocks moved by real connectors (greedy): the prefill side offers
    each held request, the decode side receives into the blocks its engine asks for.
    Returns each request's deltas and the bytes its transfer moved."""
    handles = {
        h.request_id: p_conn.offer(
            h.request_id,
            list(h.held_block_ids),
            num_tokens=len(prompt),
            first_token_id=h.token_ids[0],
        )
        for h, prompt in zip(held, prompts, strict=True)
    }
    for prompt, h in zip(prompts, held, strict=True):
        d.add_request(prompt, GREEDY, h.request_id, remote_first_token=h.token_ids[0])
    out: dict[str, list[StreamDelta]] = defaultdict(list)
    moved: dict[str, int] = {}
    while d.has_unfinished_requests():
        for delta in d.step():
            out[delta.request_id].append(delta)
        for receive in d.take_kv_receives():
            request_id, dst = receive.request_id, receive.block_ids
            handle = handles[request_id].from_block(receive.first_block)
            moved[request_id] = d_conn.receive([handle], list(dst)).result(timeout=30).num_bytes
            assert p.release_held(request_id)
            d.kv_received(request_id, True)
    return out, moved


@pytest.mark.parametrize("ok", [True, False], ids=["transferred", "recomputed"])
def test_hand_off_gives_the_aggregated_tokens(engines, prompts, ok):
    agg, p, d = engines
    seeded = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=42, presence_penalty=0.5, ignore_eos=True
    )
    prompts = [*prompts, prompts[4]]
    params = [GREEDY] * (len(prompts) - 1) + [seeded]
    agg_out = aggregated(agg, prompts, params)
    want = [tokens(deltas) for deltas in agg_out]
    assert all(len(set(w)) > 3 for w in want)  # not degenerate

    held = prefill(p, prompts, params)
    out = decode(p, d, prompts, params, held, ok=ok)
    for h, w, agg_deltas in zip(held, want, agg_out, strict=True):
        rest = out[h.request_id]
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert [h.token_ids[0], *tokens(rest)] == w  # the first token is not re-emitted
        # Text: what the prefill side released with the first token, then the decode side's.
        assert h.text + "".join(x.text for x in rest) == "".join(x.text for x in agg_deltas)
    assert p.release_held(held[0].request_id) is False  # already released
    assert_no_blocks_in_use(agg, p, d)


def test_abort_while_receiving_keeps_the_blocks_until_kv_received(engines, prompts):
    _, p, d = engines
    (held,) = prefill(p, prompts[3:4], [GREEDY])
    rid = held.request_id
    d.add_request(prompts[3], GREEDY, rid, remote_first_token=held.token_ids[0])
    assert d.step() == []  # only news: the admission into RECEIVING
    (receive,) = d.take_kv_receives()
    dst = receive.block_ids
    # Two prompt blocks: the first may be a hit of D's own cache (an earlier test's).
    assert receive.request_id == rid and receive.first_block + len(dst) == 2
    assert d.num_receiving == 1
    d.abort_request([rid, "unknown"])
    assert d.step() == [] and d.has_unfinished_requests()
    table = d.block_manager.block_table(rid)
    assert table[receive.first_block :] == list(dst)  # a transfer may still be writing
    d.kv_received(rid, ok=True)
    assert d.block_manager.num_used_blocks == 0
    (final,) = d.step()
    assert final.request_id == rid and final.finished and final.token_ids == ()
    assert final.finish_reason is FinishReason.ABORT
    assert not d.has_unfinished_requests()
    with pytest.raises(ValueError, match="not receiving"):
        d.kv_received(rid, ok=True)
    p.abort_request(rid)  # a held id is released by abort too, with no delta
    assert p.num_held == 0 and p.step() == []
    assert_no_blocks_in_use(p, d)


def test_receiving_counts_against_max_num_seqs(model_dir, prompts):
    d = make_engine(model_dir, max_num_seqs=1, max_num_batched_tokens=32)
    d.add_request(prompts[2], GREEDY, "remote", remote_first_token=5)
    d.add_request(prompts[0], GREEDY, "local")
    assert d.step() == []
    assert [r.request_id for r in d.take_kv_receives()] == ["remote"]
    assert d.step() == [] and d.take_kv_receives() == []  # "local" waits for a seat
    d.kv_received("remote", ok=False)
    out = run(d)
    assert len(tokens(out["remote"])) == GREEDY.max_tokens - 1
    assert len(tokens(out["local"])) == GREEDY.max_tokens
    assert_no_blocks_in_use(d)


def test_prefill_only_that_ends_at_the_first_token_finishes_normally(engines, prompts, monkeypatch):
    _, p, _ = engines
    (held,) = prefill(p, prompts[1:2], [GREEDY])
    first = held.token_ids[0]
    assert p.release_held(held.request_id)
    cases = [
        (SamplingParams(max_tokens=1, temperature=0.0), FinishReason.LENGTH),
        (SamplingParams(temperature=0.0, stop_token_ids=[first]), FinishReason.STOP),
        (SamplingParams(temperature=0.0), FinishReason.STOP),  # EOS, patched below
    ]
    for i, (params, reason) in enumerate(cases):
        if i == 2:
            monkeypatch.setattr(p.tokenizer, "eos_token_ids", frozenset({first}))
        rid = p.add_request(prompts[1], params, prefill_only=True)
        (final,) = run(p)[rid]
        assert final.token_ids == (first,) and final.finish_reason is reason
        assert final.held_block_ids is None and p.num_held == 0
    assert_no_blocks_in_use(p)


def test_remote_first_token_that_ends_the_request_is_refused(engines, prompts):
    _, _, d = engines
    with pytest.raises(ValueError, match="already ends the request"):
        d.add_request(prompts[0], SamplingParams(max_tokens=1), remote_first_token=3)
    with pytest.raises(ValueError, match="already ends the request"):
        d.add_request(prompts[0], SamplingParams(stop_token_ids=[3]), remote_first_token=3)
    with pytest.raises(ValueError, match="vocabulary"):
        d.add_request(prompts[0], GREEDY, remote_first_token=10**9)
    with pytest.raises(ValueError, match="exclude"):
        d.add_request(prompts[0], GREEDY, prefill_only=True, remote_first_token=3)
    assert_no_blocks_in_use(d)


def test_detokenize_false_gives_the_same_tokens_and_no_text(model_dir, engines, prompts):
    agg = engines[0]
    quiet = make_engine(model_dir, detokenize=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = aggregated(agg, prompts, [params] * len(prompts))
    got = aggregated(quiet, prompts, [params] * len(prompts))
    assert [tokens(x) for x in got] == [tokens(x) for x in want]
    assert all(d.text == "" for x in got for d in x)
    assert any(d.text for x in want for d in x)
    # Stop strings are the router's to match: the engine runs on to max_tokens.
    stop = "".join(d.text for d in want[0])[2:5]
    stopped = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    (with_text,) = aggregated(agg, prompts[:1], [stopped])
    (without,) = aggregated(quiet, prompts[:1], [stopped])
    assert with_text[-1].stop_reason == stop and len(tokens(with_text)) < 16
    assert tokens(without) == tokens(want[0]) and without[-1].finish_reason is FinishReason.LENGTH
    assert_no_blocks_in_use(agg, quiet)
