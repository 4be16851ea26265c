"""A Planner connector for graphs deployed with ``dynamo deploy k8s``.

There every component is a Deployment named ``{graph}-{component in kebab-case}`` whose
pods each run one worker (``dynagraph.deploy.k8s``), so a component's replica count is its
Deployment's ``spec.replicas``. ``KubernetesConnector`` sets it through the ``scale``
subresource (a JSON merge patch: no read-modify-write race with another writer of the
rest of the Deployment); Kubernetes then starts pods, or stops them with SIGTERM, which a
worker answers by withdrawing from discovery and draining (set the pods'
``terminationGracePeriodSeconds`` above ``DYNAMO_DRAIN_GRACE_S``). Serving replicas are
counted in discovery, as ``EtcdScaleConnector`` counts them.

``KubeScaleApi`` talks to the API server with the pod's service account (its token and
CA under ``/var/run/secrets/kubernetes.io/serviceaccount``); the Planner's service
account needs ``get`` and ``patch`` on ``deployments/scale`` in the namespace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import httpx

from dynagraph.deploy._k8s_objects import K8sOptions, object_name
from dynagraph.deploy._k8s_objects import kebab as k8s_part
from dynagraph.errors import InfraError
from dynagraph.planner.connector import Discovery, count_processes

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_URL = "https://kubernetes.default.svc"
MERGE_PATCH = "application/merge-patch+json"


class ScaleApi(Protocol):
    async def get_replicas(self, namespace: str, deployment: str) -> int: ...

    async def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None: ...


def deployment_name(graph: str, component: str) -> str:
    """The Deployment ``dynamo deploy k8s --name GRAPH`` made for ``component``
    (``MockerWorker`` -> ``GRAPH-mocker-worker``; the deploy module's own naming)."""
    return object_name(K8sOptions(name=graph), k8s_part(component))


def scale_path(namespace: str, deployment: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"


class KubeScaleApi:
    """The Deployment ``scale`` subresource over HTTP (``client``: an ``httpx.AsyncClient``
    with the API server as ``base_url`` and the credentials; ``in_cluster()`` makes one)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @staticmethod
    def in_cluster(timeout: float = 5.0) -> KubeScaleApi:
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        client = httpx.AsyncClient(base_url=IN_CLUSTER_URL, timeout=timeout,
                                   verify=str(SERVICE_ACCOUNT / "ca.crt"),
                                   headers={"Authorization": f"Bearer {token}"})
        return KubeScaleApi(client)

    async def get_replicas(self, namespace: str, deployment: str) -> int:
        body = await self._call("GET", scale_path(namespace, deployment))
        return int(body.get("spec", {}).get("replicas", 0))

    async def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None:
        await self._call("PATCH", scale_path(namespace, deployment),
                         json={"spec": {"replicas": replicas}},
                         headers={"Content-Type": MERGE_PATCH})

    async def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            resp = await self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise InfraError(f"Kubernetes API {method} {path}: {exc!r}") from exc
        if resp.status_code >= 400:
            raise InfraError(f"Kubernetes API {method} {path}: HTTP {resp.status_code} "
                             f"{resp.text[:300]}")
        body = resp.json()
        return body if isinstance(body, dict) else {}

    async def close(self) -> None:
        await self.client.aclose()


class KubernetesConnector:
    """Scales the Deployments of a graph deployed as ``graph`` in ``k8s_namespace``."""

    def __init__(self, api: ScaleApi, k8s_namespace: str, graph: str, discovery: Discovery,
                 namespace: str) -> None:
        self.api = api
        self.k8s_namespace = k8s_namespace
        self.graph = graph
        self.discovery = discovery
        self.namespace = namespace

    async def set_replicas(self, component: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        await self.api.set_replicas(self.k8s_namespace,
                                    deployment_name(self.graph, component), replicas)

    async def serving(self, component: str) -> int:
        records = await self.discovery.get_prefix(f"/{self.namespace}/instances/{component}/")
        return count_processes(records)
