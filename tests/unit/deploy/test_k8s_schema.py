"""Every generated object validates against the Kubernetes schema, and hangs together.

``kubernetes-validate`` (the schemas ship inside the package: no network) in strict mode,
which rejects unknown fields, against a pinned Kubernetes version. The schema does not
check what ties objects together, so the tests here also do: names are DNS labels,
selectors pick the pod templates, Services and probes point at declared ports, volumes
and the ConfigMap exist, the Prometheus port is a container port.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest

from .conftest import GRAPHS, manifests_for

KUBERNETES_VERSION = "1.31.0"
"""The oldest minor the manifests are meant for (all fields used are GA well before it)."""

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    *[(g, {}) for g in GRAPHS],
    ("disagg_router", {"overrides": ["--VllmWorker.ServiceArgs.resources={gpu: 2, cpu: 8, "
                                     "memory: 32Gi}",
                                     "--PrefillWorker.ServiceArgs.resources={gpu: 1}",
                                     "--Frontend.ServiceArgs.env={LOG: debug}"],
                       "storage_class": "standard", "service_type": "NodePort",
                       "namespace": "serving", "name": "llm"}),
    ("agg", {"etcd_url": "http://etcd:2379", "nats_url": "nats://nats:4222",
             "create_namespace": False, "image": "registry.example/dynagraph:dev"}),
]
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _variant(graph: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    params = dict(params)
    return manifests_for(graph, overrides=params.pop("overrides", None), **params)


def _ids() -> list[str]:
    return [f"{g}-{i}" for i, (g, _) in enumerate(VARIANTS)]


@pytest.mark.parametrize(("graph", "params"), VARIANTS, ids=_ids())
def test_every_object_validates_strictly(graph: str, params: dict[str, Any]) -> None:
    for obj in _variant(graph, params):
        version = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert version == "1.31"


def test_the_validator_rejects_what_it_should() -> None:
    dep = next(m for m in manifests_for("agg") if m["kind"] == "Deployment")
    unknown = copy.deepcopy(dep)
    unknown["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "two"
    missing = copy.deepcopy(dep)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    for bad in (unknown, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def _pods(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize(("graph", "params"), VARIANTS, ids=_ids())
def test_objects_hang_together(graph: str, params: dict[str, Any]) -> None:
    manifests = _variant(graph, params)
    keys = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(keys) == len(set(keys))
    namespaces = {m["metadata"].get("namespace") for m in manifests if m["kind"] != "Namespace"}
    assert len(namespaces) == 1
    config_maps = {m["metadata"]["name"] for m in manifests if m["kind"] == "ConfigMap"}
    for m in manifests:
        name = m["metadata"]["name"]
        assert DNS1123.match(name) and len(name) <= 63, name
        if m["kind"] in ("Service", "StatefulSet"):
            assert DNS1035.match(name) and len(name) <= 52, name
        for value in m["metadata"].get("labels", {}).values():
            assert LABEL_VALUE.match(value) and len(value) <= 63, value
    for w in _pods(manifests):
        template = w["spec"]["template"]
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        # No two workloads' selectors pick each other's pods.
        for other in _pods(manifests):
            if other is not w:
                assert not selector.items() <= other["spec"]["template"]["metadata"][
                    "labels"].items()
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in w["spec"].get("volumeClaimTemplates", [])}
        ports: dict[str, int] = {}
        for c in pod["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            assert len(names) == len(set(names)) and all(ENV_NAME.match(n) for n in names)
            for p in c.get("ports", []):
                assert len(p["name"]) <= 15 and p["name"] not in ports
                ports[p["name"]] = p["containerPort"]
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in {p["name"] for p in c["ports"]}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in ports.values()
    for svc in (m for m in manifests if m["kind"] == "Service"):
        matched = [w for w in _pods(manifests)
                   if svc["spec"]["selector"].items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, svc["metadata"]["name"]
        declared = {p["name"] for c in matched[0]["spec"]["template"]["spec"]["containers"]
                    for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= declared
        if svc["spec"].get("clusterIP") == "None":
            assert matched[0]["kind"] == "StatefulSet"
            assert matched[0]["spec"]["serviceName"] == svc["metadata"]["name"]
