"""Decorators a component author uses: ``@service``, ``@endpoint``, ``depends()`` and the
lifecycle hooks. They attach plain metadata to the class; nothing is registered
globally and nothing runs on import.

Construction (Ray Serve's ``.bind()`` idea): ``@service`` makes the class's constructor
take its collaborators as arguments::

    Processor(config, runtime=rt, router=router_client, worker=worker_client)

``runtime`` becomes ``self.runtime`` and each ``depends()`` name becomes the attribute
of that name, *before* the author's ``__init__(self, config)`` runs; a dependency not
passed is ``None`` (as when the graph does not link it) and a missing ``runtime`` is
a standalone ``RuntimeContext`` (no discovery, a private metrics registry). An author's
``__init__`` may also declare ``runtime`` or a dependency as a keyword parameter to
receive it directly. ``dynamo serve`` constructs components exactly this way, so a unit
test builds the real component with in-memory clients.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec
from pydantic import BaseModel

from dynagraph.errors import GraphError

if TYPE_CHECKING:
    from dynagraph.sdk._context import RuntimeContext
    from dynagraph.sdk._graph import Graph

T = TypeVar("T", bound=type)
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

_SPEC_ATTR = "__dynagraph_service__"
_ENDPOINT_ATTR = "__dynagraph_endpoint__"
_DRAIN_ATTR = "__dynagraph_drain__"
_HOOK_ATTR = "__dynagraph_hook__"


@dataclass(frozen=True)
class EndpointSpec:
    """One async-generator method exposed on the request plane."""

    name: str
    method_name: str
    request_type: type | None  # a pydantic model or msgspec Struct; None: raw payload
    response_type: type | None = None
    """What each item is (``AsyncIterator[X]``: a msgspec Struct or pydantic model); the
    caller's client decodes items into it. None: plain msgpack values."""
    drain: bool = True
    """False for a subscription (a stream that only ends when its caller leaves): on
    shutdown it is cancelled at once instead of being waited for."""


@dataclass(frozen=True)
class ServiceSpec:
    """What ``@service`` records about a component class."""

    name: str
    namespace: str
    workers: int
    resources: dict[str, Any]
    endpoints: tuple[EndpointSpec, ...]
    dependencies: dict[str, type]  # attribute name -> component class
    config_param: str | None  # name of the __init__ parameter typed with a pydantic model
    config_type: type[BaseModel] | None
    on_start: tuple[str, ...] = field(default=())
    on_shutdown: tuple[str, ...] = field(default=())
    stands_in_for: tuple[type, ...] = field(default=())
    """Components this one can replace in a graph (see ``service(stands_in_for=...)``)."""
    instances_key: str | None = None
    """A key of this component's config that sets ``ServiceArgs.instances-per-process``."""
    controller: bool = False
    """Runs beside the graph, not reached through ``depends()`` (a Planner)."""


class Dependency:
    """Marker left on the class by ``depends(Other)``.

    At run time the SDK replaces it, on the instance, with a client for ``Other``
    (see ``dynagraph.sdk.ComponentClient``), or with ``None`` when the graph being
    served does not link ``Other``.
    """

    def __init__(self, target: type) -> None:
        self.target = target

    def __repr__(self) -> str:
        return f"depends({self.target.__name__})"


def depends(target: type[C]) -> C:
    """Declare that this component calls ``target`` (another ``@service`` class).

    For the type checker the attribute is a ``target``: ``self.worker.generate(req)`` is
    checked against ``target.generate``'s request type and yields its declared item type.
    At run time it is a client (``ComponentClient``) whose attributes are the endpoints'
    clients (``EndpointClient``; ``dynagraph.sdk.direct`` / ``at_random`` /
    ``instance_ids`` take them), or ``None`` when the graph does not link ``target``.
    """
    if not isinstance(target, type):
        raise GraphError(f"depends() takes a component class, got {target!r}")
    return typing.cast(C, Dependency(target))


def endpoint(name: str | None = None, *, drain: bool = True) -> Callable[[F], F]:
    """Expose an async-generator method ``(self, request) -> AsyncIterator[...]``.

    If ``request`` is annotated with a pydantic model or a msgspec Struct, incoming
    payloads are validated into it (a failure reaches the caller as ``InvalidRequest``).
    ``drain=False`` marks a subscription (an endless stream such as KV events): shutdown
    cancels it at once instead of waiting for it like a request in flight.
    """

    def wrap(fn: F) -> F:
        if not inspect.isasyncgenfunction(fn):
            raise GraphError(f"@endpoint {fn.__qualname__} must be an async generator (async def + yield)")
        setattr(fn, _ENDPOINT_ATTR, name or fn.__name__)
        setattr(fn, _DRAIN_ATTR, drain)
        return fn

    return wrap


