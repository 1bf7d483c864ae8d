"""The host and the served cluster for bench/serving.py.

- :class:`Host`: how much CPU *other* processes use (the machine is shared and noisy), and
  the processes of our own tree.
- :class:`Cluster`: ``python -m bench.serving_cluster CONFIG`` in a subprocess with its own
  Ray instance (``RAY_ADDRESS=local``) and Ray temp dir: the cluster's own entry point
  (``cluster.serve.main``, what ``python -m cluster`` runs) with the stamps of
  ``serving_stamps`` installed in the serving process and in every Ray worker.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.cluster_proc import ServedCluster
from bench.serving_stamps import RUNTIME_ENV_HOOK, STAMPS_ENV, install_router_stamps

ROOT = Path(__file__).resolve().parents[1]


# ---- the host: who else uses it --------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, CPU ticks, command line) of every process."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
                cmd = Path(entry.path, "cmdline").read_bytes()[:200].replace(b"\0", b" ")
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2 :].split()
            out[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), cmd.decode())
    return out


def _tree(procs: dict, roots: list[int]) -> set[int]:
    children = defaultdict(list)
    for pid, (ppid, _, _) in procs.items():
        children[ppid].append(pid)
    seen, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children[pid])
    return seen


class Host:
    """Core-seconds used by processes outside ours (this one + the cluster), and Ray
    instances that are not ours."""

    def __init__(self):
        self.roots = [os.getpid()]

    def sample(self) -> tuple[int, int]:
        procs = _procs()
        ours = sum(procs[p][1] for p in _tree(procs, self.roots) if p in procs)
        fields = Path("/proc/stat").read_text().split()[1:9]
        busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # not idle, iowait
        return busy, ours

    def foreign_s(self, start: tuple[int, int]) -> float:
        end = self.sample()
        return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / _TICK)

    def wait_quiet(self, max_wait_s: float, window_s: float = 2.0, cores: float = 0.15) -> float:
        """Wait (at most ``max_wait_s``) for a window in which others use < ``cores``."""
        deadline = time.monotonic() + max_wait_s
        while True:
            start = self.sample()
            time.sleep(window_s)
            load = self.foreign_s(start) / window_s
            if load < cores or time.monotonic() > deadline:
                return load

    def count(self, root: int, needle: str) -> int:
        """Processes under ``root`` whose command line contains ``needle``."""
        procs = _procs()
        return sum(needle in procs[p][2] for p in _tree(procs, [root]) if p in procs)


class Cluster(ServedCluster):
    """The cluster served in a subprocess (``main`` below), with its own Ray temp dir and
    the stamps."""

    def __init__(self, config: dict, workdir: Path):
        self.stamps_dir = workdir / "stamps"
        self.stamps_dir.mkdir()
        env = {
            STAMPS_ENV: str(self.stamps_dir),
            # Ray calls it in the cluster's ray.init: the workers' stamps.
            "RAY_RUNTIME_ENV_HOOK": RUNTIME_ENV_HOOK,
        }
        super().__init__(config, workdir, module="bench.serving_cluster", env=env)


def main() -> int:
    """``python -m bench.serving_cluster CONFIG``: ``python -m cluster CONFIG`` with the
    router's stamps installed first (the workers' come with ``RAY_RUNTIME_ENV_HOOK``)."""
    from cluster.serve import main as serve_main

    install_router_stamps()
    return serve_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
