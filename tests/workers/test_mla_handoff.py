"""The latent KV cache of DeepSeek-V3 (multi-head latent attention) handed off and tiered.

A ``baton make-model --arch deepseek-v3`` checkpoint, float32, greedy. Its cache holds one
row of ``kv_lora_rank + qk_rope_head_dim`` per token and layer (``[blocks, layers, 1, 1,
block_size, row]``, docs/mla.md). What must hold:

- the connector describes it (one entry, one replicated head) and a K/V layout of the same
  model refuses it at the handshake, naming ``num_kv_entries``;
- prefill -> decode over real NIXL (two engines, two connectors, one process) gives the
  aggregated engine's tokens, and the bytes moved are the latent's only:
  ``(kv_lora_rank + qk_rope_head_dim) x 4 bytes x layers`` per token of each block;
- through the router (in-process cluster, the local backend), disaggregated equals
  ``LLM.generate`` token for token;
- latent blocks offloaded to the disk tier and onboarded give the same tokens;
- no block stays in use anywhere.
"""

from __future__ import annotations

import random

import nixl  # noqa: F401  (required: the connectors' NIXL agents; a broken install fails)
import pytest

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, LayoutMismatchError, create_connector
from proto.baton.v1 import inference_pb2 as pb
from tests.router.test_router_flow import LONG_PREFIX, Cluster, collect, req, run
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine

from .test_engine_roles import (
    BS,
    GREEDY,
    aggregated,
    assert_no_blocks_in_use,
    decode_over_connectors,
    prefill,
    tokens,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("mla-handoff"), "deepseek-v3", "tiny"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(1000) for _ in range(n)] for n in (3, 9, 16, 33)]


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    args = dict(
        dtype="float32",
        block_size=BS,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=16,
    )
    return LLMEngine(EngineConfig(model=model_dir, **(args | kwargs)))


def layout_of(engine: LLMEngine) -> KVLayout:
    return KVLayout.from_tensor(
        engine.kv_cache, model_id="mla", num_kv_heads=engine.arch.kv_cache_heads
    )


def connector(engine: LLMEngine, name: str, released: list):
    config = KVTransferConfig(backend="nixl", transfer_timeout_s=20, lease_seconds=60)
    return create_connector(
        config, layout_of(engine), engine.kv_cache, name, lambda req, why: released.append(req)
    )


def latent_bytes_per_token(engine: LLMEngine) -> int:
    """float32: R + P values of 4 bytes; FP8: R + P bytes and a 4-byte scale (per layer)."""
    ds = engine.arch.deepseek
    row = ds.kv_lora_rank + ds.qk_rope_head_dim
    is_fp8 = engine.config.kv_cache_dtype == "fp8_e4m3"
    return (row + 4 if is_fp8 else row * 4) * engine.arch.num_hidden_layers


