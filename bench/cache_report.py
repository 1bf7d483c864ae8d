"""What a worker's cache report costs: per engine step on the worker, per batch on the
router, with the pool's (G1) hashes as numbered events (issue 37).

    python -m bench.cache_report [--blocks 1024,16384,131072] [--changes 16] [--json OUT]

A real ``BlockManager`` with N cached blocks (distinct prefixes of freed requests) under
the real ``ReportBuilder`` (``workers/serving/worker_report.py``), each report encoded with
the wire codec as the event channel sends it; the router's side is ``decode_as`` and
``WorkerView.update``. Medians of 5 timed batches of calls:

- ``step``: what every engine step pays: a refresh not due, the report, its frame;
- ``refresh_changed``: a due refresh (every ``EVENTS_EVERY_S``) after ``--changes`` hashes
  came and went (half stored, half removed: blocks filled and evicted under decode), with
  the report that carries them;
- ``snapshot``: the report that carries every hash (a new receiver, and every
  ``SNAPSHOT_EVERY_S``): the one O(blocks) path left;
- the router applying a heartbeat, an events report and a snapshot.

Per step and per batch at ``--step-rate`` steps per second (a refresh every
``step_rate x EVENTS_EVERY_S`` steps, a snapshot every ``SNAPSHOT_EVERY_S`` seconds).
bench/router_ceiling.py measured the whole-set reports this replaced
(``bench/router_ceiling_before.json``, "cache_report").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from statistics import median
from types import SimpleNamespace

from router.workers import WorkerView
from workers.engine.block_manager import BlockManager
from workers.protocol.wire import OutputBatch, TokenEvent, decode_as, encode
from workers.serving import tier_report, worker_report
from workers.serving.worker_report import ReportBuilder


def filled(num_cached: int, block_size: int = 16) -> BlockManager:
    """A BlockManager with ``num_cached`` cached blocks (distinct prefixes, freed requests)."""
    bm = BlockManager(num_cached + 1024, block_size)
    rng = random.Random(0)
    per_req = 64
    for r in range(-(-num_cached // per_req)):
        n = min(per_req, num_cached - r * per_req)
        tokens = [rng.randrange(32000) for _ in range(n * block_size)]
        bm.allocate_slots(f"r{r}", 0, len(tokens))
        bm.commit_computed(f"r{r}", tokens, len(tokens))
        bm.free(f"r{r}")
    assert bm.num_cached_blocks == num_cached
    return bm


def per_call_us(fn, min_s: float) -> float:
    """Median over 5 batches of the mean cost of ``fn()`` in microseconds."""
    num, t = 1, 0.0
    while t < min_s / 5:  # calls per batch
        start = time.perf_counter()
        for _ in range(num):
            fn()
        t = time.perf_counter() - start
        num *= 2
    costs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(num):
            fn()
        costs.append((time.perf_counter() - start) / num)
    return 1e6 * median(costs)


def cache_report(num_cached: int, step_rate: float, min_s: float, changes: int = 16) -> dict:
    bm = filled(num_cached)
    engine = SimpleNamespace(  # what ReportBuilder reads of an LLMEngine
        scheduler=SimpleNamespace(running=[], waiting=[]),
        block_manager=bm,
        spec_stats=SimpleNamespace(num_steps=0, num_draft_tokens=0, num_accepted_tokens=0),
        num_receiving=0,
        num_held=0,
        kv_tiers=None,
    )
    builder = ReportBuilder(engine, "decode-0", "decode")
    event = (TokenEvent("r", (7,), False),)
    view = WorkerView(SimpleNamespace(name="decode-0", role="decode"))

    def snapshot_reports() -> list[bytes]:
        """A snapshot: the first report, and the ones its rest follows in (a report carries
        at most ``SNAPSHOT_CHUNK`` hashes per source)."""
        builder.resend()
        frames = [encode(OutputBatch(event, builder.next(healthy=True)))]
        while any(builder._events._backlog):
            frames.append(encode(OutputBatch(event, builder.next(healthy=True))))
        return frames

    snapshot = snapshot_reports()
    for frame in snapshot:
        view.update(decode_as(frame, OutputBatch).report)
    assert view.hashes == bm.hashes()
    held = list(bm.hashes())
    fresh = iter(range(-1, -(10**9), -1))  # hashes no block holds

    def step() -> bytes:
        builder.refresh()
        return encode(OutputBatch(event, builder.next(healthy=True)))

    def refresh_changed() -> bytes:
        # What the block manager's hooks record as blocks fill and go (O(1) each).
        for _ in range(changes // 2):
            bm._stored_events.add(next(fresh))
            bm._removed_events.add(held[random.randrange(len(held))])
        builder._checked_at = -worker_report.EVENTS_EVERY_S
        return step()

    plain = step()
    with_events = refresh_changed()

    def router_apply(payload: bytes, renumber: bool):
        def apply():
            report = decode_as(payload, OutputBatch).report
            if renumber:  # as if it followed the last one applied, as on a channel
                view.kv_events_seq = report.kv_events_seq - 1
            view.update(report)

        return apply

    def router_snapshot():
        for frame in snapshot:
            view.update(decode_as(frame, OutputBatch).report)

    out = {
        "cached_blocks": num_cached,
        "changes_per_refresh": changes,
        "step_us": per_call_us(step, min_s),
        "refresh_changed_us": per_call_us(refresh_changed, min_s),
        "report_with_events_bytes": len(with_events),
        "snapshot_us": per_call_us(snapshot_reports, min_s),
        "snapshot_bytes": sum(len(f) for f in snapshot),
        "router_batch_us": per_call_us(router_apply(plain, False), min_s),
        "router_batch_with_events_us": per_call_us(router_apply(with_events, True), min_s),
        "router_snapshot_us": per_call_us(router_snapshot, min_s),
    }
    steps_per_refresh = max(1.0, step_rate * worker_report.EVENTS_EVERY_S)
    steps_per_snapshot = step_rate * tier_report.SNAPSHOT_EVERY_S
    out["worker_us_per_step"] = (
        out["step_us"]
        + (out["refresh_changed_us"] - out["step_us"]) / steps_per_refresh
        + out["snapshot_us"] / steps_per_snapshot
    )
    out["router_us_per_batch"] = (
        out["router_batch_us"]
        + (out["router_batch_with_events_us"] - out["router_batch_us"]) / steps_per_refresh
        + out["router_snapshot_us"] / steps_per_snapshot
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 16384, 131072]
    )
    parser.add_argument("--changes", type=int, default=16)
    parser.add_argument("--step-rate", type=float, default=50.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    doc = {"load_before": os.getloadavg(), "step_rate": args.step_rate, "rows": []}
    for num in args.blocks:
        row = cache_report(num, args.step_rate, 0.5, args.changes)
        doc["rows"].append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    doc["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
