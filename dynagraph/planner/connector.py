"""How a Planner's decision reaches the processes: connectors.

``dynamo serve`` follows ``/{namespace}/scale/{Component}`` in etcd (the value is the
number of worker processes wanted, ``{"replicas": N}`` or a bare ``N``): it starts
workers up to N and retires the highest-numbered ones down to N (a retired worker
withdraws from discovery, so no new request reaches it, finishes its requests in flight
within ``--drain-grace`` and exits). ``EtcdScaleConnector`` writes those keys (the
Planner's, on its lease: if the Planner dies the key goes and the graph keeps the count
it has); anyone can write them by hand::

    etcdctl put /dynamo/scale/MockerWorker '{"replicas": 3}'

``serving`` counts the worker processes registered in discovery (distinct ``host``/``pid``
among the component's instance records; a process of ``engines-per-process`` engines
is one replica).
"""

from __future__ import annotations

from typing import Any, Protocol

SCALE_PREFIX = "scale"


def scale_prefix(namespace: str) -> str:
    return f"/{namespace}/{SCALE_PREFIX}/"


def scale_key(namespace: str, component: str) -> str:
    return f"{scale_prefix(namespace)}{component}"


def parse_replicas(value: Any) -> int | None:
    """The replica count a scale key holds, or None if it is not one (deleted, malformed,
    negative)."""
    if isinstance(value, dict):
        value = value.get("replicas")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def count_processes(records: dict[str, Any]) -> int:
    """Distinct worker processes among instance records (``get_prefix`` of a component's
    instances: several endpoints and engines of one process count once)."""
    seen: set[tuple[Any, Any]] = set()
    for key, value in records.items():
        if isinstance(value, dict):
            seen.add((value.get("host"), value.get("pid", key)))
    return len(seen)


class Connector(Protocol):
    """Sets and reads the replica counts of components."""

    async def set_replicas(self, component: str, replicas: int) -> None: ...

    async def serving(self, component: str) -> int:
        """Replicas of ``component`` registered and serving now."""
        ...


class Discovery(Protocol):
    async def put(self, key: str, value: Any, *, lease: bool = False) -> None: ...

    async def get_prefix(self, prefix: str) -> dict[str, Any]: ...


class EtcdScaleConnector:
    """Scales the components of a ``dynamo serve`` graph through its scale keys."""

    def __init__(self, discovery: Discovery, namespace: str) -> None:
        self.discovery = discovery
        self.namespace = namespace

    async def set_replicas(self, component: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        await self.discovery.put(scale_key(self.namespace, component), {"replicas": replicas},
                                 lease=True)

    async def serving(self, component: str) -> int:
        records = await self.discovery.get_prefix(f"/{self.namespace}/instances/{component}/")
        return count_processes(records)
