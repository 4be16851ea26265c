"""build_manifests: what each object holds, for the shipped graphs and a GPU variant.

Exact expected values for disagg_router with GPU decode workers; replicas, resources,
probes and env checked against the config for every shipped graph; the ConfigMap's file
resolves back to the same configs; generation is deterministic; config problems name
the file, component and key.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynagraph.deploy import K8sOptions, build_manifests, config_yaml, render_yaml
from dynagraph.deploy._k8s_objects import container_resources, kebab
from dynagraph.errors import ConfigError
from dynagraph.sdk._config import resolve_config
from dynagraph.sdk._service import spec_of

from .conftest import GRAPHS, REPO, by_kind_name, manifests_for, spec_for

GPU_OVERRIDES = ["--VllmWorker.ServiceArgs.resources={gpu: 1, cpu: 4, memory: 16Gi}",
                 "--VllmWorker.ServiceArgs.env={HF_HUB_OFFLINE: '1'}"]


def _labels(component: str, part: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dynagraph", "app.kubernetes.io/instance": "dr",
            "app.kubernetes.io/component": part, "app.kubernetes.io/part-of": "dynagraph",
            "app.kubernetes.io/managed-by": "dynamo-deploy",
            "dynagraph.io/component": component, "dynagraph.io/namespace": "dynamo"}


def test_gpu_decode_worker_deployment_exact() -> None:
    objs = by_kind_name(manifests_for("disagg_router", overrides=GPU_OVERRIDES, name="dr",
                                      namespace="llm"))
    config = objs[("ConfigMap", "dr-config")]["data"]["graph.yaml"]
    digest = hashlib.sha256(config.encode()).hexdigest()
    selector = {"app.kubernetes.io/name": "dynagraph", "app.kubernetes.io/instance": "dr",
                "app.kubernetes.io/component": "vllm-worker"}
    assert objs[("Deployment", "dr-vllm-worker")] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dr-vllm-worker", "namespace": "llm",
                     "labels": _labels("VllmWorker", "vllm-worker")},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": _labels("VllmWorker", "vllm-worker"),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9090",
                                    "prometheus.io/path": "/metrics",
                                    "dynagraph.io/config-sha256": digest},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "vllm-worker",
                        "image": "dynagraph:0.1.0-gpu",
                        "imagePullPolicy": "IfNotPresent",
                        "workingDir": "/app",
                        "command": ["dynamo", "serve", "graphs.disagg_router:Frontend", "-f",
                                    "/config/graph.yaml", "--service-name", "VllmWorker",
                                    "--VllmWorker.ServiceArgs.workers=1", "--restart", "never",
                                    "--ready-timeout", "900"],
                        "env": [
                            {"name": "ETCD_ENDPOINTS",
                             "value": "http://dr-etcd.llm.svc:2379"},
                            {"name": "NATS_SERVER", "value": "nats://dr-nats.llm.svc:4222"},
                            {"name": "DYNAMO_HOST",
                             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "DYNAMO_METRICS_PORT", "value": "9090"},
                            {"name": "HF_HUB_OFFLINE", "value": "1"},
                        ],
                        "ports": [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
                        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                                           "periodSeconds": 10, "timeoutSeconds": 3,
                                           "failureThreshold": 3},
                        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                                          "periodSeconds": 10, "timeoutSeconds": 5,
                                          "failureThreshold": 6},
                        "startupProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                                         "periodSeconds": 5, "timeoutSeconds": 3,
                                         "failureThreshold": 180},
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [{"name": "config", "mountPath": "/config",
                                          "readOnly": True},
                                         {"name": "shm", "mountPath": "/dev/shm"}],
                        "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                                      "limits": {"nvidia.com/gpu": "1"}},
                    }],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "dr-config"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                    ],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                },
            },
        },
    }


def test_frontend_deployment_probes_and_service_exact() -> None:
    objs = by_kind_name(manifests_for("disagg_router", name="dr", namespace="llm",
                                      service_type="LoadBalancer"))
    pod = objs[("Deployment", "dr-frontend")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][-1] == "--Frontend.host=0.0.0.0"
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    # Ready only with the chain up (/health); alive while the event loop answers (/metrics).
    assert c["readinessProbe"] == {"httpGet": {"path": "/health", "port": "http"},
                                   "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2}
    assert c["livenessProbe"] == {"httpGet": {"path": "/metrics", "port": "http"},
                                  "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}
    assert c["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    assert c["resources"] == {"requests": {"cpu": "1"}}
    assert "tolerations" not in pod
    assert objs[("Service", "dr-frontend")] == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "dr-frontend", "namespace": "llm",
                     "labels": {k: v for k, v in _labels("Frontend", "frontend").items()
                                if not k.startswith("dynagraph.io/")}},
        "spec": {"type": "LoadBalancer",
                 "selector": {"app.kubernetes.io/name": "dynagraph",
                              "app.kubernetes.io/instance": "dr",
                              "app.kubernetes.io/component": "frontend"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http",
                            "protocol": "TCP"}]},
    }


@pytest.mark.parametrize("graph", GRAPHS)
def test_one_deployment_per_component_following_the_config(graph: str) -> None:
    spec = spec_for(graph)
    manifests = manifests_for(graph)
    deployments = {m["metadata"]["labels"]["dynagraph.io/component"]: m
                   for m in manifests if m["kind"] == "Deployment"}
    # an embedded component (agg's Processor) runs in its host's pods
    assert list(deployments) == [n for n in spec.graph.names()
                                 if spec.configs[n].service_args.embed_in is None]
    for name, dep in deployments.items():
        cfg = spec.configs[name]
        assert dep["spec"]["replicas"] == cfg.service_args.workers
        c = dep["spec"]["template"]["spec"]["containers"][0]
        i = c["command"].index("--service-name")
        assert c["command"][i + 1] == name
        assert f"--{name}.ServiceArgs.workers=1" in c["command"]
        assert c["command"][2] == spec.target
        assert c.get("resources", {}) == container_resources(cfg.service_args.resources,
                                                     file="", component=name)
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
        assert env["ETCD_ENDPOINTS"] == f"http://{graph.replace('_', '-')}-etcd.dynagraph.svc:2379"
        assert env["NATS_SERVER"] == f"nats://{graph.replace('_', '-')}-nats.dynagraph.svc:4222"
        assert env["DYNAMO_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["DYNAMO_METRICS_PORT"] == "9090"
        is_http = name == "Frontend"
        assert c["readinessProbe"]["httpGet"] == (
            {"path": "/health", "port": "http"} if is_http
            else {"path": "/metrics", "port": "metrics"})
    kinds = [m["kind"] for m in manifests]
    assert kinds[:6] == ["Namespace", "Service", "StatefulSet", "Service", "StatefulSet",
                         "ConfigMap"]
    assert kinds.count("Service") == 3 and kinds[-1] == "Service"


def test_service_args_env_wins_over_infrastructure_as_in_dynamo_serve() -> None:
    objs = by_kind_name(manifests_for(
        "agg", overrides=["--VllmWorker.ServiceArgs.env={NATS_SERVER: 'nats://elsewhere:4222'}"]))
    c = objs[("Deployment", "agg-vllm-worker")]["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in c["env"]]
    assert names.count("NATS_SERVER") == 1
    assert {"name": "NATS_SERVER", "value": "nats://elsewhere:4222"} in c["env"]


def test_external_etcd_and_nats_deploy_neither() -> None:
    manifests = manifests_for("agg", etcd_url="http://etcd.infra:2379",
                              nats_url="nats://nats.infra:4222", create_namespace=False)
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Deployment", "Deployment",
                                              "Service"]  # agg: Frontend (with Processor), worker
    c = manifests[1]["spec"]["template"]["spec"]["containers"][0]
    assert c["env"][:2] == [{"name": "ETCD_ENDPOINTS", "value": "http://etcd.infra:2379"},
                            {"name": "NATS_SERVER", "value": "nats://nats.infra:4222"}]


def test_etcd_and_nats_statefulsets() -> None:
    objs = by_kind_name(manifests_for("disagg", storage_class="fast-ssd"))
    etcd = objs[("StatefulSet", "disagg-etcd")]["spec"]
    nats = objs[("StatefulSet", "disagg-nats")]["spec"]
    assert etcd["serviceName"] == "disagg-etcd" and etcd["replicas"] == 1
    cmd = etcd["template"]["spec"]["containers"][0]["command"]
    assert ("--initial-cluster=disagg-etcd-0=http://disagg-etcd-0.disagg-etcd.dynagraph.svc:2380"
            in cmd)
    assert etcd["volumeClaimTemplates"][0]["spec"] == {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
        "storageClassName": "fast-ssd"}
    server, exporter = nats["template"]["spec"]["containers"]
    assert server["args"] == ["-p", "4222", "-m", "8222", "-n", "$(POD_NAME)", "-js", "-sd",
                              "/data"]
    assert exporter["args"][-1] == "http://localhost:8222"
    assert nats["template"]["metadata"]["annotations"]["prometheus.io/port"] == "7777"
    assert nats["volumeClaimTemplates"][0]["spec"]["resources"] == {
        "requests": {"storage": "10Gi"}}
    headless = objs[("Service", "disagg-etcd")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert objs[("Service", "disagg-nats")]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("graph", GRAPHS)
def test_configmap_file_resolves_to_the_same_configs(graph: str, tmp_path: Path) -> None:
    spec = spec_for(graph, overrides=["--Frontend.port=8080"])
    path = tmp_path / "graph.yaml"
    path.write_text(config_yaml(spec))
    again = resolve_config(spec.graph, path)
    assert again.keys() == spec.configs.keys()
    for name, cfg in spec.configs.items():
        # one worker per pod: `cpu-threads-bind: spread` (a core per local worker) is
        # left to vLLM's own binding there
        want = {k: (None if k == "cpu-threads-bind" and v == "spread" else v)
                for k, v in cfg.values.items()}
        assert again[name].values == want
        assert again[name].service_args == cfg.service_args
    assert again["Frontend"].values["port"] == 8080  # the override is baked in
    if graph == "agg_router":
        assert spec.configs["VllmWorker"].values["cpu-threads-bind"] == "spread"
        assert again["VllmWorker"].values["cpu-threads-bind"] is None


def test_generation_is_deterministic_across_processes(tmp_path: Path) -> None:
    first = render_yaml(manifests_for("disagg_router"))
    assert render_yaml(manifests_for("disagg_router")) == first
    code = ("import sys; from tests.unit.deploy.conftest import manifests_for; "
            "from dynagraph.deploy import render_yaml; "
            "sys.stdout.write(render_yaml(manifests_for('disagg_router')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True, env={"PYTHONHASHSEED": "12345", "PATH": "", "HOME": str(tmp_path)})
    assert out.stdout == first


def test_rendered_yaml_round_trips_without_anchors() -> None:
    manifests = manifests_for("disagg_router")
    text = render_yaml(manifests)
    assert "&id" not in text and "*id" not in text
    assert [d for d in yaml.safe_load_all(text) if d is not None] == manifests
    assert "  graph.yaml: |\n" in text  # the config stays readable in the ConfigMap


def test_config_change_changes_the_pod_template() -> None:
    def digest(overrides: list[str]) -> Any:
        m = manifests_for("agg", overrides=overrides)
        return m[-2]["spec"]["template"]["metadata"]["annotations"]["dynagraph.io/config-sha256"]

    assert digest([]) == digest([])
    assert digest([]) != digest(["--VllmWorker.max-num-seqs=8"])


@pytest.mark.parametrize(("resources", "key", "words"), [
    ("{cpu: lots}", "ServiceArgs.resources.cpu", "not a Kubernetes quantity"),
    ("{memory: -2Gi}", "ServiceArgs.resources.memory", "not a Kubernetes quantity"),
    ("{gpu: 0.5}", "ServiceArgs.resources.gpu", "whole number of GPUs"),
    ("{tpu: 1}", "ServiceArgs.resources.tpu", "unknown resource (known: cpu, memory, gpu)"),
])
def test_bad_resources_name_file_component_key(resources: str, key: str, words: str,
                                               tmp_path: Path) -> None:
    path = tmp_path / "agg.yaml"
    path.write_text((REPO / "configs" / "agg.yaml").read_text().replace(
        "  enforce-eager: true\n", f"  enforce-eager: true\n  ServiceArgs:\n    resources: {resources}\n"))
    with pytest.raises(ConfigError) as info:
        manifests_for("agg", config=path)
    assert (info.value.file, info.value.component, info.value.key) == (str(path), "VllmWorker", key)
    assert words in str(info.value)


def test_free_http_port_cannot_be_exposed() -> None:
    with pytest.raises(ConfigError) as info:
        manifests_for("agg", overrides=["--Frontend.port=0"])
    assert (info.value.component, info.value.key) == ("Frontend", "port")


@pytest.mark.parametrize(("opts", "key"), [
    ({"name": "Agg"}, "--name"),
    ({"name": "a" * 37}, "--name"),
    ({"namespace": "my_ns"}, "--namespace"),
    ({"etcd_storage": "lots"}, "--etcd-storage"),
    ({"storage_class": "Fast SSD"}, "--storage-class"),
    ({"metrics_port": 0}, "--metrics-port"),
])
def test_bad_options_name_the_option(opts: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_manifests(spec_for("agg"), K8sOptions(**{"name": "agg", **opts}))
    assert info.value.key == key


def test_component_names_become_dns_labels() -> None:
    assert [kebab(spec_of(c).name) for c in spec_for("disagg_router").graph.nodes] == [
        "frontend", "processor", "router", "vllm-worker", "prefill-worker"]
    assert kebab("KVRouter") == "kv-router" and kebab("HTTPFrontend2") == "http-frontend2"


def test_quantities() -> None:
    assert container_resources({"cpu": 0.5, "memory": "512Mi"}, file="f", component="C") == {
        "requests": {"cpu": "0.5", "memory": "512Mi"}}
    assert container_resources({"cpu": "250m", "gpu": 0}, file="f", component="C") == {
        "requests": {"cpu": "250m"}}
    assert container_resources({"gpu": "2"}, file="f", component="C") == {
        "limits": {"nvidia.com/gpu": "2"}}
    assert container_resources({}, file="f", component="C") == {}


def test_component_names_that_collide_are_rejected() -> None:
    from dynagraph.deploy import DeploySpec
    from dynagraph.sdk import service
    from dynagraph.sdk._config import resolve_config
    from dynagraph.sdk._graph import Graph

    @service(dynamo={"namespace": "t"})
    class Nats:
        pass

    graph = Graph.of(Nats)
    spec = DeploySpec("m:Nats", graph, resolve_config(graph, None), "<no file>")
    with pytest.raises(ConfigError) as info:
        build_manifests(spec, K8sOptions(name="t"))
    assert info.value.component == "Nats" and "'nats' is taken" in str(info.value)


def test_an_embedded_component_has_no_deployment_and_round_trips(tmp_path: Path) -> None:
    overrides = ["--Frontend.ServiceArgs.workers=2"]  # configs/agg.yaml embeds the Processor
    spec = spec_for("agg", overrides=overrides)
    kinds = by_kind_name(manifests_for("agg", overrides=overrides))
    deployments = {name for kind, name in kinds if kind == "Deployment"}
    assert deployments == {"agg-frontend", "agg-vllm-worker"}
    # the ConfigMap's file resolves again, also as each pod resolves it (workers=1)
    path = tmp_path / "graph.yaml"
    path.write_text(config_yaml(spec))
    pod = resolve_config(spec.graph, path, ["--Frontend.ServiceArgs.workers=1"])
    assert pod["Processor"].service_args.embed_in == "Frontend"
    assert pod["Processor"].service_args.workers == 1
