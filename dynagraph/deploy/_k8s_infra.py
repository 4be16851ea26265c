"""etcd and NATS (JetStream) for one graph: a StatefulSet and a headless Service each.

Why StatefulSets with a volume claim, not Deployments with an emptyDir:

- etcd holds more than leases. Registrations come back by themselves after an etcd
  restart (every process re-registers), but the live settings an operator wrote
  (``/dynamo/settings/Router/mode``, the disaggregation thresholds) would be lost with
  the pod. etcd also needs a stable member name and peer URL across restarts: a
  Deployment's replacement pod has a new name, and an etcd member that comes back under
  another name refuses its own data directory.
- NATS JetStream holds the prefill queue: the stream, the durable consumer shared by the
  prefill workers and the jobs not yet acknowledged. On a volume they survive a NATS
  restart, so a queued remote prefill is still delivered (jobs carry ``max_age``, so
  losing them is not fatal, but every decode worker would fall back to local prefill
  until the stream is re-created).

One replica each: the graph's processes reconnect on their own, and a three-member etcd
or a NATS cluster is a change of ``replicas`` plus cluster flags, not of this layout.
Images are the ones ``deploy/docker-compose.yml`` pins.
"""

from __future__ import annotations

from typing import Any

from dynagraph.deploy._k8s_objects import (
    K8sOptions,
    env_field,
    http_probe,
    metadata,
    object_name,
    pvc_template,
    scrape_annotations,
    selector,
)

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
NATS_IMAGE = "nats:2.10.22-alpine"
NATS_EXPORTER_IMAGE = "natsio/prometheus-nats-exporter:0.15.0"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_METRICS_PORT = 2381
NATS_CLIENT_PORT = 4222
NATS_MONITOR_PORT = 8222
NATS_EXPORTER_PORT = 7777
_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                 "seccompProfile": {"type": "RuntimeDefault"}}
_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def etcd_url(opts: K8sOptions) -> str:
    """What the graph's processes get as ``ETCD_ENDPOINTS``."""
    if opts.etcd_url:
        return opts.etcd_url
    return f"http://{object_name(opts, 'etcd')}.{opts.namespace}.svc:{ETCD_CLIENT_PORT}"


def nats_url(opts: K8sOptions) -> str:
    """What the graph's processes get as ``NATS_SERVER``."""
    if opts.nats_url:
        return opts.nats_url
    return f"nats://{object_name(opts, 'nats')}.{opts.namespace}.svc:{NATS_CLIENT_PORT}"


def infra_manifests(opts: K8sOptions) -> list[dict[str, Any]]:
    """The etcd and NATS objects this graph needs (none for an external URL)."""
    out: list[dict[str, Any]] = []
    if not opts.etcd_url:
        out += [_headless_service(opts, "etcd", [("client", ETCD_CLIENT_PORT),
                                                 ("peer", ETCD_PEER_PORT)],
                                  not_ready=True),
                _etcd(opts)]
    if not opts.nats_url:
        out += [_headless_service(opts, "nats", [("client", NATS_CLIENT_PORT)], not_ready=False),
                _nats(opts)]
    return out


def _headless_service(opts: K8sOptions, part: str, ports: list[tuple[str, int]],
                      not_ready: bool) -> dict[str, Any]:
    """Headless: the name resolves to the pod itself (the StatefulSet's stable identity).

    etcd's record is published before the pod is ready (``publishNotReadyAddresses``)
    because an etcd member must resolve its own peer URL while it starts."""
    spec: dict[str, Any] = {
        "clusterIP": "None",
        "selector": selector(opts, part),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if not_ready:
        spec["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(opts, object_name(opts, part), part), "spec": spec}


def _etcd(opts: K8sOptions) -> dict[str, Any]:
    name = object_name(opts, "etcd")
    peer = f"http://$(POD_NAME).{name}.{opts.namespace}.svc:{ETCD_PEER_PORT}"
    command = [
        "etcd",
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://$(POD_NAME).{name}.{opts.namespace}.svc:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={name}-0=http://{name}-0.{name}.{opts.namespace}.svc:{ETCD_PEER_PORT}",
        "--initial-cluster-state=new",
        f"--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}",
        # Leases churn with every process start; keep the revision history short.
        "--auto-compaction-mode=periodic",
        "--auto-compaction-retention=1h",
    ]
    container = {
        "name": "etcd",
        "image": ETCD_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": [env_field("POD_NAME", "metadata.name")],
        "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT, "protocol": "TCP"},
                  {"name": "peer", "containerPort": ETCD_PEER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ETCD_METRICS_PORT, "protocol": "TCP"}],
        # /health needs a leader (ready to serve); serializable=true only asks whether this
        # member answers, so a lost quorum does not restart a healthy member.
        "readinessProbe": http_probe("metrics", "/health", period=5, failures=3),
        "livenessProbe": http_probe("metrics", "/health?serializable=true", period=10,
                                    failures=6, timeout=5),
        "startupProbe": http_probe("metrics", "/health?serializable=true", period=5,
                                   failures=60),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    return _statefulset(opts, "etcd", scrape_annotations(ETCD_METRICS_PORT), [container],
                        pvc_template(opts, "data", opts.etcd_storage))


def _nats(opts: K8sOptions) -> dict[str, Any]:
    server = {
        "name": "nats",
        "image": NATS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-p", str(NATS_CLIENT_PORT), "-m", str(NATS_MONITOR_PORT),
                 "-n", "$(POD_NAME)", "-js", "-sd", "/data"],
        "env": [env_field("POD_NAME", "metadata.name")],
        "ports": [{"name": "client", "containerPort": NATS_CLIENT_PORT, "protocol": "TCP"},
                  {"name": "monitor", "containerPort": NATS_MONITOR_PORT, "protocol": "TCP"}],
        # As NATS' own chart: ready once the server (not yet every stream) is up; alive
        # while JetStream is enabled; started once JetStream has recovered its streams.
        "readinessProbe": http_probe("monitor", "/healthz?js-server-only=true", period=5,
                                     failures=3),
        "livenessProbe": http_probe("monitor", "/healthz?js-enabled-only=true", period=10,
                                    failures=6, timeout=5),
        "startupProbe": http_probe("monitor", "/healthz", period=5, failures=90),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    exporter = {
        "name": "exporter",
        "image": NATS_EXPORTER_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-varz", "-jsz=all", "-port", str(NATS_EXPORTER_PORT),
                 f"http://localhost:{NATS_MONITOR_PORT}"],
        "ports": [{"name": "metrics", "containerPort": NATS_EXPORTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        "securityContext": _CONTAINER_SECURITY,
    }
    return _statefulset(opts, "nats", scrape_annotations(NATS_EXPORTER_PORT),
                        [server, exporter], pvc_template(opts, "data", opts.nats_storage))


def _statefulset(opts: K8sOptions, part: str, annotations: dict[str, str],
                 containers: list[dict[str, Any]], claim: dict[str, Any]) -> dict[str, Any]:
    name = object_name(opts, part)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(opts, name, part),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": selector(opts, part)},
            "template": {
                "metadata": {"labels": metadata(opts, name, part)["labels"],
                             "annotations": annotations},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _POD_SECURITY,
                    "containers": containers,
                },
            },
            "volumeClaimTemplates": [claim],
        },
    }
