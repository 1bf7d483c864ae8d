"""``model.deterministic`` on the engine, in bfloat16: a sequence's logits are bitwise the
same whatever computed them.

Every sampled row's logits are recorded (``LogitsSpy``, keyed by the tokens the row
follows) and compared to the bit with a reference engine that ran each prompt alone, in
one chunk, without a prefix cache: across the batch a sequence shares, the chunk size,
a prefix-cache hit, blocks onboarded from the host tier, a speculative verify chunk, a
recomputation after migration, a hand-off from a prefill engine over real NIXL, with the
KV cache in bfloat16 and in FP8. With the mode off the same comparison fails (it does
today), so the tests can tell.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import nixl  # noqa: F401  (required: the hand-off's NIXL agents; a broken install fails)
import pytest
import torch

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from workers import LLM, SamplingParams
from workers.engine.llm_engine import LLMEngine

BLOCK = 8
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KV_DTYPES = ["auto", "fp8_e4m3"]


class LogitsSpy:
    """Records the logits of every row an engine samples, keyed by the tokens before it
    (a verify chunk's row j follows the request's tokens and its first j proposals)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.num_verify_rows = 0
        inner = engine._sample

        def sample(live, logits):
            row = 0
            for chunk, req in live:
                for j in range(chunk.num_sample_rows):
                    key = (*req.token_ids, *req.spec_token_ids[:j])
                    self.rows[key] = logits[row].clone()
                    self.num_verify_rows += chunk.num_spec > 0
                    row += 1
            return inner(live, logits)

        engine._sample = sample  # type: ignore[method-assign]


def differing(
    want: LogitsSpy, got: LogitsSpy | SimpleNamespace, *, all_computed: bool = True
) -> tuple[int, int]:
    """(rows of ``want``, how many of them ``got`` computed with different bits or, after
    its tokens diverged, never computed); ``all_computed``: none may be missing."""
    missing = set(want.rows) - set(got.rows)
    assert not (all_computed and missing), f"{len(missing)} rows never computed"
    num_differing = sum(
        not torch.equal(v, got.rows[k]) for k, v in want.rows.items() if k in got.rows
    )
    return len(want.rows), num_differing + len(missing)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("det")
    make_model(path, "llama", "tiny", overwrite=True)
    return str(path)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1000) for _ in range(27)]
    return [shared + [rng.randrange(1000) for _ in range(n)] for n in (5, 40, 73, 110)]


def make_llm(model_dir: str, **kwargs) -> LLM:
    args = dict(
        dtype="bfloat16", deterministic=True, block_size=BLOCK, max_num_batched_tokens=2048,
        max_num_seqs=8, enable_prefix_caching=False,
    )  # fmt: skip
    return LLM(model_dir, **(args | kwargs))


def reference(model_dir: str, kv: str, **kwargs) -> LogitsSpy:
    """Each prompt alone, in one chunk, nothing cached."""
    llm = make_llm(model_dir, kv_cache_dtype=kv, **kwargs)
    spy = LogitsSpy(llm.engine)
    for p in prompts():
        llm.generate([p], GREEDY)
    return spy


def clean(llm: LLM) -> None:
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_batch_and_chunk_size_change_no_bit(model_dir, kv):
    want = reference(model_dir, kv)
    for budget in (8, 13):  # prompts cut into chunks, the batch full of others' chunks
        llm = make_llm(model_dir, kv_cache_dtype=kv, max_num_batched_tokens=budget)
        got = LogitsSpy(llm.engine)
        llm.generate(prompts(), GREEDY)
        assert differing(want, got) == (len(want.rows), 0)
        clean(llm)


