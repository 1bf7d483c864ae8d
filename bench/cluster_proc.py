"""A served cluster in a subprocess, for the benches: ``python -m cluster CONFIG`` (or a
module that wraps it) with a Ray instance and a Ray temp dir of its own.

The subprocess' output is kept (``lines``); start-up waits for the ``baton: serving`` line
and records the addresses the serving process prints before it: gRPC (``address``), the
OpenAI HTTP API (``http_url``, when ``router.http_port`` is set) and the metrics endpoints
(``metrics_urls``). :meth:`stop` sends SIGTERM, so the cluster drains.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (for a config key where 0 means "off", not "any")."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServedCluster:
    """``python -m MODULE CONFIG`` from ``tree`` (its ``PYTHONPATH`` and working directory),
    until :meth:`stop`. ``env`` adds to the environment (the Ray workers inherit it)."""

    def __init__(
        self,
        config: dict,
        workdir: Path,
        *,
        tree: Path = ROOT,
        module: str = "cluster",
        env: dict[str, str] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        path = workdir / "cluster.yaml"
        path.write_text(yaml.safe_dump(config))
        self.ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, str(path)],
            cwd=tree,
            env={
                **os.environ,
                "PYTHONPATH": str(tree),
                "RAY_ADDRESS": "local",  # a Ray instance of its own, whatever else runs here
                "RAY_TMPDIR": self.ray_tmp,
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.address = ""
        self.http_url = ""
        self.metrics_urls: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("baton: metrics on "):
                    self.metrics_urls.append(line.split(" on ", 1)[1].strip())
                elif line.startswith("baton: OpenAI API on "):
                    self.http_url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
                elif line.startswith("baton: serving"):  # "... NAME on HOST:PORT (...)"
                    self.address = line.split(" on ", 1)[1].split(" ", 1)[0]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while not ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                shutil.rmtree(self.ray_tmp, ignore_errors=True)
                raise RuntimeError("cluster did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM (the cluster drains), wait; the exit status."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        finally:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


def processes(root: int, prefix: str) -> list[int]:
    """Pids of the processes under ``root`` (itself included) whose command line starts
    with ``prefix`` (Ray names an actor's process ``ray::CLASS``)."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes()[:200].replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        cmdlines[int(entry.name)] = cmd.decode(errors="replace")
    found, todo, seen = [], [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if cmdlines.get(pid, "").startswith(prefix):
            found.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(found)
