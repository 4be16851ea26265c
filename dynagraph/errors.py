"""One exception hierarchy for the whole project.

    DynagraphError
    ├── ConfigError            bad YAML / unknown component / unknown key / wrong type
    ├── GraphError             a graph that cannot be built (cycle, missing link, bad target)
    ├── TraceError             a request trace that cannot be read (names the file and line)
    ├── InfraError             etcd / NATS / Prometheus missing or not ready
    ├── DiscoveryError         registration or watch failed
    ├── RequestPlaneError      anything that went wrong on a streaming RPC
    │   ├── NoInstancesError       no live instance of the target endpoint
    │   ├── InstanceUnavailable    connect failed / peer died before the request was sent
    │   │                          (safe to retry on another instance)
    │   ├── StreamBroken           peer died mid-stream (not safe to retry blindly)
    │   └── RemoteError            the callee raised; carries remote type and message
    ├── EngineError            the inference engine failed a request
    ├── RequestShed            refused under load to protect other work (HTTP 429)
    └── InvalidRequest         a request that breaks the API contract (HTTP 400)
        └── PromptTooLong

Messages say what was wrong and, where it helps, what to do about it.
"""

from __future__ import annotations


class DynagraphError(Exception):
    """Base class of every error raised by dynagraph."""


class ConfigError(DynagraphError):
    """A configuration problem. The message names the file, the component and the key."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        component: str | None = None,
        key: str | None = None,
    ) -> None:
        self.file = file
        self.component = component
        self.key = key
        where = []
        if file:
            where.append(f"file {file}")
        if component:
            where.append(f"component {component}")
        if key:
            where.append(f"key {key!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(f"{prefix}{message}")


class GraphError(DynagraphError):
    """A component graph that cannot be built or served."""


class TraceError(DynagraphError):
    """A request trace (``dynamo simulate --trace``) that cannot be read. The message
    names the file and, for a bad line, its number."""


class InfraError(DynagraphError):
    """A required piece of infrastructure (etcd, NATS, ...) is missing or not ready."""


class DiscoveryError(DynagraphError):
    """Registering or watching instances in the discovery store failed."""


class RequestPlaneError(DynagraphError):
    """Base class of streaming RPC failures."""


class NoInstancesError(RequestPlaneError):
    """No live instance is registered for the endpoint being called."""


class InstanceUnavailable(RequestPlaneError):
    """The chosen instance could not be reached; the request was NOT delivered.

    Callers may retry on another instance.
    """

    def __init__(self, message: str, *, instance_id: int | None = None) -> None:
        self.instance_id = instance_id
        super().__init__(message)


class StreamBroken(RequestPlaneError):
    """The connection died after the request was delivered; the callee may have acted on it."""


class InvalidResponse(RequestPlaneError):
    """The callee answered with an item that is not its endpoint's declared item type."""


class RemoteError(RequestPlaneError):
    """The callee raised an exception. ``remote_type`` is its class name."""

    def __init__(self, remote_type: str, message: str) -> None:
        self.remote_type = remote_type
        self.remote_message = message
        super().__init__(f"{remote_type}: {message}")


class EngineError(DynagraphError):
    """The inference engine failed a request."""


class InvalidRequest(DynagraphError):
    """A request that breaks the API contract; maps to HTTP 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        self.param = param
        self.code = code
        super().__init__(message)


class PromptTooLong(InvalidRequest):
    """The prompt (plus requested tokens) does not fit the model's context."""


class RequestShed(DynagraphError):
    """The request was refused under load (SLO-aware admission); retry after
    ``retry_after`` seconds. Maps to HTTP 429."""

    def __init__(self, message: str, *, retry_after: int = 1, code: str = "shed") -> None:
        self.retry_after = retry_after
        self.code = code
        super().__init__(message)


class Requeued(DynagraphError):
    """A worker handed back a request that had not started (no output yet), for the
    caller to place again (the Router's rebalancing: a place is free elsewhere)."""


# Errors that may cross the request plane and be re-raised as their own type on the
# caller side (instead of a generic RemoteError), keyed by class name.
WIRE_ERRORS: dict[str, type[DynagraphError]] = {
    cls.__name__: cls
    for cls in (InvalidRequest, PromptTooLong, EngineError, NoInstancesError, StreamBroken,
                RequestShed, Requeued)
}
