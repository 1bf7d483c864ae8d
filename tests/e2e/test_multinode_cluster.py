"""A replica whose pipeline stages run on two Ray nodes.

The Ray cluster has two nodes (``ray.cluster_utils.Cluster``: one raylet each, on this
machine, token authentication on), and only one stage of the prefill pool fits each:
the pool's ``node_resource`` is offered once per node. So the prefill replica (PP=2)
must place a stage on each node, and its activations, its gloo group and its KV agents
cross between them. What must hold:

- the tokens are the single-process engine's, and every KV block is freed;
- the replica's placement group really spans both nodes (its bundles' node ids), and
  each node gets a metrics endpoint;
- the workers' event channels run over TLS (pinned certificate), restarts included;
- killing the stage on the second node takes the replica out of routing, restarts it as
  a unit (both stages, again across the nodes), and the new replica serves the same
  tokens.
"""

from __future__ import annotations

import os
import secrets
import signal

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import wait_blocks_released
from tests.e2e.test_parallel_cluster import (
    _serves_the_reference,
    _wait_restarting,
    _wait_serving,
    actor_processes,
    assert_outputs_and_hand_off,
)

STAGE_SLOT = "baton_test_stage_slot"  # one per node: a prefill stage per node


@pytest.fixture
def two_nodes():
    """A two-node Ray cluster: (cluster, env for the serving process)."""
    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray.cluster_utils import Cluster

    # Token authentication on, as in production: every node and client share the token.
    # This process is a client too (the cluster's state); Ray reads the mode once per
    # process, so it is read again here and after the cluster is gone.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    saved = {key: os.environ.get(key) for key in auth}
    os.environ.update(auth)
    reset_auth_token_state()
    # The nodes use this machine's address (a driver given a loopback address connects
    # to the machine's address instead). No dashboard: nothing here needs it.
    head = {"num_cpus": 2, "resources": {STAGE_SLOT: 1}, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=1, resources={STAGE_SLOT: 1})
        cluster.wait_for_nodes()
        yield cluster, auth | {"RAY_ADDRESS": cluster.address}
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_auth_token_state()


def _raylet_pids(cluster) -> dict[int, str]:
    """Each node's raylet pid -> the node's id."""
    from ray._private import ray_constants

    nodes = [cluster.head_node, *cluster.worker_nodes]
    return {
        n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: n.node_id for n in nodes
    }


def _actors_by_node(cluster, actor_class: str) -> dict[str, list[int]]:
    """Node id -> pids of the live actors of ``actor_class`` that node's raylet started."""
    raylets = _raylet_pids(cluster)
    found, parents = actor_processes(actor_class)
    by_node: dict[str, list[int]] = {}
    for pid in found:
        ancestor = pid
        while ancestor > 1 and ancestor not in raylets:
            ancestor = parents.get(ancestor, 0)
        if ancestor in raylets:
            by_node.setdefault(raylets[ancestor], []).append(pid)
    return by_node


def _prefill_group_nodes(cluster) -> list[str]:
    """The node of each bundle (pipeline stage) of the live prefill replica's group."""
    table = cluster.global_state.placement_group_table()
    (group,) = [g for g in table.values() if "-prefill-0" in g["name"] and g["state"] == "CREATED"]
    return [group["bundles_to_node_id"][i] for i in sorted(group["bundles_to_node_id"])]


def test_pipeline_stages_on_two_nodes_serve_and_restart_as_a_unit(
    two_nodes, tiny_model_dir, tmp_path, reference
):
    cluster, env = two_nodes
    head_id = cluster.head_node.node_id
    (worker_node,) = cluster.worker_nodes
    config = cluster_config(tiny_model_dir)
    config["prefill"].update(pipeline_parallel=2, node_resource=STAGE_SLOT)
    # As when the nodes are separate machines (here they share an address, so "auto"
    # would keep the channel plain): the restarted replica reconnects over TLS too.
    config["router"]["event_channel_tls"] = "on"
    served = start_cluster(config, tmp_path, env=env)
    try:
        stub = served.stub()
        # Bundle 1 is the last stage, rank 0's; either may land on either node.
        assert sorted(_prefill_group_nodes(cluster)) == sorted([head_id, worker_node.node_id])
        assert len(served.metrics_urls()) == 2  # one endpoint per node with a rank
        assert_outputs_and_hand_off(stub, tiny_model_dir, reference)
        assert "TLS 1.3, certificate pinned" in served.output()

        # The stage on the second node dies (whichever rank it is): the replica goes
        # down, and is placed again across both nodes.
        on_worker = [
            *_actors_by_node(cluster, "RankActor").get(worker_node.node_id, []),
            *_actors_by_node(cluster, "WorkerActor").get(worker_node.node_id, []),
        ]
        assert len(on_worker) == 1, on_worker  # the decode worker is on the head
        os.kill(on_worker[0], signal.SIGKILL)
        assert _wait_restarting(stub, "prefill") == {"prefill-0"}
        _wait_serving(stub, "prefill", {"prefill-0": 1})
        assert sorted(_prefill_group_nodes(cluster)) == sorted([head_id, worker_node.node_id])
        _serves_the_reference(stub, reference, num=2)
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
        assert "baton: stopped" in served.output()