def async_on_start(fn: F) -> F:
    """Run ``await self.fn()`` after construction, before the endpoints are registered."""
    setattr(fn, _HOOK_ATTR, "start")
    return fn


def async_on_shutdown(fn: F) -> F:
    """Run ``await self.fn()`` on shutdown, after the endpoints are unregistered."""
    setattr(fn, _HOOK_ATTR, "shutdown")
    return fn


def service(
    *,
    dynamo: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
    workers: int = 1,
    name: str | None = None,
    stands_in_for: type | tuple[type, ...] = (),
    instances_key: str | None = None,
    controller: bool = False,
) -> Callable[[T], T]:
    """Mark a class as a component. ``dynamo={"namespace": ...}`` sets its namespace.

    ``stands_in_for=Other``: linked into a graph that does not link ``Other``, this
    component receives every ``depends(Other)`` edge (``Frontend.link(Processor)
    .link(MockerWorker)`` gives the Processor's ``depends(VllmWorker)`` a client of
    MockerWorker). It must have every endpoint ``Other`` has (``Graph.validate``).

    ``instances_key="engines-per-process"``: that key of the component's config sets
    ``ServiceArgs.instances-per-process`` (how many instances, each registered on its
    own, one process runs); the user-facing name of a generic SDK setting.

    ``controller=True``: a component that watches or steers the graph (the Planner) and
    that nothing depends on; linked, it need not be reachable from the entry point.
    """
    stand_ins = stands_in_for if isinstance(stands_in_for, tuple) else (stands_in_for,)

    def wrap(cls: T) -> T:
        namespace = (dynamo or {}).get("namespace", "dynamo")
        spec = ServiceSpec(
            name=name or cls.__name__,
            namespace=namespace,
            workers=workers,
            resources=dict(resources or {}),
            endpoints=tuple(_endpoints(cls)),
            dependencies=_dependencies(cls),
            config_param=None,
            config_type=None,
            on_start=tuple(_hooks(cls, "start")),
            on_shutdown=tuple(_hooks(cls, "shutdown")),
            stands_in_for=stand_ins,
            instances_key=instances_key,
            controller=controller,
        )
        param, cfg_type = _config_param(cls)
        if instances_key is not None and instances_key not in _config_keys(cfg_type):
            raise GraphError(f"{cls.__name__}: instances_key {instances_key!r} is not a key of "
                             "its config")
        spec = ServiceSpec(**{**spec.__dict__, "config_param": param, "config_type": cfg_type})
        setattr(cls, _SPEC_ATTR, spec)
        # setattr: the class is only known as a type variable here (mypy: "T has no link").
        setattr(cls, "__init__", _injecting_init(cls, spec))  # noqa: B010
        if not hasattr(cls, "link"):
            setattr(cls, "link", classmethod(_link))  # noqa: B010
        return cls

    return wrap


class Component:
    """Optional base class of a component: gives type checkers ``link`` and ``runtime``.

    ``@service`` works on any class; inheriting from this one only adds the static types
    (``Frontend.link(Processor)`` and ``self.runtime`` are then checked by mypy).
    """

    runtime: RuntimeContext
    __dynagraph_service__: ClassVar[ServiceSpec]

    @classmethod
    def link(cls, other: type) -> Graph:
        """The graph ``[cls, other]``; chain further ``.link()`` calls on the result."""
        return _link(cls, other)


def _link(cls: type, other: type) -> Graph:
    from dynagraph.sdk._graph import Graph

    return Graph.of(cls).link(other)


