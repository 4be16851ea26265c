"""Per-process and per-request context a component can read.

``self.runtime`` (a ``RuntimeContext``) is handed to every component's constructor
(``@service`` sets it before the author's ``__init__`` runs). The current request id travels in a context variable: handlers see
the caller's id, clients forward it, and the log filter prints it.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from dynagraph.runtime.rpc import REQUEST_ID_HEADER

if TYPE_CHECKING:
    from dynagraph.sdk._client import ClientFactory, EndpointClient

__all__ = ["REQUEST_ID_HEADER", "RuntimeContext", "current_request_id"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dynagraph_request_id", default=None
)


def current_request_id() -> str | None:
    """The id of the request being handled by this task, if any."""
    return _request_id.get()


def set_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    return _request_id.set(request_id)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    try:
        _request_id.reset(token)
    except ValueError:  # an async generator finalized from another context
        _request_id.set(None)


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` ("-" outside a request) for log formats."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get() or "-"
        return True


@dataclass
class RuntimeContext:
    """What the running process knows about itself.

    ``metadata`` may be filled by the component in its ``@async_on_start`` hook (for
    example ``{"url": "http://127.0.0.1:8000"}``); it is published with the instance.
    ``registry`` is where the component's Prometheus metrics go (the process's default
    registry when served). ``clients`` builds clients of components found by name
    (``client()``); None in a standalone context.
    """

    namespace: str
    component: str
    worker_index: int
    instance_id: int
    discovery: Any  # dynagraph.runtime.discovery.Discovery, or None when standalone
    nats_url: str | None = None
    metrics_address: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    registry: CollectorRegistry = REGISTRY
    clients: ClientFactory | None = None

    @classmethod
    def standalone(cls, namespace: str, component: str) -> RuntimeContext:
        """A context for a component built outside ``dynamo serve`` (unit tests, scripts):
        no discovery, instance id 0, a private metrics registry."""
        return cls(namespace=namespace, component=component, worker_index=0, instance_id=0,
                   discovery=None, registry=CollectorRegistry())

    async def client(self, component: str, endpoint: str, *,
                     namespace: str | None = None,
                     response_type: type | None = None) -> EndpointClient:
        """A client of ``component``'s ``endpoint``, found by name in discovery; its items
        are decoded into ``response_type`` (None: plain values).

        For calls to a component that is not a ``depends()`` of this one (e.g. the
        PrefillWorker calling back the decode worker that queued a job). Cached per
        endpoint; closed with the component.
        """
        if self.clients is None:
            raise RuntimeError(f"{self.component}: no discovery in a standalone runtime")
        return await self.clients.endpoint(namespace or self.namespace, component, endpoint,
                                           response_type=response_type)

    def settings_prefix(self, component: str | None = None) -> str:
        """etcd prefix of runtime-tunable settings: ``/{ns}/settings/{component}/``."""
        return f"/{self.namespace}/settings/{component or self.component}/"


def process_key(namespace: str, component: str, instance_id: int) -> str:
    """Key of the per-process record used for readiness and metrics discovery."""
    return f"/{namespace}/instances/{component}/{instance_id:x}"


def starting_key(namespace: str, component: str, instance_id: int) -> str:
    """Key of a process that is starting (lease-bound, deleted once it is registered):
    ``{"pid", "host", "worker_index", "started_at"}``, for ``dynamo status``."""
    return f"/{namespace}/starting/{component}/{instance_id:x}"
