"""Stamps inside a served cluster's processes, for bench/serving.py's latency split.

A ``sitecustomize`` (written by the benchmark, put first on the cluster's ``PYTHONPATH``)
patches ``workers.serving.service.EngineService`` and ``router.stream.RequestStream`` as they are
imported, so every process of the cluster records when a request reached a worker, when
a worker's engine loop published tokens and when the router handled them, all on the one
``time.monotonic`` clock of the host. No project file changes for it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

STAMPS_ENV = "BATON_BENCH_STAMPS"

# Imported first by every Python process of the cluster (PYTHONPATH); once
# workers.serving.service or router.stream is imported, this script's install_stamps patches it.
_SITECUSTOMIZE = """\
import importlib.abc, importlib.util, os, sys

class _StampHook(importlib.abc.MetaPathFinder):
    names = {{"workers.serving.service", "router.stream"}}

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        self.names.discard(name)  # the find_spec below must not come back here
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            bench = sys.modules.get("_bench_serving_stamps")
            if bench is None:
                bench_spec = importlib.util.spec_from_file_location("_bench_serving_stamps", {path!r})
                bench = importlib.util.module_from_spec(bench_spec)
                sys.modules["_bench_serving_stamps"] = bench
                bench_spec.loader.exec_module(bench)
            bench.install_stamps(module, os.environ[{env!r}])

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get({env!r}):
    sys.meta_path.insert(0, _StampHook())
"""


def write_sitecustomize(hook_dir: Path) -> None:
    """The hook a cluster process imports first (put ``hook_dir`` on its PYTHONPATH)."""
    text = _SITECUSTOMIZE.format(path=str(Path(__file__).resolve()), env=STAMPS_ENV)
    hook_dir.joinpath("sitecustomize.py").write_text(text)


# A request reached a worker; a worker's engine loop published tokens; the router turned
# a worker's event into the client's message.
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
        with self.lock:
            self.rows.append((kind, request_id, num_tokens, time.monotonic()))

    def _flush(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                rows, self.rows = self.rows, []
            if rows:
                with self.path.open("a") as f:
                    f.write("".join(json.dumps(row) + "\n" for row in rows))


def install_stamps(module, out_dir: str) -> None:
    """In a cluster process: stamp requests and token events as they pass
    ``workers.serving.service.EngineService`` (worker) or ``router.stream.RequestStream`` (router)."""
    rec = _Recorder(Path(out_dir) / f"{module.__name__}-{os.getpid()}.jsonl")
    if module.__name__ == "workers.serving.service":
        cls = module.EngineService
        submit, publish = cls.submit, cls._publish

        def _submit(self, item):
            rec.add(ARRIVE, item.request_id, 0)
            submit(self, item)

        def _publish(self, events):
            for e in events:
                if e.token_ids:
                    rec.add(PUBLISH, e.request_id, len(e.token_ids))
            publish(self, events)

        cls.submit, cls._publish = _submit, _publish
    elif module.__name__ == "router.stream":
        on_event = module.RequestStream.on_event

        def _on_event(self, event):
            if event.token_ids:
                rec.add(ROUTE, self.request_id, len(event.token_ids))
            return on_event(self, event)

        module.RequestStream.on_event = _on_event


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
