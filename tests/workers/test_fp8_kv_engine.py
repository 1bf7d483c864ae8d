"""The engine with an FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``) on a real tiny model.

Disaggregated over real NIXL (two connectors, one prefill and one decode engine) gives the
aggregated FP8 engine's tokens; a prefix-cache hit gives the tokens of a recomputation; a
prefill/decode pair whose KV dtypes differ refuses at the handshake, naming both; the cache
holds the blocks its bytes pay for; no block stays in use.
"""

from __future__ import annotations

import random

import nixl  # noqa: F401  (required: the connectors' NIXL agents; a broken install fails)
import pytest
import torch

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, LayoutMismatchError, create_connector
from workers.engine.cache_sizing import resolve_num_blocks
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.arch_config import ArchConfig

from .test_engine_roles import (
    BS,
    GREEDY,
    aggregated,
    assert_no_blocks_in_use,
    decode_over_connectors,
    prefill,
    run,
    tokens,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8kv")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


def make_engine(model_dir: str, kv_cache_dtype: str = "fp8_e4m3", **kwargs) -> LLMEngine:
    args = dict(
        dtype="float32",
        block_size=BS,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        kv_cache_dtype=kv_cache_dtype,
    )
    args.update(kwargs)
    return LLMEngine(EngineConfig(model=model_dir, **args))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(1000) for _ in range(n)] for n in (3, 9, 16, 33)]


def connector(engine: LLMEngine, name: str, released: list):
    layout = KVLayout.from_tensor(engine.kv_cache, model_id="tiny", num_kv_heads=2)
    config = KVTransferConfig(backend="nixl", transfer_timeout_s=20, lease_seconds=60)
    return create_connector(
        config, layout, engine.kv_cache, name, lambda req, why: released.append(req)
    )


def test_fp8_cache_is_packed_uint8_and_different_from_float_kv(model_dir, prompts):
    engine = make_engine(model_dir)
    assert engine.kv_cache.dtype == torch.uint8
    assert engine.kv_cache.shape == (64, 2, 2, 2, BS, 16 + 4)  # head_dim 16 + a float32 scale
    layout = KVLayout.from_tensor(engine.kv_cache, model_id="tiny", num_kv_heads=2)
    assert (layout.dtype, layout.scale_layout, layout.head_dim) == (
        "float8_e4m3fn",
        "per_token_head_f32",
        16,
    )
    aggregated(engine, prompts, [GREEDY] * len(prompts))
    assert engine.kv_cache.any()  # the KV went into the packed cache
    assert_no_blocks_in_use(engine)


