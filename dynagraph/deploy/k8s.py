"""Kubernetes manifests for a graph, from the same graph and config ``dynamo serve`` uses.

    dynamo deploy k8s graphs.disagg_router:Frontend -f configs/disagg_router.yaml

`build_manifests` is a pure function (graph, resolved configs, options -> list of
manifest dicts; no I/O). What it emits, in ``kubectl apply`` order:

- a Namespace (unless ``create_namespace`` is off);
- etcd and NATS with JetStream, each a StatefulSet with a volume claim behind a headless
  Service (see ``_k8s_infra`` for why), unless external URLs are given;
- a ConfigMap holding the resolved config as YAML (``graph.yaml``): every component's
  section with ``Common`` merged and the command-line overrides applied, so what runs is
  what was generated;
- one Deployment per component (a component with ``ServiceArgs.embed-in`` has none: it
  runs inside each pod of its host). Each pod runs one worker:
  ``dynamo serve TARGET -f /config/graph.yaml --service-name NAME
  --NAME.ServiceArgs.workers=1`` and the Deployment's ``replicas`` is the component's
  ``ServiceArgs.workers``; Kubernetes scales and restarts, so ``dynamo serve`` runs with
  ``--restart never`` (a failed worker fails its pod, visibly). Environment:
  ``ETCD_ENDPOINTS``, ``NATS_SERVER``, ``DYNAMO_HOST`` (the pod IP, what the process binds
  and publishes in etcd), ``DYNAMO_METRICS_PORT`` (a fixed metrics port, which is why one
  worker per pod) and the component's ``ServiceArgs.env``. ``ServiceArgs.resources``:
  ``cpu``/``memory`` -> requests, ``gpu: N`` -> ``nvidia.com/gpu: N``;
- a Service for the HTTP component (the one whose config has ``host`` and ``port``: the
  Frontend), which binds 0.0.0.0 in its pod (``--Frontend.host=0.0.0.0``; a loopback bind
  could not be reached by the Service or the kubelet's probes).

Probes. The HTTP component is ready while ``GET /health`` answers 200, i.e. while a
Processor and a model worker are registered, so the Service only sends requests to a
Frontend whose chain is up. Its liveness probe is ``GET /metrics`` on the same port: it
answers whenever the Frontend's event loop does, so a Frontend merely waiting for
workers (a model still loading, a worker rolling over) is not killed, while a wedged
event loop is. The other components have no HTTP server; their probes ``GET /metrics``
on the metrics port, i.e. "the process is up and serving", which is all Kubernetes can
learn about them: requests reach them through etcd discovery, not through a Service.
A startup probe gives every pod ``ready_timeout`` seconds to come up (imports and model
loading) before liveness applies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import yaml

from dynagraph.deploy._k8s_infra import etcd_url, infra_manifests, nats_url
from dynagraph.deploy._k8s_objects import (
    COMPONENT_LABEL,
    DYNAMO_NAMESPACE_LABEL,
    IMAGE_REPOSITORY,
    IMAGE_VERSION,
    K8sOptions,
    container_resources,
    env_field,
    env_value,
    gpus_of,
    http_probe,
    kebab,
    metadata,
    object_name,
    scrape_annotations,
    selector,
)
from dynagraph.errors import ConfigError
from dynagraph.sdk._config import SERVICE_ARGS, ComponentConfig
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import spec_of

CONFIG_DIR = "/config"
CONFIG_KEY = "graph.yaml"
CONFIG_HASH_ANNOTATION = "dynagraph.io/config-sha256"
HTTP_BIND = "0.0.0.0"

__all__ = ["DeploySpec", "K8sOptions", "build_manifests", "config_yaml", "default_image",
           "http_component", "render_yaml"]


@dataclass(frozen=True)
class DeploySpec:
    """What is deployed: ``target`` as given to ``dynamo serve``, the graph it names, every
    component's resolved config, and the config file's path (for messages only)."""

    target: str
    graph: Graph
    configs: dict[str, ComponentConfig]
    config_file: str


def build_manifests(spec: DeploySpec, opts: K8sOptions) -> list[dict[str, Any]]:
    """Every object of the graph's deployment, in apply order (see the module docstring).

    Raises ConfigError naming the file, component and key for a config Kubernetes cannot
    run (port 0, malformed resources), or the option for a bad name.
    """
    opts.check()
    _check_parts(spec)
    http = http_component(spec)
    text = config_yaml(spec)
    digest = hashlib.sha256(text.encode()).hexdigest()
    image = opts.image or default_image(spec.configs)
    out: list[dict[str, Any]] = []
    if opts.create_namespace:
        out.append({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": opts.namespace,
                                 "labels": {"app.kubernetes.io/part-of": "dynagraph"}}})
    out += infra_manifests(opts)
    out.append({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": metadata(opts, object_name(opts, "config"), "config"),
                "data": {CONFIG_KEY: text}})
    for cls in spec.graph.nodes:
        name = spec_of(cls).name
        if spec.configs[name].service_args.embed_in is not None:
            continue  # runs in its host's pods (dynamo serve starts it with the host)
        port = http[1] if http is not None and http[0] == name else None
        out.append(_deployment(spec, opts, name, image, digest, port))
    if http is not None:
        out.append(_http_service(opts, *http))
    return out


def http_component(spec: DeploySpec) -> tuple[str, int] | None:
    """(name, port) of the component serving HTTP: the first whose config has ``host`` and
    ``port`` (the Frontend). Port 0 (a free port) cannot be exposed: ConfigError."""
    for cls in spec.graph.nodes:
        name = spec_of(cls).name
        values = spec.configs[name].values
        if "host" in values and "port" in values:
            port = values["port"]
            if not isinstance(port, int) or not 1 <= port <= 65535:
                raise ConfigError("Kubernetes needs a fixed HTTP port (0 picks a free one)",
                                  file=spec.config_file, component=name, key="port")
            return name, port
    return None


RESERVED_PARTS = ("etcd", "nats", "config")


def _check_parts(spec: DeploySpec) -> None:
    """Component names become object names and selector labels (``VllmWorker`` ->
    ``PREFIX-vllm-worker``): they must not collide with each other or with etcd, NATS and
    the ConfigMap."""
    seen: dict[str, str] = {}
    for name in spec.graph.names():
        part = kebab(name)
        if part in RESERVED_PARTS or part in seen:
            other = seen.get(part, part)
            raise ConfigError(f"its Kubernetes name {part!r} is taken by {other}; rename the "
                              "component", file=spec.config_file, component=name)
        seen[part] = name


def default_image(configs: dict[str, ComponentConfig]) -> str:
    """``dynagraph:VERSION-gpu`` when any component asks for GPUs, else ``-cpu`` (the engine
    extra the image was built with: ``deploy/k8s/Dockerfile``'s ``ENGINE``)."""
    engine = "gpu" if any(gpus_of(c.service_args.resources) for c in configs.values()) else "cpu"
    return f"{IMAGE_REPOSITORY}:{IMAGE_VERSION}-{engine}"


def config_yaml(spec: DeploySpec) -> str:
    """The resolved config as a file ``dynamo serve -f`` accepts and resolves to the same
    configs: one section per component in graph order, values by their YAML key."""
    doc: dict[str, Any] = {}
    for cls in spec.graph.nodes:
        name = spec_of(cls).name
        cfg = spec.configs[name]
        values = {k: (None if k == "cpu-threads-bind" and v == "spread" else v)
                  for k, v in cfg.values.items()}  # one worker per pod: vLLM's own binding
        sargs = cfg.service_args.model_dump(exclude_none=True)
        if cfg.service_args.embed_in is not None:
            del sargs["workers"]  # the host's, per pod
        doc[name] = {**values, SERVICE_ARGS: sargs}
    header = (f"# {spec.target}, resolved from {spec.config_file} by `dynamo deploy k8s`\n"
              "# (Common merged, overrides applied). Each pod adds --NAME.ServiceArgs.workers=1\n"
              "# (replicas = workers) and binds the HTTP component to 0.0.0.0.\n")
    return header + _dump(doc)


def render_yaml(manifests: list[dict[str, Any]], header: str = "") -> str:
    """Multi-document YAML, keys in the order built (stable, diff-friendly); multi-line
    strings (the ConfigMap's file) as literal blocks."""
    body = "---\n".join(_dump(m) for m in manifests)
    return header + "---\n" + body


def _deployment(spec: DeploySpec, opts: K8sOptions, name: str, image: str, digest: str,
                http_port: int | None) -> dict[str, Any]:
    cfg = spec.configs[name]
    part = kebab(name)
    obj = object_name(opts, part)
    cls = spec.graph.by_name(name)
    extra_labels = {COMPONENT_LABEL: name, DYNAMO_NAMESPACE_LABEL: spec_of(cls).namespace}
    command = ["dynamo", "serve", spec.target, "-f", f"{CONFIG_DIR}/{CONFIG_KEY}",
               "--service-name", name, f"--{name}.{SERVICE_ARGS}.workers=1",
               "--restart", "never", "--ready-timeout", str(opts.ready_timeout)]
    if http_port is not None:
        command.append(f"--{name}.host={HTTP_BIND}")
    ports = [{"name": "metrics", "containerPort": opts.metrics_port, "protocol": "TCP"}]
    if http_port is not None:
        ports.insert(0, {"name": "http", "containerPort": http_port, "protocol": "TCP"})
    if http_port is not None:
        readiness = http_probe("http", "/health", period=5, failures=2)
        liveness = http_probe("http", "/metrics", period=10, failures=6, timeout=5)
        startup = http_probe("http", "/metrics", period=5, failures=_periods(opts, 5))
    else:
        readiness = http_probe("metrics", "/metrics", period=10, failures=3)
        liveness = http_probe("metrics", "/metrics", period=10, failures=6, timeout=5)
        startup = http_probe("metrics", "/metrics", period=5, failures=_periods(opts, 5))
    container: dict[str, Any] = {
        "name": part,
        "image": image,
        "imagePullPolicy": opts.image_pull_policy,
        "workingDir": opts.workdir,
        "command": command,
        "env": _env(spec, opts, name),
        "ports": ports,
        "readinessProbe": readiness,
        "livenessProbe": liveness,
        "startupProbe": startup,
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    resources = container_resources(cfg.service_args.resources, file=spec.config_file,
                                    component=name)
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": object_name(opts, "config")}},
            # vLLM, NIXL/UCX and torch use shared memory; a container's default is 64 MiB.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
        ],
    }
    if gpus_of(cfg.service_args.resources):
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(opts, obj, part, extra_labels),
        "spec": {
            "replicas": cfg.service_args.workers,
            "selector": {"matchLabels": selector(opts, part)},
            "template": {
                "metadata": {
                    "labels": metadata(opts, obj, part, extra_labels)["labels"],
                    "annotations": {**scrape_annotations(opts.metrics_port),
                                    CONFIG_HASH_ANNOTATION: digest},
                },
                "spec": pod,
            },
        },
    }


