"""The engine's forward on a GPU against the hardware: a Llama-3-8B-shaped model.

A random-weight model of Llama-3-8B's shape (32 layers, hidden 4096, 32 heads / 8 KV
heads of 128, intermediate 14336, vocabulary 128256), built in place on the device in
bfloat16 (no checkpoint: 16 GB would not be written and read within a GPU loan), run
through the model code the engine runs (``LlamaForCausalLM``, its ``KernelOps``, the
paged KV cache), step by step:

- **decode**: one step of ``--batches`` (1, 16, 64) sequences at ``--context`` (2048)
  tokens each, logits included; against the HBM roofline: the bytes a step must read (every
  weight once + the context's K/V) over the device-copy bandwidth measured in the same run;
- **prefill**: one prompt of ``--prefill`` (4096) tokens; against the bf16 matmul peak
  measured in the same run (MFU: 2 FLOPs per weight per token + attention's matmuls);
- decode with the Triton op set also replayed from a captured CUDA graph
  (``workers/engine/decode_graphs.py``, the engine's default on CUDA: "triton+graphs");
- each with the Triton op set (what CUDA runs) and the PyTorch references (the peer:
  SDPA for prefill, gather + ``bmm`` for decode attention), and with ``model.deterministic``
  (the batch-invariant Triton set and linears).

Times are medians of CUDA-event-timed repeats after warm-up. ``--dry-run`` builds a tiny
model of the same architecture on CPU and runs every step once (CI checks the plumbing:
tests/cluster/test_gpu_check.py).

    python -m bench.gpu_engine --json $OUT/engine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
BLOCK_SIZE = 16


def build_model(config: dict, device: torch.device, ops_name: str):
    """(model, arch) with random weights on ``device`` in bfloat16, the op set named."""
    from kernels import REFERENCE_OPS, deterministic_kernel_ops, get_kernel_ops
    from workers.models.arch_config import ArchConfig
    from workers.models.deterministic import make_batch_invariant
    from workers.models.parallel import ParallelContext
    from workers.models.registry import get_model_class

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(config))
        arch = ArchConfig.from_model_dir(tmp)
    ops = {
        "triton": lambda: get_kernel_ops(device),
        "reference": lambda: REFERENCE_OPS,
        "deterministic": lambda: deterministic_kernel_ops(device),
    }[ops_name]()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = get_model_class(arch.architecture)(arch, ParallelContext(), ops)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
        if ops_name == "deterministic":
            make_batch_invariant(model, torch.bfloat16, use_triton=ops.is_triton)
    return model.eval(), arch


def paged_step(arch, device, query_lens: list[int], seq_lens: list[int], num_decodes: int):
    """(input ids, positions, KV cache, metadata, rows to sample) of one step whose
    sequences hold random K/V in scattered blocks."""
    from kernels.attention_metadata import build_attention_metadata, slot_mapping_for
    from workers.engine.kv_cache import allocate_kv_cache

    gen = torch.Generator().manual_seed(1)
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    kv_cache = allocate_kv_cache(
        num_blocks, arch.num_hidden_layers, arch.num_key_value_heads, BLOCK_SIZE,
        arch.head_dim, torch.bfloat16, device,
    )  # fmt: skip
    kv_cache.normal_(0.0, 1.0)
    slots = slot_mapping_for(query_lens, seq_lens, tables, BLOCK_SIZE)
    metadata = build_attention_metadata(query_lens, seq_lens, tables, slots, num_decodes, device)
    num_tokens = sum(query_lens)
    ids = torch.randint(0, arch.vocab_size, (num_tokens,), generator=gen).to(device)
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    ).to(device)
    last = torch.tensor(list(torch.tensor(query_lens).cumsum(0) - 1), device=device)
    return ids, positions, kv_cache, metadata, last


def time_step(model, step, repeats: int) -> float:
    """Median seconds of one forward + logits (CUDA events on a GPU, wall time on CPU)."""
    ids, positions, kv_cache, metadata, last = step

    def run():
        hidden = model(ids, positions, kv_cache, metadata)
        return model.compute_logits(hidden[last])

    with torch.inference_mode():
        for _ in range(2):
            run()
        times = []
        for _ in range(repeats):
            if kv_cache.is_cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                run()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_graph_step(model, step, max_model_len: int, repeats: int) -> float:
    """Median seconds of the same decode step replayed from a captured graph
    (``workers/engine/decode_graphs.py``, the engine's path), its input copies included;
    launches sized for ``max_model_len`` as the engine sizes them. On CPU (dry run) the
    graph is a plain call again."""
    import numpy as np

    from workers.engine.decode_graphs import DecodeGraphs, cuda_capture
    from workers.engine.step_inputs import StepInputs

    ids, positions, kv_cache, metadata, _last = step
    batch = ids.shape[0]
    capture = cuda_capture(ids.device) if ids.is_cuda else (lambda fn: fn)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, max_model_len, (batch,), ids.device, capture)
    if not graphs.capture_all():
        raise RuntimeError("decode graph capture failed (see the log)")
    inputs = StepInputs(
        input_ids=ids.cpu().numpy(),
        positions=positions.cpu().numpy(),
        slot_mapping=metadata.slot_mapping.cpu().numpy(),
        block_tables=metadata.block_tables.cpu().numpy().astype(np.int32),
        seq_lens=metadata.seq_lens_cpu,
        query_start_loc=tuple(range(batch + 1)),
        num_decodes=batch,
        sample_indices=tuple(range(batch)),
    )
    times = []
    for i in range(repeats + 2):
        if kv_cache.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.run(inputs)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            graphs.run(inputs)
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    return statistics.median(times)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--ops", default="triton,reference,deterministic")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, once")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    config = TINY if dry else LLAMA3_8B
    batches = [int(b) for b in args.batches.split(",")]
    context, prefill_len = (64, 48) if dry else (args.context, args.prefill)
    repeats = 1 if dry else args.repeats
    if dry:
        copy_bw, matmul_peak, device_name = None, None, "cpu (dry run)"
    else:
        from bench.gpu_kernels import copy_bandwidth, matmul_rate

        copy_bw, matmul_peak = copy_bandwidth(device), matmul_rate(device)
        device_name = torch.cuda.get_device_name(device)
    rows = []
    for ops_name in args.ops.split(","):
        if dry and ops_name != "reference":
            continue  # the Triton sets need a GPU (their interpreter runs: tests/kernels)
        model, arch = build_model(config, device, ops_name)
        w_bytes = weight_bytes(model)
        kv_token_bytes = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2
        for batch in batches:
            step = paged_step(arch, device, [1] * batch, [context] * batch, batch)
            seconds = time_step(model, step, repeats)
            moved = w_bytes + batch * context * kv_token_bytes
            variants = [(ops_name, seconds)]
            if ops_name == "triton" or dry:  # the engine's CUDA decode path: graphs
                max_len = 256 if dry else config["max_position_embeddings"]
                graph_s = time_graph_step(model, step, max_len, repeats)
                variants.append((f"{ops_name}+graphs", graph_s))
            for name, secs in variants:
                rows.append({
                    "ops": name, "step": f"decode batch {batch} x {context}",
                    "ms": secs * 1e3, "bytes": moved,
                    "roofline_share": None if copy_bw is None else moved / copy_bw / secs,
                })  # fmt: skip
            del step
        step = paged_step(arch, device, [prefill_len], [prefill_len], 0)
        seconds = time_step(model, step, repeats)
        # 2 FLOPs per decoder-layer weight per token (the LM head multiplies one row), plus
        # attention's two matmuls over the causal half: 2 * 2 * L^2 / 2 * D per head.
        layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
        per_layer = 2 * arch.num_attention_heads * arch.head_dim * prefill_len * prefill_len
        flops = 2 * layer_params * prefill_len + arch.num_hidden_layers * per_layer
        rows.append({
            "ops": ops_name, "step": f"prefill {prefill_len}", "ms": seconds * 1e3,
            "flops": flops, "mfu": None if matmul_peak is None else flops / seconds / matmul_peak,
        })  # fmt: skip
        del model, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = {
        "device": device_name,
        "copy_bandwidth_gb_s": None if copy_bw is None else copy_bw / 1e9,
        "bf16_matmul_tflops": None if matmul_peak is None else matmul_peak / 1e12,
        "model": "Llama-3-8B shape, random weights, bfloat16" if not dry else "tiny (dry run)",
        "rows": rows,
    }
    for row in rows:
        share = row.get("roofline_share") or row.get("mfu")
        print(f"{row['ops']:>13}  {row['step']:<24} {row['ms']:9.2f} ms"
              + ("" if share is None else f"  {share:6.1%}"))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