def test_the_layout_describes_one_latent_row_and_refuses_a_kv_pair(model_dir):
    engine = make_engine(model_dir)
    layout = layout_of(engine)
    ds = engine.arch.deepseek
    assert (layout.num_kv_entries, layout.num_kv_heads, layout.head_dim) == (
        1,
        1,
        ds.kv_lora_rank + ds.qk_rope_head_dim,
    )
    assert layout.is_latent and layout.num_kv_heads_local == 1
    assert layout.bytes_per_token == latent_bytes_per_token(engine)
    assert layout.block_bytes == engine.kv_cache[0].numel() * 4
    # The same geometry stored as K and V (a model without MLA) must not exchange with it.
    pair_cache = engine.kv_cache.new_zeros((4, 2, 2, 1, BS, layout.head_dim // 2))
    pair = KVLayout.from_tensor(pair_cache, model_id="mla", num_kv_heads=1)
    assert pair.block_bytes == layout.block_bytes and pair.fingerprint != layout.fingerprint
    a = connector(engine, "latent", [])
    b = create_connector(
        KVTransferConfig(backend="nixl"),
        pair,
        pair_cache,
        "pair",
        lambda *_: None,
    )
    try:
        with pytest.raises(LayoutMismatchError, match="num_kv_entries: local 1 != remote 2"):
            a.add_peer(b.metadata())
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_latent_hand_off_over_nixl_gives_the_aggregated_tokens(model_dir, prompts, kv_cache_dtype):
    """float32 latents, and FP8 ones (R + P bytes and a scale per row: the aggregated
    engine reads the same bytes the decode worker receives)."""
    agg, p, d = (make_engine(model_dir, kv_cache_dtype=kv_cache_dtype) for _ in range(3))
    params = [GREEDY] * len(prompts)
    want = [tokens(deltas) for deltas in aggregated(agg, prompts, params)]
    assert all(len(set(w)) > 3 for w in want), want  # not degenerate

    released: list[str] = []
    p_conn, d_conn = connector(p, "prefill", released), connector(d, "decode", [])
    try:
        d_conn.add_peer(p_conn.metadata())
        p_conn.add_peer(d_conn.metadata())
        held = prefill(p, prompts, params)
        out, moved = decode_over_connectors(p, d, p_conn, d_conn, prompts, held)
        for h, w in zip(held, want, strict=True):
            assert [h.token_ids[0], *tokens(out[h.request_id])] == w
    finally:
        p_conn.close()
        d_conn.close()
    # Only the latent moved: its row per token of each whole block, nothing per head.
    per_token = latent_bytes_per_token(d)
    for h, prompt in zip(held, prompts, strict=True):
        assert moved[h.request_id] == -(-len(prompt) // BS) * BS * per_token
    assert_no_blocks_in_use(agg, p, d)


def test_latent_blocks_round_trip_through_the_disk_tier(model_dir, tmp_path):
    """An engine writes its latent blocks down to the disk tier and closes; a restarted
    one onboards the prefix from there: the same tokens, the prefix counted as cached."""
    rng = random.Random(5)
    shared = [rng.randrange(1000) for _ in range(29)]
    prompts = [shared + [rng.randrange(1000) for _ in range(n)] for n in (4, 13)]
    args = dict(dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [list(o.token_ids) for o in LLM(model_dir, **args).generate(prompts, params)]

    first = LLM(model_dir, kv_disk_tier_path=str(tmp_path), **args)
    assert [list(o.token_ids) for o in first.generate(prompts, params)] == want
    num_cached = first.engine.block_manager.evict()  # every full block goes down
    first.engine.kv_tiers.wait_idle()
    (disk,) = [t for t in first.engine.kv_tiers.tiers if t.name == "disk"]
    assert disk.stats().blocks == num_cached > 0
    assert disk.block_bytes == 8 * latent_bytes_per_token(first.engine)  # the latent only
    first.engine.kv_tiers.close()

    again = LLM(model_dir, kv_disk_tier_path=str(tmp_path), **args)  # the restart
    outs = again.generate(prompts, params)
    assert [list(o.token_ids) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [32, 40]  # whole blocks, from the disk
    stats = again.engine.kv_tiers.stats()
    # The 5 distinct blocks at least (admitted in one step, both may onboard a shared one).
    assert stats.onboarded >= 5 and stats.onboard_failed == 0
    manager = again.engine.block_manager
    manager.check_integrity()
    assert manager.num_used_blocks == 0


def test_disaggregated_through_the_router_equals_llm_generate(model_dir):
    prompts = [LONG_PREFIX, "Far beyond the northern hills, " + LONG_PREFIX]
    llm = LLM(model_dir, dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [list(out.token_ids) for out in llm.generate(prompts, params)]
    cluster = Cluster(model_dir, disaggregation="always")
    layout = cluster.services["decode-0"].connector.layout
    assert layout.is_latent

    async def body(router):
        outs = [await collect(router, req(p)) for p in prompts]
        again = await collect(router, req(prompts[0], disaggregation=pb.DISAGGREGATION_NEVER))
        await cluster.settled()
        return outs, again

    outs, again = run(cluster, body)
    assert [out[0] for out in outs] == want and again[0] == want[0]
    assert all(out[2].timing.prefill_worker == "prefill-0" for out in outs)
    decode = cluster.services["decode-0"].engine
    assert decode.handoff.num_receive_blocks > 0
    for service in cluster.services.values():
        engine = service.engine
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
        assert not engine.scheduler.requests and engine.num_held == 0