def _injecting_init(cls: type, spec: ServiceSpec) -> Callable[..., None]:
    """``__init__(self, config=None, /, *, runtime=None, **dependencies)`` around the author's."""
    authored = _own_or_inherited_init(cls)
    accepts = set(inspect.signature(authored).parameters) if authored is not None else set()
    deps = tuple(spec.dependencies)
    passed_through = [n for n in ("runtime", *deps) if n in accepts]

    def __init__(self: Any, config: Any = None, /, *, runtime: Any = None,
                 **clients: Any) -> None:
        unknown = sorted(set(clients) - set(deps))
        if unknown:
            raise TypeError(f"{cls.__name__}() got unknown dependencies {unknown}; "
                            f"it depends on {list(deps) or 'nothing'}")
        if runtime is None and "runtime" not in self.__dict__:
            from dynagraph.sdk._context import RuntimeContext

            runtime = RuntimeContext.standalone(spec.namespace, spec.name)
        if runtime is not None:
            self.runtime = runtime
        for name in deps:
            if name in clients or name not in self.__dict__:
                setattr(self, name, clients.get(name))
        if authored is None:
            return
        kwargs = {n: getattr(self, n) for n in passed_through}
        if spec.config_param is not None:
            if config is None:
                raise TypeError(f"{cls.__name__}() needs its config "
                                f"({spec.config_type.__name__ if spec.config_type else '?'})")
            authored(self, config, **kwargs)
        elif config is not None:
            raise TypeError(f"{cls.__name__}.__init__ takes no config")
        else:
            authored(self, **kwargs)

    if authored is not None:
        functools.update_wrapper(__init__, authored)
    __init__.__dynagraph_injecting__ = True  # type: ignore[attr-defined]
    return __init__


def spec_of(cls: type) -> ServiceSpec:
    """The ``ServiceSpec`` of a component class, or a GraphError if it has none."""
    spec = cls.__dict__.get(_SPEC_ATTR) if isinstance(cls, type) else None
    if spec is None:
        raise GraphError(f"{getattr(cls, '__name__', cls)!r} is not a component (missing @service)")
    return typing.cast(ServiceSpec, spec)


def is_service(obj: Any) -> bool:
    return isinstance(obj, type) and _SPEC_ATTR in obj.__dict__


def _endpoints(cls: type) -> list[EndpointSpec]:
    out: list[EndpointSpec] = []
    seen: set[str] = set()
    for attr, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
        ep_name = getattr(fn, _ENDPOINT_ATTR, None)
        if ep_name is None:
            continue
        if ep_name in seen:
            raise GraphError(f"{cls.__name__}: two endpoints named {ep_name!r}")
        seen.add(ep_name)
        out.append(EndpointSpec(ep_name, attr, _request_type(cls, fn), _response_type(fn),
                                drain=getattr(fn, _DRAIN_ATTR, True)))
    return out


def _request_type(cls: type, fn: Callable[..., Any]) -> type | None:
    params = list(inspect.signature(fn).parameters.values())[1:]
    if len(params) != 1:
        raise GraphError(f"@endpoint {cls.__name__}.{fn.__name__} must take exactly one request argument")
    hints = _hints(fn)
    ann = hints.get(params[0].name)
    if isinstance(ann, type) and issubclass(ann, BaseModel | msgspec.Struct):
        return ann
    return None


def _response_type(fn: Callable[..., Any]) -> type | None:
    """``X`` of an ``-> AsyncIterator[X]`` (or ``AsyncGenerator[X, ...]``) annotation when
    ``X`` is a msgspec Struct or pydantic model; else None (plain values)."""
    ret = _hints(fn).get("return")
    args = typing.get_args(ret)
    item = args[0] if args else None
    if isinstance(item, type) and issubclass(item, BaseModel | msgspec.Struct):
        return item
    return None


def _dependencies(cls: type) -> dict[str, type]:
    deps: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, Dependency):
                deps[attr] = value.target
    return deps


def _hooks(cls: type, kind: str) -> list[str]:
    return [
        attr
        for attr, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if getattr(fn, _HOOK_ATTR, None) == kind
    ]


def _own_or_inherited_init(cls: type) -> Callable[..., None] | None:
    """The ``__init__`` the author wrote (or inherited from a base other than ``object``)."""
    init: Callable[..., None] | None = cls.__dict__.get("__init__")
    inherited = getattr(cls, "__init__")  # noqa: B009 - mypy refuses cls.__init__ on a type
    if init is None and inherited is not object.__init__:
        init = inherited
    return init


def _config_param(cls: type) -> tuple[str | None, type[BaseModel] | None]:
    init = _own_or_inherited_init(cls)
    if init is None:
        return None, None
    hints = _hints(init)
    for p in list(inspect.signature(init).parameters.values())[1:]:
        ann = hints.get(p.name)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return p.name, ann
    return None, None


def _config_keys(cfg_type: type[BaseModel] | None) -> set[str]:
    """How the config's fields are spelled in YAML (their aliases, else their names)."""
    if cfg_type is None:
        return set()
    return {f.alias or name for name, f in cfg_type.model_fields.items()}


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # a forward reference we cannot resolve
        raise GraphError(f"cannot resolve type hints of {fn.__qualname__}: {exc}") from exc
