"""One Prometheus scrape endpoint (``/metrics``) per Ray node that runs Baton processes.

Each endpoint is a small Ray actor pinned to its node (no CPU reserved) that serves the
node's metrics directory (``workers/serving/metrics_node.py``): the router's series on the node
where it runs, each worker replica's on the node that holds it. Bring-up starts one for
every node it placed something on, a restart for a node new to the run.

It listens on ``metrics.host:metrics.port`` of its own node: loopback by default, so a
multi-node deployment sets ``0.0.0.0`` (the Helm chart does) and Prometheus scrapes every
pod on one port. Port 0 takes any free port, printed at start-up (tests, several nodes on
one machine).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from workers.serving.metrics_node import NodeCollector, node_directory

logger = logging.getLogger(__name__)

_TIMEOUT_S = 60.0


class MetricsExporter:
    """The Ray actor: serves one node directory over HTTP until ``close``.

    A port it cannot take is an error *value* (``address``), not an exception: Ray would
    wrap a raising constructor's message in a page of traceback."""

    def __init__(self, directory: str, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._server = None
        self._address, self._error = "", ""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(NodeCollector(directory))
        try:
            self._server, _thread = start_http_server(port, host, registry)
        except OSError as exc:
            self._error = f"metrics.port: cannot listen on {host}:{port}: {exc.strerror}"
            return
        bound = self._server.server_port
        self._address = f"{host}:{bound}"
        if host in ("0.0.0.0", "::"):
            self._address = f"{ray.util.get_node_ip_address()}:{bound}"

    def address(self) -> list[str]:
        """[``HOST:PORT`` where this node's metrics are (``/metrics`` on it), ""], or
        ["", the error] when it could not listen."""
        return [self._address, self._error]

    def close(self) -> None:
        """Stop serving and remove the node directory (the run is over)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.directory, ignore_errors=True)


class NodeExporters:
    """The run's exporters, one per node; ``ensure`` is safe from any thread."""

    def __init__(self, root: str, host: str, port: int, run_id: str):
        self.root = root
        self.host = host
        self.port = port
        self.run_id = run_id
        self._actors: dict[str, object] = {}  # node id -> actor
        self._addresses: dict[str, str] = {}  # node id -> HOST:PORT
        self._lock = threading.Lock()

    def ensure(self, node_ids) -> list[str]:
        """Start an exporter on each of ``node_ids`` that has none; their addresses.

        Raises RuntimeError when one cannot listen (the port is taken on that node)."""
        with self._lock:
            fresh = {}
            for node_id in dict.fromkeys(node_ids):
                if node_id in self._actors:
                    continue
                actor = (
                    ray.remote(MetricsExporter)
                    .options(
                        name=f"baton-{self.run_id}-metrics-{node_id[:12]}",
                        num_cpus=0,
                        max_restarts=-1,  # a crashed endpoint comes back on the same port
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    )
                    .remote(node_directory(self.root, node_id), self.host, self.port)
                )
                self._actors[node_id] = actor
                fresh[node_id] = actor.address.remote()
            started = []
            for node_id, ref in fresh.items():
                try:
                    address, error = ray.get(ref, timeout=_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    error = str(exc).splitlines()[0]  # Ray's errors go on for a page
                if error:  # none is left behind: a later ensure tries this node again
                    _stop([self._actors.pop(node_id)])
                    raise RuntimeError(f"node {node_id[:12]}: {error}")
                self._addresses[node_id] = address
                started.append(address)
            return started

    @property
    def addresses(self) -> dict[str, str]:
        with self._lock:
            return dict(self._addresses)

    def close(self) -> None:
        """Stop every exporter (their node directories go with them)."""
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
        _stop(actors)


def _stop(actors: list) -> None:
    """Close exporter actors (their directories go), then end them."""
    try:
        ray.get([a.close.remote() for a in actors], timeout=_TIMEOUT_S)
    except Exception:
        logger.warning("some metrics exporters did not close", exc_info=True)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            logger.debug("cannot kill a metrics exporter", exc_info=True)


def replica_nodes(placement_group) -> list[str]:
    """The Ray node ids a placed replica's bundles are on."""
    from ray.util import placement_group_table

    table = placement_group_table(placement_group)
    return list(dict.fromkeys(table["bundles_to_node_id"].values()))
