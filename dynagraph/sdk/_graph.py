"""A graph of components is an immutable value built with ``A.link(B).link(C)``.

The node set is every class in the chain; a ``depends()`` edge survives only if its
target is in that set, or a node that stands in for the target is (``@service(
stands_in_for=...)``: a MockerWorker takes the Processor's and Router's edges to
VllmWorker), so one set of component classes serves several graphs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dynagraph.errors import GraphError
from dynagraph.sdk._service import ServiceSpec, is_service, spec_of


@dataclass(frozen=True)
class Graph:
    """An ordered set of component classes; ``nodes[0]`` is the entry point."""

    nodes: tuple[type, ...]

    @staticmethod
    def of(root: type) -> Graph:
        spec_of(root)
        return Graph((root,))

    @staticmethod
    def closure(root: type) -> Graph:
        """``root`` and everything it depends on, transitively (no pruning)."""
        order: list[type] = []

        def visit(cls: type) -> None:
            if cls in order:
                return
            order.append(cls)
            for dep in spec_of(cls).dependencies.values():
                visit(dep)

        visit(root)
        return Graph(tuple(order))

    def link(self, other: type) -> Graph:
        spec_of(other)
        if other in self.nodes:
            raise GraphError(f"{other.__name__} is linked twice")
        return Graph((*self.nodes, other))

    @property
    def root(self) -> type:
        return self.nodes[0]

    def names(self) -> list[str]:
        return [spec_of(c).name for c in self.nodes]

    def specs(self) -> Iterator[ServiceSpec]:
        for cls in self.nodes:
            yield spec_of(cls)

    def by_name(self, name: str) -> type:
        for cls in self.nodes:
            if spec_of(cls).name == name:
                return cls
        raise GraphError(f"no component named {name!r} in the graph ({', '.join(self.names())})")

    def edges(self, cls: type) -> dict[str, type | None]:
        """``cls``'s dependencies: attribute -> class, or None where pruned."""
        return {attr: self.resolve(target) for attr, target in spec_of(cls).dependencies.items()}

    def resolve(self, target: type) -> type | None:
        """The node a ``depends(target)`` edge reaches: ``target`` itself when linked, else
        the one node standing in for it, else None (pruned)."""
        if target in self.nodes:
            return target
        subs = [c for c in self.nodes if target in spec_of(c).stands_in_for]
        if len(subs) > 1:
            raise GraphError(f"{', '.join(c.__name__ for c in subs)} all stand in for "
                             f"{target.__name__}; link only one")
        return subs[0] if subs else None

    def validate(self) -> None:
        """Every node must be reachable from the root (or a controller) through kept
        edges; a node standing in for another must have all of its endpoints, with the
        same request and item types."""
        names = [spec_of(c).name for c in self.nodes]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise GraphError(f"two components share the name(s) {sorted(dupes)}")
        for cls in self.nodes:
            spec = spec_of(cls)
            have = {e.name: e for e in spec.endpoints}
            for other in spec.stands_in_for:
                lacking = sorted({e.name for e in spec_of(other).endpoints} - set(have))
                if lacking:
                    raise GraphError(f"{spec.name} stands in for {spec_of(other).name} but "
                                     f"lacks its endpoint(s) {', '.join(lacking)}")
                for theirs in spec_of(other).endpoints:  # callers are typed on ``other``
                    ours = have[theirs.name]
                    if ((ours.request_type, ours.response_type)
                            != (theirs.request_type, theirs.response_type)):
                        raise GraphError(
                            f"{spec.name}.{ours.name} takes {_name(ours.request_type)} and "
                            f"yields {_name(ours.response_type)}; {spec_of(other).name}'s, which "
                            f"it stands in for, {_name(theirs.request_type)} and "
                            f"{_name(theirs.response_type)}")
        reached = {self.root, *(c for c in self.nodes if spec_of(c).controller)}
        frontier = list(reached)
        while frontier:
            cls = frontier.pop()
            for target in self.edges(cls).values():
                if target is not None and target not in reached:
                    reached.add(target)
                    frontier.append(target)
        unreached = [spec_of(c).name for c in self.nodes if c not in reached]
        if unreached:
            raise GraphError(
                f"linked but not reachable from {spec_of(self.root).name} through depends(): "
                f"{', '.join(unreached)}"
            )

    def describe(self) -> str:
        lines = []
        for cls in self.nodes:
            spec = spec_of(cls)
            kept = [t.__name__ for t in self.edges(cls).values() if t is not None]
            lines.append(
                f"{spec.name} (namespace {spec.namespace}, endpoints "
                f"{[e.name for e in spec.endpoints] or '-'}) -> {kept or '-'}"
            )
        return "\n".join(lines)


def resolve_target(target: str) -> Graph:
    """Turn ``"module:Name"`` into a Graph.

    ``Name`` may be a Graph value, or a component class: then the module's Graph rooted
    at that class is used if there is exactly one, else the class with all of its
    dependencies.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise GraphError(f"target {target!r} must look like 'package.module:Component'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GraphError(f"cannot import {module_name!r}: {exc}") from exc
    obj: Any = getattr(module, attr, None)
    if obj is None:
        raise GraphError(f"module {module_name!r} has no attribute {attr!r}")
    if isinstance(obj, Graph):
        graph = obj
    elif is_service(obj):
        rooted = [v for v in vars(module).values() if isinstance(v, Graph) and v.root is obj]
        if len(rooted) > 1:
            raise GraphError(f"module {module_name!r} has several graphs rooted at {attr}; name one")
        graph = rooted[0] if rooted else Graph.closure(obj)
    else:
        raise GraphError(f"{target!r} is neither a Graph nor a @service class")
    graph.validate()
    return graph


def _name(kind: type | None) -> str:
    return kind.__name__ if kind is not None else "plain values"
