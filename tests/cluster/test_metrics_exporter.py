"""The node exporter without Ray: it serves its directory, and a port it cannot take is
an error value naming the config key (Ray would bury a raised one in a traceback)."""

from __future__ import annotations

import socket
import urllib.request

from cluster.metrics_exporter import MetricsExporter


def test_serves_the_node_directory_then_removes_it(tmp_path):
    directory = tmp_path / "node"
    exporter = MetricsExporter(str(directory), "127.0.0.1", 0)
    address, error = exporter.address()
    assert error == "" and address.startswith("127.0.0.1:")
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
    exporter.close()
    assert not directory.exists()


def test_a_taken_port_is_an_error_naming_the_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = MetricsExporter(str(tmp_path / "node"), "127.0.0.1", port)
        assert exporter.address() == [
            "",
            f"metrics.port: cannot listen on 127.0.0.1:{port}: Address already in use",
        ]
        exporter.close()
