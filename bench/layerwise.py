"""Layer-wise vs whole-request KV hand-off: TTFT of one request between two engines.

Two engines in one process (prefill, decode) on a 16-layer random-weight Qwen2 (the
tiny test model's two layers repeated, hidden 64, 2 kv heads of 16: 256 bytes of KV per
token and layer, float32), connected by the in-process backend (``LocalFabric``). TTFT
here is what the issue counts: from the prefill's start until the decode engine holds
every layer of the prompt's KV (it may decode from then on); the first token's own
trip is the same either way.

The machine's compute is made datacenter-like and deterministic: each prefill layer
also sleeps ``--us-per-token-layer`` µs per token of the step (an H100 runs Llama-3-8B
prefill at ~40 µs/token over 32 layers, 1.25 µs per token and layer; here 20 µs). The
link is capped so that moving a layer's KV takes ``--ratio`` of computing it (0.26:
Llama-3-8B's 4 KiB per token and layer over 100 Gb/s, 12.5 GB/s, against 1.25 µs),
with ``--per-transfer-ms`` per transfer (0.5 ms: our NIXL CPU measurement, 32 per-layer
transfers 20-40 ms against ~16 ms for one; docs/kvtransfer.md). "uncapped": no cap,
no fixed cost (an in-process copy).

- whole: prefill, offer, decode pulls every block (today's hand-off);
- layer-wise: decode reserves first; prefill writes each layer group of each chunk as
  its forward pass stores it, with the group size ``choose_layer_groups`` picks from
  the measured numbers (per-layer compute of each chunk from the whole runs, link
  bandwidth and fixed cost fitted on the whole runs' transfers); ``forced``: group
  size 1 whatever the chooser says.

Prediction: ``predict_ttft`` of the measured costs, against the measured medians.

    python -m bench.layerwise --json bench/layerwise.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.layerwise_timeline import TimelinePair
from cluster.tools.make_model import make_model
from kvtransfer import KVConnector, KVLayout, KVTransferConfig
from kvtransfer.layerwise import LayerwiseCost, choose_layer_groups, chunk_costs, predict_ttft
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.protocol.sampling_params import SamplingParams

LAYERS, BS, BUDGET = 16, 16, 2048
LAYER_BYTES = 2 * 2 * 16 * 4  # per token: K and V, 2 kv heads, head dim 16, float32
ONE = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def build_model(path: Path) -> str:
    """The tiny Qwen2 with its two layers repeated to LAYERS, positions up to 16k."""
    make_model(path, "qwen2", "tiny", overwrite=True)
    weights = load_file(str(path / "model.safetensors"))
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for i in range(LAYERS):
        prefix = f"model.layers.{i % 2}."
        for key, value in weights.items():
            if key.startswith(prefix):
                out[f"model.layers.{i}." + key[len(prefix) :]] = value.clone()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, max_position_embeddings=16384)
    config.update(layer_types=["full_attention"] * LAYERS, max_window_layers=LAYERS)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def engine(model: str) -> LLMEngine:
    cfg = EngineConfig(model=model, dtype="float32", block_size=BS, num_kv_blocks=1100,
                       max_model_len=8256, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                       enable_prefix_caching=False)  # fmt: skip
    return LLMEngine(cfg)


def connector(eng: LLMEngine, fabric: LocalFabric, name: str, on_release) -> KVConnector:
    layout = KVLayout.from_tensor(eng.kv_cache, model_id="bench", num_kv_heads=2)
    config = KVTransferConfig(backend="local", direction="pull", transfer_timeout_s=60,
                              lease_seconds=120, active_poll_s=0.0001)  # fmt: skip
    backend = LocalBackend(agent_name_for(name, "1"), eng.kv_cache, layout, fabric)
    return KVConnector(backend, layout, config, name, "1", on_release)


class Pair:
    def __init__(self, model: str, fabric: LocalFabric, *, us_per_token_layer: float):
        self.p, self.d = engine(model), engine(model)
        self.released: list[str] = []
        self.p_conn = connector(self.p, fabric, "p", lambda rid, why: self.released.append(rid))
        self.d_conn = connector(self.d, fabric, "d", lambda rid, why: None)
        self.p_conn.add_peer(self.d_conn.metadata())
        self.d_conn.add_peer(self.p_conn.metadata())
        self.step_ends: list[float] = []  # when each prefill step's last layer ended
        inner = self.p.model.model
        for i, layer in enumerate(inner.layers):
            layer.register_forward_hook(partial(self._compute, i, us_per_token_layer * 1e-6))

    def _compute(self, index, seconds_per_token, _module, args, _output) -> None:
        time.sleep(seconds_per_token * args[1].shape[0])  # args: positions, hidden, ...
        if index == LAYERS - 1:
            self.step_ends.append(time.perf_counter())

    def _decode_until_done(self, rid: str) -> None:
        while self.d.has_unfinished_requests():
            self.d.step()

    def whole(self, rid: str, prompt: list[int]) -> dict:
        self.step_ends.clear()
        t0 = time.perf_counter()
        self.p.add_request(prompt, ONE, rid, prefill_only=True)
        while self.p.has_unfinished_requests():
            (held,) = self.p.step() or (None,)
        chunks_s = [b - a for a, b in zip([t0, *self.step_ends], self.step_ends, strict=False)]
        handle = self.p_conn.offer(rid, held.held_block_ids, num_tokens=len(prompt),
                                   first_token_id=held.token_ids[0])  # fmt: skip
        self.d.add_request(prompt, ONE, rid, remote_first_token=held.token_ids[0])
        self.d.step()
        (receive,) = self.d.take_kv_receives()
        result = self.d_conn.receive([handle], receive.block_ids).result(60)
        ttft = time.perf_counter() - t0
        self.d.kv_received(rid, ok=True)
        self._decode_until_done(rid)
        while rid not in self.released:
            self.p_conn.sync()
        self.p.release_held(rid)
        return {"ttft_s": ttft, "chunks_s": chunks_s, "first": held.token_ids[0],
                "bytes": result.num_bytes, "transfer_s": result.seconds}  # fmt: skip

    def layerwise(self, rid: str, prompt: list[int], first: int, group_size: int) -> dict:
        self.d.add_request(prompt, ONE, rid, remote_first_token=first)
        self.d.step()
        (receive,) = self.d.take_kv_receives()
        reservation, future = self.d_conn.expect_stream(
            rid, receive.block_ids, [self.p_conn.agent_name]
        )
        t0 = time.perf_counter()
        self.p.add_request(prompt, ONE, rid, prefill_only=True)
        sent = self.p_conn.open_stream(rid, [reservation])
        self.p.layerwise.add(rid, group_size, partial(self.p_conn.write_layers, rid))
        while self.p.has_unfinished_requests():
            self.p.step()
        future.result(60)
        ttft = time.perf_counter() - t0
        sent.result(60)
        self.p.layerwise.remove(rid)
        self.p.release_held(rid)
        self.d.kv_received(rid, ok=True)
        self._decode_until_done(rid)
        return {"ttft_s": ttft}

    def close(self) -> None:
        self.p_conn.close()
        self.d_conn.close()


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth, fixed seconds) from (bytes, seconds) of whole transfers: least squares."""
    xs, ys = [b for b, _ in samples], [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return 1.0 / max(slope, 1e-15), max(my - slope * mx, 0.0)


def cost_of(length: int, runs: list[dict], link: tuple[float, float]) -> LayerwiseCost:
    """The request's costs from whole runs: each chunk's compute (median over the runs,
    split evenly over the layers), its blocks' bytes per layer, the fitted link."""
    chunks = [statistics.median(c) for c in zip(*(r["chunks_s"] for r in runs), strict=True)]
    sizes = tuple(min(BUDGET, length - i) for i in range(0, length, BUDGET))
    layer_s = tuple(c / LAYERS for c in chunks)
    _, layer_bytes = chunk_costs(sizes, BS, 0.0, BS * LAYER_BYTES)
    return LayerwiseCost(LAYERS, layer_s, layer_bytes, link[0], link[1])


def run_setting(make_pair, lengths, repeats, ratio, per_transfer_s) -> list[dict]:
    """``ratio`` None: uncapped; else the link is capped, per prompt length, so that the
    whole transfer takes ``ratio`` of the prompt's measured prefill compute."""
    fabric = LocalFabric(per_transfer_s=per_transfer_s if ratio is not None else 0.0)
    pair = make_pair(fabric)
    rng = random.Random(0)
    rows, n = [], 0
    try:
        pair.whole("warm", [rng.randrange(1000) for _ in range(300)])
        for length in lengths:
            prompt = [rng.randrange(1000) for _ in range(length)]
            short = [rng.randrange(1000) for _ in range(BS)]
            # Calibration, as a worker would keep it: compute from a whole run; the link
            # (bandwidth, fixed cost) fitted on two transfers of different sizes.
            fabric.bandwidth = None
            calib = pair.whole(f"c{(n := n + 1)}", prompt)
            if ratio is not None:
                kv_bytes = -(-length // BS) * BS * LAYER_BYTES * LAYERS
                fabric.bandwidth = kv_bytes / (ratio * sum(calib["chunks_s"]))
            calib = pair.whole(f"c{(n := n + 1)}", prompt)
            tiny = pair.whole(f"c{(n := n + 1)}", short)
            link = fit_link([(r["bytes"], r["transfer_s"]) for r in (calib, tiny)])
            plan = choose_layer_groups(cost_of(length, [calib], link))
            first, chosen = calib["first"], plan.group_size
            runs, lw, forced = [], [], []
            for _ in range(repeats):  # interleaved: the machine's noise hits all three
                runs.append(pair.whole(f"w{(n := n + 1)}", prompt))
                if chosen is None:  # the chooser keeps today's hand-off
                    lw.append(runs[-1]["ttft_s"])
                else:
                    lw.append(pair.layerwise(f"l{(n := n + 1)}", prompt, first, chosen)["ttft_s"])
                forced.append(pair.layerwise(f"f{(n := n + 1)}", prompt, first, 1)["ttft_s"])
            cost = cost_of(length, runs, link)  # the prediction: this run's measured costs
            whole, compute = statistics.median(r["ttft_s"] for r in runs), cost.compute_s
            row = {
                "prompt_tokens": length, "group_size": plan.group_size,
                "whole_ms": 1e3 * whole, "chosen_ms": 1e3 * statistics.median(lw),
                "forced_1_ms": 1e3 * statistics.median(forced),
                "compute_ms": 1e3 * compute,
                "exposed_whole_ms": 1e3 * (whole - compute),
                "exposed_chosen_ms": 1e3 * (statistics.median(lw) - compute),
                "exposed_forced_1_ms": 1e3 * (statistics.median(forced) - compute),
                "predicted_whole_ms": 1e3 * predict_ttft(cost, None),
                "predicted_chosen_ms": 1e3 * predict_ttft(cost, plan.group_size),
                "predicted_forced_1_ms": 1e3 * predict_ttft(cost, 1),
                "chooser_predicted_gain": plan.gain,
                "link_mb_per_s": (fabric.bandwidth or 0) / 1e6,
                "link_mb_per_s_fit": link[0] / 1e6, "per_transfer_ms_fit": 1e3 * link[1],
                "whole_runs_ms": [1e3 * r["ttft_s"] for r in runs],
                "chosen_runs_ms": [1e3 * t for t in lw],
                "forced_runs_ms": [1e3 * t for t in forced],
            }  # fmt: skip
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs_ms")}))
            rows.append(row)
    finally:
        pair.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--us-per-token-layer", type=float, default=20.0)
    parser.add_argument("--ratio", type=float, default=0.26)
    parser.add_argument("--per-transfer-ms", type=float, default=0.5)
    parser.add_argument("--settings", default="capped,uncapped")
    parser.add_argument("--engine", action="store_true",
                        help="run the real engines (the forward pass on this CPU, noisy) "
                        "instead of the timeline (the per-layer delay alone)")  # fmt: skip
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch_threads": 1, "us_per_token_layer": args.us_per_token_layer,
              "ratio": args.ratio,
              "per_transfer_ms": args.per_transfer_ms, "load": os.getloadavg()}  # fmt: skip
    result["mode"] = "engine" if args.engine else "timeline"
    with tempfile.TemporaryDirectory() as tmp:
        if args.engine:
            model = build_model(Path(tmp))
            make_pair = partial(Pair, model, us_per_token_layer=args.us_per_token_layer)
        else:
            make_pair = partial(TimelinePair, us=args.us_per_token_layer, layers=LAYERS,
                                block_size=BS, budget=BUDGET)  # fmt: skip
        for setting in args.settings.split(","):
            print(setting)
            ratio = args.ratio if setting == "capped" else None
            per_transfer_s = args.per_transfer_ms / 1e3
            result[setting] = run_setting(make_pair, lengths, args.repeats, ratio, per_transfer_s)
    result["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
