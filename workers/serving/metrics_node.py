"""Where a process's Prometheus metrics live: one directory per node, read by one exporter.

A Baton node runs several processes that record metrics (the router, a worker per
replica, ...), but Prometheus should scrape one endpoint per node. prometheus-client's
multiprocess mode does exactly that: every process writes its values into memory-mapped
files under a shared directory (one file per process and kind), and the node's exporter
(``cluster/metrics_exporter.py``) merges them at scrape time: counters and histograms
summed per label set, gauges summed over the *live* processes.

The directory is ``<run root>/<Ray node id>``: one per serving run (two deployments on
one machine never mix) and per Ray node (two Ray nodes on one machine, as in tests,
each export only their own processes).

Why not one HTTP server per process: a pod running four tensor-parallel ranks and a
router would need as many scrape targets, with ports to keep apart.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import tempfile
from collections.abc import Iterator

_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_GAUGE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


def default_root(run_id: str) -> str:
    """A run's metrics root on every node (node-local temporary storage)."""
    return os.path.join(tempfile.gettempdir(), "baton-metrics", run_id)


def node_directory(root: str, node_id: str) -> str:
    """The directory the processes of Ray node ``node_id`` share."""
    return os.path.join(root, node_id)


def record_into(directory: str) -> None:
    """From now on, this process's metric values go to files in ``directory``.

    Call before the first metric value exists (a labelled metric creates its value at
    ``.labels()``); a value created earlier stays in memory and no exporter sees it.
    Calling again with the same directory does nothing; another directory is an error,
    since values already written would be split across two nodes' views.
    """
    from prometheus_client import values

    current = os.environ.get(_ENV)
    if current == directory and getattr(values.ValueClass, "_multiprocess", False):
        return
    if current and current != directory:
        raise RuntimeError(f"this process already records metrics into {current}")
    os.makedirs(directory, exist_ok=True)
    os.environ[_ENV] = directory
    # prometheus-client picks its value class from the environment when it is imported;
    # it may have been imported before the directory was known (Ray imports it early).
    values.ValueClass = values.MultiProcessValue()


class NodeCollector:
    """Collects every process's metrics in one node directory, for the node's exporter.

    Before each collection, the live-gauge files of processes that exited are removed:
    a dead worker's "requests running" must not count forever. Its counters and
    histograms stay (counters never go down; a restarted worker adds to them).
    """

    def __init__(self, directory: str):
        from prometheus_client.multiprocess import MultiProcessCollector

        self.directory = directory
        self._collector = MultiProcessCollector(None, path=directory)

    def collect(self) -> Iterator:
        from prometheus_client.multiprocess import mark_process_dead

        for path in glob.glob(os.path.join(self.directory, "gauge_live*.db")):
            match = _LIVE_GAUGE.search(os.path.basename(path))
            if match is not None and not _is_alive(int(match.group(1))):
                mark_process_dead(int(match.group(1)), self.directory)
        return self._collector.collect()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM  # exists, owned by someone else
    return True
