"""Data-parallel attention (workers/parallel/dp_group.py) across real gloo processes.

Two ranks, each a whole engine with its own requests and KV cache, their MoE layers'
experts split over both and the tokens exchanged by a data-parallel dispatcher. What must
hold, for Qwen3-MoE (GQA KV cache) and DeepSeek-V3 (MLA latent cache), with both
dispatchers: every request's greedy float32 tokens equal the single-process
``LLM.generate``'s, with the requests split over the ranks and finishing at different
times, and with one rank given no request at all (it keeps the other stepping with empty
forwards); the ranks took the same number of steps; no block is left in use on either
rank; each rank's experts are half the model's; and the group stops when both are idle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm import LLM
from workers.parallel.replica import free_port

# Around the 32-token step budget and the 8-token blocks: chunked prefill, a prompt ending
# mid-block, one on a block boundary. Different lengths of output: the ranks finish apart.
PROMPT_LENGTHS = (5, 16, 45, 30)
MAX_TOKENS = (12, 3, 9, 5)
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_model_len=128,
    block_size=8,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    detokenize=False,
)
# (name, the requests rank 0 runs, rank 1's): split, then rank 1 idle throughout.
SCENARIOS = (("split", (0, 2), (1, 3)), ("one_idle", (0, 1, 2, 3), ()))


def _prompt(i: int, vocab_size: int) -> list[int]:
    return [(37 * i + 11 * j) % (vocab_size - 1) + 1 for j in range(PROMPT_LENGTHS[i])]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


def _rank_main(rank: int, port: int, model_dir: str, kind: str, out_dir: str) -> None:
    from workers.parallel.dp_group import DpEngine, join_dp_group
    from workers.parallel.replica import leave_replica

    torch.set_num_threads(1)
    parallel, lockstep = join_dp_group(rank, 2, "127.0.0.1", port, "cpu")
    try:
        config = EngineConfig(model=model_dir, expert_parallel=2, expert_dispatch=kind, **ENGINE)
        dp = DpEngine(config, parallel, lockstep)
        engine = dp.engine
        result: dict = {"experts": [], "scenarios": {}}
        for block in engine.model.modules():
            if getattr(block, "dispatch", None) is not None:
                result["experts"].append(block.experts.num_local_experts)
        for name, *mine in SCENARIOS:
            tokens: dict[str, list[int]] = {}
            for i in mine[rank]:
                rid = engine.add_request(_prompt(i, engine.vocab_size), _params(i), f"r{i}")
                tokens[rid] = []
            steps0, empty0 = dp.num_steps, dp.num_empty_forwards
            while True:
                for delta in dp.step():
                    tokens[delta.request_id].extend(delta.token_ids)
                if dp.is_idle:
                    break
            engine.block_manager.check_integrity()
            result["scenarios"][name] = {
                "tokens": tokens,
                "steps": dp.num_steps - steps0,
                "empty_forwards": dp.num_empty_forwards - empty0,
                "used_blocks": engine.block_manager.num_used_blocks,
                "kv_cache_shape": list(engine.kv_cache.shape),
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


@pytest.fixture(scope="module", params=["qwen3-moe", "deepseek-v3"])
def moe_model(request, tmp_path_factory):
    """A tiny MoE model (8 experts) and the single-process ``LLM.generate``'s tokens."""
    path = str(make_model(tmp_path_factory.mktemp("dp") / "tiny", request.param, "tiny"))
    llm = LLM(path, **ENGINE)
    vocab = llm.engine.vocab_size
    outs = llm.generate(
        [_prompt(i, vocab) for i in range(len(PROMPT_LENGTHS))],
        [_params(i) for i in range(len(PROMPT_LENGTHS))],
    )
    return path, {f"r{i}": list(out.token_ids) for i, out in enumerate(outs)}


