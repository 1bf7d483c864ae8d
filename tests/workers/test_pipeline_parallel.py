"""Pipeline parallelism across real processes (gloo on CPU), alone and with TP.

A replica of TP x PP ranks as the cluster runs it: rank 0 (TP rank 0 of the last
stage) schedules, samples and sends each step's inputs to the other ranks; the first
stage embeds the tokens, each stage runs its contiguous range of layers and passes
(hidden, residual) to the next with point-to-point sends, and the last stage's logits
are sampled on rank 0. What must hold, on two architectures whose layers do not split
evenly (3 layers and 5 over 2 stages), one of them with a single KV head (fewer than the
TP ranks: replicated) and tied embeddings (the last stage's LM head without the first
stage's embedding):

- rank 0's greedy tokens equal the single-process engine's and transformers' own,
  through chunked prefill and decode;
- every rank ran one forward pass per step of rank 0;
- each rank builds, loads and keeps KV for its stage's layers only (the embedding on
  the first stage, the final norm and LM head on the last), and no checkpoint tensor
  is read by a stage that does not hold it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cluster.tools.make_model import make_model
from tests.workers.test_batches_in_flight import watch_overlaps
from tests.workers.test_tensor_parallel import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    _config,
    _follow,
    _generate,
    rank0_engine,
)
from workers.engine.llm_engine import LLMEngine
from workers.models import loader
from workers.models.parallel import ParallelContext
from workers.parallel.replica import free_port, join_replica, leave_replica

VOCAB = 1024  # the tiny tokenizer's (copied from a make_model directory)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
MODELS = {
    "llama-3-layers": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    ),
    "qwen2-5-layers-1-kv-head-tied": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    ),
}


def _prompts() -> list[list[int]]:
    # The prompts _generate gives the engines (r0, r1, ...).
    return [
        [(37 * i + 11 * j) % (VOCAB - 1) + 1 for j in range(length)]
        for i, length in enumerate(PROMPT_LENGTHS)
    ]


def _hf_greedy(model) -> dict[str, list[int]]:
    tokens = {}
    with torch.no_grad():
        for i, prompt in enumerate(_prompts()):
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            tokens[f"r{i}"] = ids[len(prompt) :]
    return tokens


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[str, dict[str, list[int]]]:
    """(model directory, transformers' greedy tokens) of a random-weight HF model."""
    root = tmp_path_factory.mktemp(f"pp-{request.param}")
    torch.manual_seed(0)
    hf = MODELS[request.param]().eval()
    with torch.no_grad():  # as tests/workers/test_models.py: everything random, unit-ish
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
    hf.save_pretrained(root / "model")
    tiny = make_model(root / "tiny", "llama", "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, root / "model" / name)
    return str(root / "model"), _hf_greedy(hf)


def _rank_main(rank: int, world: int, pp: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel, link = join_replica(rank, world, "127.0.0.1", port, "cpu", pp_size=pp)
    try:
        if rank == 0:
            ahead: list[int] = []  # batches already in flight when each one was sent
            kv, engine = rank0_engine(
                model_dir, parallel, link, lambda e, _: ahead.append(e.num_in_flight)
            )
            overlaps = watch_overlaps(engine)
            tokens = _generate(engine)
            kv.close()
            result = {"tokens": tokens, "steps": kv.rounds - 1}  # less the stop command
            result["max_ahead"] = max(ahead)
            result["overlaps"] = overlaps
        else:
            engine, steps = _follow(model_dir, parallel, link)
            result = {"steps": steps}
        result["stage"] = [parallel.pp_rank, parallel.tp_rank]
        result["layers"] = list(engine.layer_range)
        result["kv_cache_shape"] = list(engine.kv_cache.shape)
        result["params"] = sorted(name for name, _ in engine.model.named_parameters())
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def _layer_of(param_name: str) -> int | None:
    parts = param_name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["PP2", "TP2xPP2"])
def test_pipeline_ranks_match_the_single_process_engine_and_transformers(model, tp, pp, tmp_path):
    model_dir, hf_tokens = model
    mp.start_processes(
        _rank_main,
        args=(tp * pp, pp, free_port("127.0.0.1"), model_dir, str(tmp_path)),
        nprocs=tp * pp,
        join=True,
        start_method="spawn",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp * pp)]
    assert results[0]["tokens"] == hf_tokens
    assert results[0]["tokens"] == _generate(LLMEngine(_config(model_dir)))
    assert all(len(t) == MAX_TOKENS for t in hf_tokens.values())

    arch = json.loads(Path(model_dir, "config.json").read_text())
    num_layers, kv_heads = arch["num_hidden_layers"], arch["num_key_value_heads"]
    assert results[0]["stage"] == [pp - 1, 0]  # rank 0 runs the last stage
    # One batch per stage in flight: stage 0 runs the next batch while rank 0 the last.
    assert results[0]["max_ahead"] == pp - 1
    # The 45-token prompt (budget 32) had its 2nd chunk sent before its 1st came back.
    assert "r2" in results[0]["overlaps"]
    covered: dict[int, list[int]] = {}  # stage -> its layers
    for rank, result in enumerate(results):
        stage = result["stage"][0]
        start, end = result["layers"]
        assert result["steps"] == results[0]["steps"] > len(PROMPT_LENGTHS), f"rank {rank}"
        # (blocks, layers, K/V, heads, block size, head dim): its layers and heads only.
        assert result["kv_cache_shape"][1:4] == [end - start, 2, max(1, kv_heads // tp)]
        params = result["params"]
        assert {_layer_of(p) for p in params} - {None} == set(range(start, end))
        assert ("model.embed_tokens.weight" in params) == (stage == 0)
        assert ("model.norm.weight" in params) == (stage == pp - 1)
        assert ("lm_head.weight" in params) == (stage == pp - 1 and stage != 0)
        covered[stage] = list(range(start, end))
    # Contiguous ranges, stage after stage, every layer once.
    assert [layer for s in range(pp) for layer in covered[s]] == list(range(num_layers))
    # The uneven split gives the first stage the extra layer.
    first, last = results[-1]["layers"], results[0]["layers"]
    assert first[1] - first[0] == -(-num_layers // pp) and last[1] == num_layers


def test_each_stage_reads_only_its_layers_of_the_checkpoint(model, monkeypatch):
    model_dir, _ = model
    read: dict[str, loader.CheckpointTensor] = {}
    iter_tensors = loader._iter_tensors

    def recording(files):
        for name, tensor in iter_tensors(files):
            read[name] = tensor
            yield name, tensor

    monkeypatch.setattr(loader, "_iter_tensors", recording)
    readers: dict[str, int] = {}
    for stage in range(2):
        model_, _ = loader.load_model(
            model_dir, torch.float32, torch.device("cpu"), ParallelContext(pp_rank=stage, pp_size=2)
        )
        elements = sum(t.elements_read for t in read.values())
        assert elements == sum(p.numel() for p in model_.parameters()), f"stage {stage}"
        for name, tensor in read.items():
            if tensor.elements_read:
                readers[name] = readers.get(name, 0) + 1
                tensor.elements_read = 0
    tied = json.loads(Path(model_dir, "config.json").read_text())["tie_word_embeddings"]
    for name, count in readers.items():
        # Each tensor is read by one stage, but a tied embedding by both (embedding on the
        # first, LM head on the last).
        assert count == (2 if tied and name == "model.embed_tokens.weight" else 1), name
    assert set(readers) == set(read)
