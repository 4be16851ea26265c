"""The Kubernetes connector: the scale subresource requests, against a fake API server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from dynagraph.errors import InfraError
from dynagraph.planner.kubernetes import (
    MERGE_PATCH,
    KubernetesConnector,
    KubeScaleApi,
    deployment_name,
)
from dynagraph.runtime.discovery import MemoryDiscovery


class FakeApiServer:
    """Deployments' replicas behind the ``scale`` subresource, as the API server has them."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas
        self.requests: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        parts = request.url.path.split("/")
        # /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
        if parts[1:5] != ["apis", "apps", "v1", "namespaces"] or parts[6:9:2] != [
                "deployments", "scale"]:
            return httpx.Response(404, json={"message": "not found"})
        name = parts[7]
        if name not in self.replicas:
            return httpx.Response(404, json={"message": f"deployments {name} not found"})
        if request.method == "PATCH":
            if request.headers["content-type"] != MERGE_PATCH:
                return httpx.Response(415)
            self.replicas[name] = json.loads(request.content)["spec"]["replicas"]
        return httpx.Response(200, json={"kind": "Scale", "metadata": {"name": name},
                                         "spec": {"replicas": self.replicas[name]}})


def api_for(server: FakeApiServer) -> KubeScaleApi:
    return KubeScaleApi(httpx.AsyncClient(base_url="https://k8s.test",
                                          transport=httpx.MockTransport(server.handle),
                                          headers={"Authorization": "Bearer t0k"}))


async def discovery(records: dict[str, Any]) -> MemoryDiscovery:
    """The library's in-memory discovery, started, holding ``records`` on its lease."""
    disc = MemoryDiscovery()
    await disc.start()
    for key, value in records.items():
        await disc.put(key, value, lease=True)
    return disc


def test_deployment_names_are_those_dynamo_deploy_makes() -> None:
    assert deployment_name("g1", "MockerWorker") == "g1-mocker-worker"
    assert deployment_name("g1", "VllmWorker") == "g1-vllm-worker"
    assert deployment_name("prod", "PrefillWorker") == "prod-prefill-worker"


async def test_scale_is_a_merge_patch_of_the_scale_subresource() -> None:
    server = FakeApiServer({"g1-mocker-worker": 1})
    api = api_for(server)
    disc = await discovery({"/dynamo/instances/MockerWorker/a": {"pid": 7, "host": "pod-a"},
                            "/dynamo/instances/MockerWorker/b": {"pid": 7, "host": "pod-b"}})
    conn = KubernetesConnector(api, "serving", "g1", disc, "dynamo")
    try:
        await conn.set_replicas("MockerWorker", 3)
        assert server.replicas == {"g1-mocker-worker": 3}
        req = server.requests[-1]
        assert (req.method, req.url.path) == (
            "PATCH", "/apis/apps/v1/namespaces/serving/deployments/g1-mocker-worker/scale")
        assert json.loads(req.content) == {"spec": {"replicas": 3}}
        assert req.headers["authorization"] == "Bearer t0k"
        assert await api.get_replicas("serving", "g1-mocker-worker") == 3
        assert await conn.serving("MockerWorker") == 2  # one process per pod
        assert await disc.get_prefix("/dynamo/scale/") == {}  # the API server scales, not etcd
    finally:
        await api.close()
        await disc.close()


async def test_api_errors_are_infra_errors() -> None:
    server = FakeApiServer({})
    api = api_for(server)
    disc = await discovery({})
    conn = KubernetesConnector(api, "serving", "g1", disc, "dynamo")
    try:
        with pytest.raises(InfraError, match="HTTP 404"):
            await conn.set_replicas("MockerWorker", 2)
        with pytest.raises(ValueError):
            await conn.set_replicas("MockerWorker", -1)
    finally:
        await api.close()
        await disc.close()