@pytest.mark.parametrize("kind", ["allreduce", "alltoall"])
def test_dp_group_equals_the_single_process_engine(moe_model, kind, tmp_path):
    model_dir, want = moe_model
    mp.start_processes(
        _rank_main,
        args=(free_port("127.0.0.1"), model_dir, kind, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["experts"] and set(r["experts"]) == {4}  # half of the 8 experts each
    for name, *owners in SCENARIOS:
        got = [r["scenarios"][name] for r in ranks]
        for rank, (res, mine) in enumerate(zip(got, owners, strict=True)):
            assert res["tokens"] == {f"r{i}": want[f"r{i}"] for i in mine}, (name, rank)
            assert res["used_blocks"] == 0, (name, rank)
        assert got[0]["steps"] == got[1]["steps"] > 0, name  # lockstep
        if name == "one_idle":
            # The idle rank ran an empty forward for every step its peer computed.
            assert got[1]["empty_forwards"] == got[0]["steps"] - 1 - got[0]["empty_forwards"]
            assert got[1]["empty_forwards"] > 0
        else:  # the rank with the shorter requests finished first and kept stepping
            assert got[1]["empty_forwards"] > 0


# ---- the data-parallel dispatchers alone ----------------------------------------------------

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 24, 20, 2
COUNTS = ((5, 3), (0, 7), (4, 0), (1, 1))  # tokens of (rank 0, rank 1): uneven, idle ranks


def _dispatch_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from kernels.moe import fused_moe, select_experts
    from workers.models.expert_parallel import DpStepTokens, ExpertPlacement, make_dispatcher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(0)  # the same experts on both ranks
        w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
        w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
        placement = ExpertPlacement(NUM_EXPERTS, rank, 2)
        lo, hi = placement.first_expert, placement.first_expert + placement.num_local_experts

        def experts(x, w, i):
            return fused_moe(x, w13[lo:hi], w2[lo:hi], w, i, first_expert=lo)

        tokens = DpStepTokens(2)
        for kind in ("allreduce", "alltoall"):
            dispatch = make_dispatcher(placement, kind, None, tokens)
            for case, counts in enumerate(COUNTS):
                local = torch.Generator().manual_seed(100 * case + rank)  # this rank's own
                hidden = torch.randn(counts[rank], HIDDEN, generator=local)
                logits = torch.randn(counts[rank], NUM_EXPERTS, generator=local)
                weights, ids = select_experts(logits, TOP_K, renormalize=True)
                tokens.num_tokens = counts  # what the lockstep agreed for the step
                out = dispatch(hidden, weights, ids, experts)
                whole = fused_moe(hidden, w13, w2, weights, ids)
                err = (out - whole).abs().max().item() if len(out) else 0.0
                results.put((rank, kind, case, tuple(out.shape), err))
    finally:
        dist.destroy_process_group()


def test_dp_dispatchers_give_each_rank_its_own_tokens_outputs():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_dispatch_rank, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(100)
    assert [proc.exitcode for proc in procs] == [0, 0]
    rows = [results.get(timeout=5) for _ in range(2 * 2 * len(COUNTS))]
    for rank, kind, case, shape, err in rows:
        assert shape == (COUNTS[case][rank], HIDDEN), (rank, kind, case)
        assert err < 1e-5, (rank, kind, case, err)


def test_data_parallel_is_refused_where_it_cannot_apply(tmp_path):
    from workers.models.parallel import ParallelContext
    from workers.parallel.dp_group import DpEngine, check_data_parallel

    moe = EngineConfig(model="unused", expert_parallel=2)
    check_data_parallel(moe, 2)  # accepted
    refusals = [
        (EngineConfig(model="unused", expert_parallel=1), 2, "expert_parallel must equal"),
        (moe, 1, "needs at least 2 ranks"),
        (EngineConfig(model="x", expert_parallel=2, speculative_method="ngram"), 2, "speculative"),
        (EngineConfig(model="x", expert_parallel=2, expert_rebalance_steps=4), 2, "rebalancer"),
    ]
    for config, size, match in refusals:
        with pytest.raises(ValueError, match=match):
            check_data_parallel(config, size)
    with pytest.raises(ValueError, match="one rank per engine"):
        ParallelContext(tp_size=2, dp_rank=0, dp_size=2)
    dense = str(make_model(tmp_path / "dense", "llama", "tiny"))
    config = EngineConfig(model=dense, expert_parallel=2, **ENGINE)
    with pytest.raises(ValueError, match="expert_parallel: LlamaForCausalLM has no experts"):
        DpEngine(config, ParallelContext(dp_rank=0, dp_size=2), None)


# ---- a dead rank ------------------------------------------------------------------------------


def _dying_rank(rank: int, port: int, model_dir: str, results) -> None:
    import os

    from workers.parallel.dp_group import DpEngine, join_dp_group
    from workers.parallel.replica import leave_replica

    torch.set_num_threads(1)
    parallel, lockstep = join_dp_group(rank, 2, "127.0.0.1", port, "cpu")
    config = EngineConfig(model=model_dir, expert_parallel=2, **ENGINE)
    dp = DpEngine(config, parallel, lockstep)
    dp.engine.add_request(_prompt(rank, dp.engine.vocab_size), _params(0), f"r{rank}")
    try:
        for _ in range(3):  # both ranks mid-decode
            dp.step()
        if rank == 1:
            os._exit(0)  # dies without a word: its connections close
        started = time.monotonic()
        try:
            while True:  # its requests still want tokens: the next dispatch needs rank 1
                dp.step()
        except Exception as exc:  # any collective error (gloo raises RuntimeError)
            results.put((type(exc).__name__, time.monotonic() - started))
    finally:
        leave_replica()


def test_a_dead_rank_fails_the_other_ranks_step_at_once(moe_model):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [
        ctx.Process(target=_dying_rank, args=(r, port, moe_model[0], results)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(100)
    assert [proc.exitcode for proc in procs] == [0, 0]
    name, seconds = results.get(timeout=5)
    # Far inside MODEL_GROUP_TIMEOUT_S (60 s): a closed connection, not a deadline.
    assert seconds < 20, (name, seconds)