def test_with_the_mode_off_chunking_does_change_bits(model_dir):
    """What the tests above guard against, measured: bfloat16 without the mode."""
    want = reference(model_dir, "auto", deterministic=False)
    llm = make_llm(model_dir, deterministic=False, max_num_batched_tokens=13)
    got = LogitsSpy(llm.engine)
    llm.generate(prompts(), GREEDY)
    num_rows, num_differing = differing(want, got, all_computed=False)
    assert num_differing > num_rows // 4


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_prefix_cache_hits_and_host_tier_onboarding_change_no_bit(model_dir, kv):
    want = reference(model_dir, kv)
    llm = make_llm(
        model_dir, kv_cache_dtype=kv, enable_prefix_caching=True, kv_host_tier_gib=1 / 1024
    )
    warm = LogitsSpy(llm.engine)
    llm.generate(prompts(), GREEDY)  # the shared prefix is cached after the first
    assert differing(want, warm) == (len(want.rows), 0)
    hits = LogitsSpy(llm.engine)
    outs = llm.generate(prompts(), GREEDY)  # every full block of every prompt: a hit
    assert all(o.num_cached_tokens >= 27 // BLOCK * BLOCK for o in outs)
    assert differing(want, hits) == (len(want.rows), 0)
    assert llm.engine.block_manager.evict() > 0  # the pool forgets: blocks go to the host tier
    onboarded = LogitsSpy(llm.engine)
    llm.generate(prompts(), GREEDY)
    assert llm.engine.kv_tiers.stats().onboarded > 0
    assert differing(want, onboarded) == (len(want.rows), 0)
    clean(llm)


def test_speculative_verify_rows_equal_decoded_rows(model_dir):
    """N-gram speculation on prompts that repeat themselves: the verify chunks' rows are
    the decodes' rows to the bit, so greedy output is exactly the plain one."""
    rng = random.Random(2)
    motif = [rng.randrange(1000) for _ in range(9)]
    repeating = [motif * 6 + [rng.randrange(1000) for _ in range(n)] for n in (1, 4, 11)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_llm(model_dir)
    want = LogitsSpy(plain.engine)
    want_tokens = [list(o.token_ids) for o in plain.generate(repeating, params)]
    spec = make_llm(model_dir, speculative_method="ngram", speculative_num_tokens=3)
    got = LogitsSpy(spec.engine)
    got_tokens = [list(o.token_ids) for o in spec.generate(repeating, params)]
    assert got.num_verify_rows > 0
    assert got_tokens == want_tokens
    shared = set(want.rows) & set(got.rows)
    assert len(shared) == len(want.rows)
    assert all(torch.equal(want.rows[k], got.rows[k]) for k in shared)
    clean(spec)


def test_recomputation_after_migration_changes_no_bit(model_dir):
    """A migrated request resumes on another engine with its output so far recomputed as
    prompt (``prior_output_token_ids``): its next rows are the uninterrupted ones."""
    want = reference(model_dir, "auto")
    llm = make_llm(model_dir, max_num_batched_tokens=16, enable_prefix_caching=True)
    got = LogitsSpy(llm.engine)
    full = [list(o.token_ids) for o in make_llm(model_dir).generate(prompts(), GREEDY)]
    for p, out in zip(prompts(), full, strict=True):
        llm.engine.add_request(p, GREEDY, prior_output_token_ids=out[:5])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    resumed = {k: v for k, v in want.rows.items() if k in got.rows}
    assert len(resumed) == len(prompts()) * (GREEDY.max_tokens - 5)
    assert all(torch.equal(v, got.rows[k]) for k, v in resumed.items())
    clean(llm)


def _connector(engine: LLMEngine, name: str):
    layout = KVLayout.from_tensor(engine.kv_cache, model_id="det", num_kv_heads=2)
    config = KVTransferConfig(backend="nixl", transfer_timeout_s=20, lease_seconds=60)
    return create_connector(config, layout, engine.kv_cache, name, lambda req, why: None)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_hand_off_over_nixl_changes_no_bit(model_dir, kv):
    """Prefill on one engine (whole batch, chunks of 13), decode on another after a real
    NIXL transfer: every row equals the reference's."""
    want = reference(model_dir, kv)
    p = make_llm(model_dir, kv_cache_dtype=kv, max_num_batched_tokens=13).engine
    d = make_llm(model_dir, kv_cache_dtype=kv, enable_prefix_caching=True).engine
    p_spy, d_spy = LogitsSpy(p), LogitsSpy(d)
    p_conn, d_conn = _connector(p, "prefill"), _connector(d, "decode")
    try:
        d_conn.add_peer(p_conn.metadata())
        p_conn.add_peer(d_conn.metadata())
        held = {}
        for prompt in prompts():
            held[p.add_request(prompt, GREEDY, prefill_only=True)] = prompt
        firsts = {}
        while p.has_unfinished_requests():
            for delta in p.step():
                if delta.held_block_ids:
                    firsts[delta.request_id] = (delta.token_ids[0], list(delta.held_block_ids))
        handles = {}
        for rid, prompt in held.items():
            first, blocks = firsts[rid]
            handles[rid] = p_conn.offer(rid, blocks, num_tokens=len(prompt), first_token_id=first)
            d.add_request(prompt, GREEDY, rid, remote_first_token=first)
        while d.has_unfinished_requests():
            d.step()
            for receive in d.take_kv_receives():
                handle = handles[receive.request_id].from_block(receive.first_block)
                d_conn.receive([handle], list(receive.block_ids)).result(timeout=30)
                assert p.release_held(receive.request_id)
                d.kv_received(receive.request_id, True)
    finally:
        p_conn.close()
        d_conn.close()
    both = SimpleNamespace(rows={**p_spy.rows, **d_spy.rows})  # the first row, then the rest
    assert differing(want, both) == (len(want.rows), 0)
    for engine in (p, d):
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
