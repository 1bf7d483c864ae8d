"""Stamps inside a served cluster's processes, for bench/serving.py's latency split.

Every process of the cluster records, on the one ``time.monotonic`` clock of the host, when
a request reached a worker, when a worker sent tokens to the router's event channel and
when the router turned them into the client's message. No project file changes for it:

- the router's process is ``python -m bench.serving_cluster CONFIG`` (the cluster's own
  entry point, ``cluster.serve.main``) after :func:`install_router_stamps`;
- its Ray workers run :func:`install_worker_stamps` at start, as the job's
  ``worker_process_setup_hook``, which :func:`runtime_env_hook` adds to the runtime
  environment of the ``ray.init`` that bring-up calls (Ray calls the function named by
  ``RAY_RUNTIME_ENV_HOOK`` there).

The stamps wrap public methods only: ``WorkerActor.submit`` (arrival),
``ChannelSender.send`` (publish: the batch leaves the worker) and
``RequestStream.on_event`` (route).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

STAMPS_ENV = "BATON_BENCH_STAMPS"  # the directory the cluster's processes write to
RUNTIME_ENV_HOOK = "bench.serving_stamps.runtime_env_hook"  # for RAY_RUNTIME_ENV_HOOK

# A request reached a worker; a worker sent tokens to the router; the router turned a
# worker's event into the client's message.
ARRIVE, PUBLISH, ROUTE = "arrive", "publish", "route"


class _Recorder:
    """Rows appended to a file twice a second by a daemon thread: not on the engine's
    thread, and not only at stop (a worker that does not stop in time is killed)."""

    def __init__(self, path: Path):
        self.lock = threading.Lock()
        self.rows: list[tuple[str, str, int, float]] = []
        self.path = path
        threading.Thread(target=self._flush, daemon=True).start()

    def add(self, kind: str, request_id: str, num_tokens: int) -> None:
        self.add_at(kind, request_id, num_tokens, time.monotonic())

    def add_at(self, kind: str, request_id: str, num_tokens: int, at: float) -> None:
        with self.lock:
            self.rows.append((kind, request_id, num_tokens, at))

    def _flush(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                rows, self.rows = self.rows, []
            if rows:
                with self.path.open("a") as f:
                    f.write("".join(json.dumps(row) + "\n" for row in rows))


def _recorder(role: str) -> _Recorder:
    return _Recorder(Path(os.environ[STAMPS_ENV]) / f"{role}-{os.getpid()}.jsonl")


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """``RAY_RUNTIME_ENV_HOOK``: the cluster's job runtime environment, plus the stamps'
    setup hook for every worker process (Ray calls this inside ``ray.init``)."""
    return {
        **(runtime_env or {}),
        "worker_process_setup_hook": "bench.serving_stamps.install_worker_stamps",
    }


def install_worker_stamps() -> None:
    """In a Ray worker process, at start: stamp the requests a worker actor receives and
    the token events it sends. (Every worker process of the job runs it; only rank 0 of a
    worker replica submits and sends.)"""
    if not os.environ.get(STAMPS_ENV):
        return
    from workers.protocol.wire import WorkItem, decode_as
    from workers.serving.channel import ChannelSender
    from workers.serving.ray_worker import WorkerActor

    rec = _recorder("worker")
    submit, send = WorkerActor.submit, ChannelSender.send

    def stamped_submit(self, item: bytes) -> str:
        at = time.monotonic()
        error = submit(self, item)
        if not error:  # decoded again only now: the stamp's cost stays off the request's path
            rec.add_at(ARRIVE, decode_as(item, WorkItem).request_id, 0, at)
        return error

    def stamped_send(self, batch) -> None:
        for event in batch.events:
            if event.token_ids:
                rec.add(PUBLISH, event.request_id, len(event.token_ids))
        send(self, batch)

    WorkerActor.submit, ChannelSender.send = stamped_submit, stamped_send


def install_router_stamps() -> None:
    """In the serving process, before bring-up: stamp each worker event the router turns
    into a client message."""
    from router.stream import RequestStream

    rec = _recorder("router")
    on_event = RequestStream.on_event

    def stamped_on_event(self, event):
        if event.token_ids:
            rec.add(ROUTE, self.request_id, len(event.token_ids))
        return on_event(self, event)

    RequestStream.on_event = stamped_on_event


class Stamps:
    """The cluster's stamps: per kind, request id -> [(time, tokens)] in time order."""

    def __init__(self, out_dir: Path):
        self.rows: dict[str, dict[str, list]] = {
            k: defaultdict(list) for k in (ARRIVE, PUBLISH, ROUTE)
        }
        for path in out_dir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                kind, request_id, num_tokens, at = json.loads(line)
                self.rows[kind][request_id].append((at, num_tokens))
        for by_request in self.rows.values():
            for values in by_request.values():
                values.sort()

    def arrived(self, request_id: str) -> float | None:
        """When the request reached its first worker."""
        times = self.rows[ARRIVE].get(request_id)
        return times[0][0] if times else None

    def per_chunk(self, kind: str, res: Any) -> list[float] | None:
        """The stamp of each client chunk's last token (None: the token counts differ)."""
        per_token = [at for at, n in self.rows[kind].get(res.request_id, ()) for _ in range(n)]
        if res.error or len(per_token) != len(res.token_ids):
            return None
        ends = [sum(res.counts[: k + 1]) - 1 for k in range(len(res.counts))]
        return [per_token[e] for e in ends]


def wait_for_stamps(out_dir: Path, results: list[Any], timeout_s: float = 10.0) -> Stamps:
    """The stamps once they cover every token the clients received in ``results`` (the
    recorders flush on their own clock); raises TimeoutError naming what is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        stamps = Stamps(out_dir)
        missing = [
            res.request_id
            for res in results
            if not res.error
            and (
                sum(n for _, n in stamps.rows[ROUTE].get(res.request_id, ())) < sum(res.counts)
                or sum(n for _, n in stamps.rows[PUBLISH].get(res.request_id, ())) < sum(res.counts)
            )
        ]
        if not missing:
            return stamps
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete stamps for {len(missing)} requests: {missing[:3]}")
        time.sleep(0.1)  # a poll: the recorders write twice a second