def _env(spec: DeploySpec, opts: K8sOptions, name: str) -> list[dict[str, Any]]:
    """Infrastructure first, then ``ServiceArgs.env``, which wins on a clash (as in
    ``dynamo serve``, where a component's env is applied last)."""
    env: dict[str, dict[str, Any]] = {
        "ETCD_ENDPOINTS": env_value("ETCD_ENDPOINTS", etcd_url(opts)),
        "NATS_SERVER": env_value("NATS_SERVER", nats_url(opts)),
        "DYNAMO_HOST": env_field("DYNAMO_HOST", "status.podIP"),
        "DYNAMO_METRICS_PORT": env_value("DYNAMO_METRICS_PORT", str(opts.metrics_port)),
    }
    for key, value in spec.configs[name].service_args.env.items():
        env[key] = env_value(key, value)
    return list(env.values())


def _http_service(opts: K8sOptions, name: str, port: int) -> dict[str, Any]:
    part = kebab(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(opts, object_name(opts, part), part),
        "spec": {
            "type": opts.service_type,
            "selector": selector(opts, part),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _periods(opts: K8sOptions, period: int) -> int:
    return max(1, -(-opts.ready_timeout // period))


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no type stubs here
    """Indents list items under their key, as ``kubectl`` prints manifests."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        return True  # a shared dict is written out twice, never as an &anchor


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(doc: Any) -> str:
    return str(yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096,
                         allow_unicode=True))