def test_fp8_disaggregated_over_nixl_gives_the_aggregated_tokens(model_dir, prompts):
    agg, p, d = make_engine(model_dir), make_engine(model_dir), make_engine(model_dir)
    params = [GREEDY] * len(prompts)
    want = [tokens(deltas) for deltas in aggregated(agg, prompts, params)]
    assert all(len(set(w)) > 3 for w in want)  # not degenerate

    released: list[str] = []
    p_conn, d_conn = connector(p, "prefill", released), connector(d, "decode", [])
    try:
        d_conn.add_peer(p_conn.metadata())
        p_conn.add_peer(d_conn.metadata())
        held = prefill(p, prompts, params)
        out, moved = decode_over_connectors(p, d, p_conn, d_conn, prompts, held)
        for h, prompt in zip(held, prompts, strict=True):  # uint8 cache: numel is bytes
            assert moved[h.request_id] == -(-len(prompt) // BS) * d.kv_cache[0].numel()
        for h, w in zip(held, want, strict=True):
            assert [h.token_ids[0], *tokens(out[h.request_id])] == w
    finally:
        p_conn.close()
        d_conn.close()
    assert_no_blocks_in_use(agg, p, d)


def test_kv_dtype_mismatch_is_refused_at_handshake_naming_both(model_dir):
    fp8, auto = (
        make_engine(model_dir, num_kv_blocks=16),
        make_engine(model_dir, "auto", num_kv_blocks=16),
    )
    a, b = connector(fp8, "prefill-fp8", []), connector(auto, "decode-auto", [])
    try:
        for local, remote, first, second in ((b, a, "float32", "float8_e4m3fn"),
                                             (a, b, "float8_e4m3fn", "float32")):  # fmt: skip
            with pytest.raises(LayoutMismatchError) as err:
                local.add_peer(remote.metadata())
            message = str(err.value)
            assert f"KV cache local {first}" in message and f"remote {second}" in message
            assert "scale_layout" in message
            assert local.stats().num_peers == 0
    finally:
        a.close()
        b.close()


def test_prefix_cache_hit_on_fp8_blocks_gives_the_recomputed_tokens(model_dir, prompts):
    """A second request reusing the first one's FP8 blocks decodes as a cache-less engine."""
    shared = prompts[3][:24]  # 3 full blocks of 8
    second = [*shared, 7, 8, 9, 10, 11]
    cached, fresh = make_engine(model_dir), make_engine(model_dir, enable_prefix_caching=False)
    aggregated(cached, [[*shared, 1, 2]], [GREEDY])
    rid = cached.add_request(second, GREEDY)
    out = run(cached)
    (want,) = aggregated(fresh, [second], [GREEDY])
    assert tokens(out[rid]) == tokens(want)
    assert out[rid][-1].num_cached_tokens == 24
    assert_no_blocks_in_use(cached, fresh)


def test_cache_sizing_counts_the_packed_fp8_bytes(model_dir):
    arch = ArchConfig.from_model_dir(model_dir)
    cpu = torch.device("cpu")

    def blocks(dtype, kv_cache_dtype):
        config = EngineConfig(
            model=model_dir, kv_cache_memory_gib=0.01, kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=1024, max_num_batched_tokens=1024, block_size=BS,
        )  # fmt: skip
        return resolve_num_blocks(config, arch, dtype, cpu, 128)

    # Per token, layer, kv head, K/V: 16 values + a 4-byte scale = 20 bytes, against 32
    # (bfloat16) and 64 (float32).
    fp8, bf16, fp32 = (
        blocks(torch.float32, "fp8_e4m3"),
        blocks(torch.bfloat16, "auto"),
        blocks(torch.float32, "auto"),
    )
    per_block = 2 * 2 * 2 * BS  # layers * K/V * kv heads * tokens
    assert fp8 == 0.01 * 2**30 // (per_block * 20)
    assert bf16 == 0.01 * 2**30 // (per_block * 32)
    assert fp32 == 0.01 * 2**30 // (per_block * 64)


def test_checkpoint_static_kv_scales_are_loaded_and_used(tmp_path, prompts):
    """llm-compressor names (layer 0) and AutoFP8's (layer 1, K only): the rows of those
    layers carry the static scale; V of layer 1 keeps its own scale per row."""
    from safetensors.torch import load_file, save_file

    make_model(tmp_path, "qwen2", "tiny", overwrite=True)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.03)
    weights["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.05])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    engine = make_engine(str(tmp_path))
    attns = [layer.self_attn.attn for layer in engine.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attns] == [
        (pytest.approx(0.02), pytest.approx(0.03)),
        (pytest.approx(0.05), None),
    ]
    aggregated(engine, prompts[3:], [GREEDY])
    # [blocks, layers, K/V, heads, tokens]; the cache starts zeroed: 0 = never written.
    scales = engine.kv_cache[..., 16:].contiguous().view(torch.float32)[..., 0]
    used = scales != 0
    assert int(used[:, 0, 0].sum()) == 2 * len(prompts[3]) + 2 * (GREEDY.max_tokens - 1)
    assert bool((scales[:, 0, 0][used[:, 0, 0]] == torch.tensor(0.02)).all())
    assert bool((scales[:, 0, 1][used[:, 0, 1]] == torch.tensor(0.03)).all())
    assert bool((scales[:, 1, 0][used[:, 1, 0]] == torch.tensor(0.05)).all())
    assert len(set(scales[:, 1, 1][used[:, 1, 1]].tolist())) > 1  # its own scale per row

    weights["model.layers.0.self_attn.k_scale"] = torch.tensor([0.02, 0.03])  # per head
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_scale.*one positive number"):
        make_engine(str(tmp_path))
