"""Discovery's data types, its contract (`Discovery`) and the key layout.

Key layout (one key per registered endpoint instance)::

    /{namespace}/components/{component}/{endpoint}/{instance_id:x}
        -> {"address": "127.0.0.1:PORT", "instance_id": 123, "metadata": {...}}

Values in the store are JSON. The key layout and the JSON codec live here so both
backends (etcd, memory) and the tests share one definition.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from dynagraph.runtime.discovery._watch import InstanceWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceInfo:
    """One live instance of one endpoint, as read from discovery."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    address: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "instance_id": self.instance_id, "metadata": self.metadata}


def endpoint_prefix(namespace: str, component: str, endpoint: str) -> str:
    """Prefix under which every instance of one endpoint is registered (ends with '/')."""
    for what, part in (("namespace", namespace), ("component", component), ("endpoint", endpoint)):
        if not part or "/" in part:
            raise ValueError(f"{what} must be a non-empty name without '/', got {part!r}")
    return f"/{namespace}/components/{component}/{endpoint}/"


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    return f"{endpoint_prefix(namespace, component, endpoint)}{instance_id:x}"


def parse_instance(
    namespace: str, component: str, endpoint: str, key: str, value: Any
) -> InstanceInfo | None:
    """The InstanceInfo stored at ``key``, or None (logged) if the value is malformed."""
    try:
        return InstanceInfo(
            namespace=namespace,
            component=component,
            endpoint=endpoint,
            instance_id=int(value["instance_id"]),
            address=str(value["address"]),
            metadata=dict(value.get("metadata") or {}),
        )
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        log.warning("ignoring malformed instance record at %s: %r (%s)", key, value, e)
        return None


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


_UNDECODABLE = object()


def decode(key: str, raw: bytes) -> Any:
    """JSON-decode a stored value; a non-JSON value is logged and returned as ``_UNDECODABLE``."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        log.warning("value at %s is not JSON (%d bytes); ignoring it", key, len(raw))
        return _UNDECODABLE


def is_undecodable(value: Any) -> bool:
    return value is _UNDECODABLE


@runtime_checkable
class Discovery(Protocol):
    """Service discovery and a small shared key-value store.

    One object per process. ``start()`` connects and grants the process's lease, which
    is kept alive in the background until ``close()``; everything registered through
    ``register()`` or ``put(..., lease=True)`` is bound to that lease, so it vanishes
    when the process dies (after the lease TTL) or closes (at once).
    All methods except ``instance_id`` and ``watch_prefix`` need ``start()`` first.
    """

    @property
    def instance_id(self) -> int:
        """This process's id: its first lease id, stable for the process's life."""
        ...

    async def start(self) -> None:
        """Connect, grant the lease, start the keepalive. Raises DiscoveryError."""
        ...

    async def close(self) -> None:
        """Stop the keepalive, revoke the lease (its keys vanish at once), close watches."""
        ...

    async def register(self, namespace: str, component: str, endpoint: str, address: str,
                       metadata: dict[str, Any] | None = None) -> InstanceInfo:
        """Publish this process as an instance of the endpoint, bound to the lease."""
        ...

    async def watch_instances(self, namespace: str, component: str, endpoint: str) -> InstanceWatch:
        """A live list of the endpoint's instances, filled before this returns."""
        ...

    async def put(self, key: str, value: Any, *, lease: bool = False) -> None:
        """Store ``value`` as JSON; ``lease=True`` binds the key to this process's lease."""
        ...

    async def put_if_absent(self, key: str, value: Any) -> Any:
        """Store ``value`` unless ``key`` exists (atomically); the stored value either way."""
        ...

    async def get(self, key: str) -> Any | None:
        """The decoded value at ``key`` or None."""
        ...

    async def get_prefix(self, prefix: str) -> dict[str, Any]:
        """Every decoded key/value under ``prefix``."""
        ...

    async def delete(self, key: str) -> None:
        """Remove ``key`` (no error if absent)."""
        ...

    def watch_prefix(self, prefix: str) -> AsyncGenerator[tuple[str, Any | None], None]:
        """Current values first, then ``(key, value)`` for puts and ``(key, None)`` for deletes.

        Survives etcd restarts. Close it with ``aclose()`` (or ``contextlib.aclosing``)
        when done, so its watch is cancelled promptly.
        """
        ...
