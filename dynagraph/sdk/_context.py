"""Per-process and per-request context a component can read.

``self.runtime`` (a ``RuntimeContext``) is set on every component instance before its
``__init__`` runs. The current request id travels in a context variable: handlers see
the caller's id, clients forward it, and the log filter prints it.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any

from dynagraph.runtime.rpc import REQUEST_ID_HEADER

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
    """

    namespace: str
    component: str
    worker_index: int
    instance_id: int
    discovery: Any  # dynagraph.runtime.discovery.Discovery
    nats_url: str | None = None
    metrics_address: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def settings_prefix(self, component: str | None = None) -> str:
        """etcd prefix of runtime-tunable settings: ``/{ns}/settings/{component}/``."""
        return f"/{self.namespace}/settings/{component or self.component}/"


def process_key(namespace: str, component: str, instance_id: int) -> str:
    """Key of the per-process record used for readiness and metrics discovery."""
    return f"/{namespace}/instances/{component}/{instance_id:x}"
