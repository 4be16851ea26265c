"""Building blocks of the Kubernetes manifests: options, names, labels, resources, probes.

Everything here is pure: dicts in, dicts out. Names follow Kubernetes' rules (DNS-1123
labels for objects, DNS-1035 for Services) and are checked here, so a bad ``--name`` or
``--namespace`` fails before any YAML is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dynagraph.errors import ConfigError

IMAGE_REPOSITORY = "dynagraph"
IMAGE_VERSION = "0.1.0"
"""The project's version (pyproject.toml); the default image tag is ``VERSION-ENGINE``."""

PART_OF = "dynagraph"
MANAGED_BY = "dynamo-deploy"
COMPONENT_LABEL = "dynagraph.io/component"
DYNAMO_NAMESPACE_LABEL = "dynagraph.io/namespace"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes' quantity grammar, restricted to the plain forms people write.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# A StatefulSet's pods carry a controller-revision-hash label "NAME-HASH" (<= 63 chars):
# Kubernetes documents 52 as the longest safe StatefulSet name.
MAX_NAME = 52
MAX_PREFIX = 36


@dataclass(frozen=True)
class K8sOptions:
    """Where and how the graph runs in the cluster (not what it does: that is the config).

    ``etcd_url`` / ``nats_url``: an existing etcd / NATS; None deploys one in the namespace.
    ``image``: None picks ``dynagraph:VERSION-cpu``, or ``-gpu`` when a component asks for GPUs.
    """

    name: str
    namespace: str = "dynagraph"
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    etcd_url: str | None = None
    nats_url: str | None = None
    storage_class: str | None = None
    etcd_storage: str = "1Gi"
    nats_storage: str = "10Gi"
    metrics_port: int = 9090
    service_type: str = "ClusterIP"
    ready_timeout: int = 900
    shm_size: str = "1Gi"
    create_namespace: bool = True
    workdir: str = "/app"

    def check(self) -> None:
        """Raise ConfigError (key = the option) for values Kubernetes would reject."""
        if not _DNS1035_LABEL.match(self.name) or len(self.name) > MAX_PREFIX:
            raise ConfigError(
                "must be lower-case letters, digits and '-', start with a letter, and be at most "
                f"{MAX_PREFIX} characters (object names are NAME-component)", key="--name")
        if not _DNS1123_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ConfigError("not a valid Kubernetes namespace name (DNS-1123 label)",
                              key="--namespace")
        if self.service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
            raise ConfigError("must be ClusterIP, NodePort or LoadBalancer", key="--service-type")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ConfigError("must be Always, IfNotPresent or Never", key="--image-pull-policy")
        if not 1 <= self.metrics_port <= 65535:
            raise ConfigError("must be a TCP port", key="--metrics-port")
        for key, value in (("--etcd-storage", self.etcd_storage),
                           ("--nats-storage", self.nats_storage), ("--shm-size", self.shm_size)):
            if not _QUANTITY.match(value):
                raise ConfigError(f"{value!r} is not a Kubernetes quantity (e.g. 10Gi)", key=key)
        if self.storage_class is not None and not _DNS1123_LABEL.match(self.storage_class):
            raise ConfigError("not a valid storage class name", key="--storage-class")


def kebab(name: str) -> str:
    """``VllmWorker`` -> ``vllm-worker`` (a component class name as a DNS label)."""
    out = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name)
    return re.sub(r"[^a-z0-9-]+", "-", out.lower()).strip("-")


def object_name(opts: K8sOptions, part: str) -> str:
    name = f"{opts.name}-{part}"
    if len(name) > MAX_NAME or not _DNS1035_LABEL.match(name):
        raise ConfigError(f"object name {name!r} is not a DNS label of at most {MAX_NAME} "
                          "characters; choose a shorter --name", key="--name")
    return name


def selector(opts: K8sOptions, part: str) -> dict[str, str]:
    """The labels that pick one workload's pods (immutable once applied)."""
    return {"app.kubernetes.io/name": PART_OF, "app.kubernetes.io/instance": opts.name,
            "app.kubernetes.io/component": part}


def labels(opts: K8sOptions, part: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**selector(opts, part), "app.kubernetes.io/part-of": PART_OF,
            "app.kubernetes.io/managed-by": MANAGED_BY, **(extra or {})}


def metadata(opts: K8sOptions, name: str, part: str,
             extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace,
            "labels": labels(opts, part, extra_labels)}


def scrape_annotations(port: int, path: str = "/metrics") -> dict[str, str]:
    """The de-facto Prometheus annotations (``prometheus.io/*``) read by kubernetes_sd
    relabelling rules, e.g. ``deploy/k8s/prometheus-k8s.yml``."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": path}


def http_probe(port: str | int, path: str, *, period: int, failures: int,
               timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def env_field(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def pvc_template(opts: K8sOptions, name: str, size: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": size}}}
    if opts.storage_class is not None:
        spec["storageClassName"] = opts.storage_class
    return {"metadata": {"name": name}, "spec": spec}


RESOURCE_KEYS = ("cpu", "memory", "gpu")
GPU_RESOURCE = "nvidia.com/gpu"


def container_resources(resources: dict[str, Any], *, file: str,
                        component: str) -> dict[str, Any]:
    """``ServiceArgs.resources`` -> a container's ``resources``.

    ``cpu`` and ``memory`` become requests (what the scheduler reserves; no limit, so a
    burst of tokenization or a model load is not throttled or OOM-killed at the request
    size). ``gpu: N`` becomes the ``nvidia.com/gpu`` limit (extended resources are
    limits; the request defaults to it). Unknown keys and malformed quantities raise
    ConfigError naming the key.
    """
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    for key, value in resources.items():
        where = f"ServiceArgs.resources.{key}"
        if key not in RESOURCE_KEYS:
            raise ConfigError(f"unknown resource (known: {', '.join(RESOURCE_KEYS)})",
                              file=file, component=component, key=where)
        if key == "gpu":
            gpus = _gpu_count(value)
            if gpus is None:
                raise ConfigError(f"{value!r} is not a whole number of GPUs", file=file,
                                  component=component, key=where)
            if gpus:
                limits[GPU_RESOURCE] = str(gpus)
            continue
        text = _quantity(value)
        if text is None:
            raise ConfigError(f"{value!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)",
                              file=file, component=component, key=where)
        requests[key] = text
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def gpus_of(resources: dict[str, Any]) -> int:
    return _gpu_count(resources.get("gpu", 0)) or 0


def _gpu_count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _quantity(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = format(value, "f").rstrip("0").rstrip(".")
    elif isinstance(value, str):
        text = value.strip()
    else:
        return None
    if not _QUANTITY.match(text) or float(re.sub(r"[A-Za-z]+$", "", text)) <= 0:
        return None
    return text
