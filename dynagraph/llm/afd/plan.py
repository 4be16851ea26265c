"""Which FfnWorker computes what: coverage checks and per-layer routes (pure logic).

An FfnWorker holds some layers, and of each either the whole FFN (``experts`` None) or
a set of experts (expert parallel). For one layer the engine needs either one worker
with the whole FFN, or workers whose expert sets *partition* the experts (their
partial sums add up to the layer's output). Workers with equal holdings are replicas:
one of them is picked, by a choice that is stable per engine (``prefer``) and the same
for every layer the replicas share, so an engine talks to one replica of each shard and
many engines spread over the replicas; a failed one is excluded until it is replaced.

    table = RouteTable(peers, num_layers=4, num_experts=4)
    table.missing()                    # [] when every layer can be computed
    table.route(2, dead={"a1"}, prefer=7)   # -> [Route(expert_set=None, peer=...)]
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dynagraph.llm.afd.settings import PeerInfo

ExpertSet = frozenset[int] | None


@dataclass(frozen=True)
class Route:
    """One part of a layer's FFN: the expert set (None: all of it) and who computes it."""

    expert_set: ExpertSet
    peer: PeerInfo


def parse_ranges(spec: str | Sequence[int], upper: int, what: str) -> list[int]:
    """``"0-1,3"`` / ``"all"`` / ``[0, 1]`` -> sorted ids in ``0..upper-1``."""
    if isinstance(spec, str):
        text = spec.strip()
        if text == "all":
            return list(range(upper))
        ids: set[int] = set()
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, sep, hi = part.partition("-")
            try:
                a, b = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"{what}: {part!r} is not a number or range") from None
            if b < a:
                raise ValueError(f"{what}: range {part!r} is empty")
            ids.update(range(a, b + 1))
    else:
        ids = {int(i) for i in spec}
    bad = sorted(i for i in ids if not 0 <= i < upper)
    if bad or not ids:
        raise ValueError(f"{what}: {sorted(ids) or 'nothing'} is not within 0..{upper - 1}")
    return sorted(ids)


def shard_of(index: int, count: int, items: int) -> list[int]:
    """The ``index``-th of ``count`` contiguous, near-equal slices of ``range(items)``."""
    if not 0 <= index < count or count > items:
        raise ValueError(f"shard {index} of {count} does not exist for {items} items")
    base, extra = divmod(items, count)
    start = index * base + min(index, extra)
    return list(range(start, start + base + (1 if index < extra else 0)))


def _pick(replicas: Sequence[PeerInfo], prefer: int, key: str) -> PeerInfo:
    ordered = sorted(replicas, key=lambda p: p.instance)
    return ordered[(prefer + zlib.crc32(key.encode())) % len(ordered)]


class RouteTable:
    """Routes for every layer over a set of live peers."""

    def __init__(self, peers: Iterable[PeerInfo], *, num_layers: int, num_experts: int) -> None:
        self.peers = list(peers)
        self.num_layers = num_layers
        self.num_experts = num_experts

    def _holders(self, layer: int, dead: set[str]) -> dict[ExpertSet, list[PeerInfo]]:
        groups: dict[ExpertSet, list[PeerInfo]] = {}
        for p in self.peers:
            if layer in p.layers and p.instance not in dead:
                key: ExpertSet = None if p.experts is None else frozenset(p.experts)
                if key is not None and len(key) == self.num_experts:
                    key = None  # every expert is the whole FFN
                groups.setdefault(key, []).append(p)
        return groups

    def _partition(self, sets: list[frozenset[int]]) -> list[frozenset[int]] | None:
        """Some of ``sets`` that partition all experts (deterministic), or None."""
        goal = frozenset(range(self.num_experts))
        ordered = sorted(sets, key=lambda s: (min(s), -len(s), sorted(s)))

        def cover(left: frozenset[int]) -> list[frozenset[int]] | None:
            if not left:
                return []
            first = min(left)
            for s in ordered:
                if first in s and s <= left:
                    rest = cover(left - s)
                    if rest is not None:
                        return [s, *rest]
            return None

        return cover(goal)

    def route(self, layer: int, *, dead: set[str] | None = None, prefer: int = 0
              ) -> list[Route] | None:
        """The parts to call for ``layer`` (one per expert set), or None if the live
        peers cannot compute it."""
        groups = self._holders(layer, dead or set())
        if None in groups:
            return [Route(None, _pick(groups[None], prefer, "whole"))]
        if self.num_experts == 0:
            return None
        parts = self._partition([k for k in groups if k is not None])
        if parts is None:
            return None
        return [Route(s, _pick(groups[s], prefer, f"{sorted(s)}")) for s in parts]

    def missing(self, dead: set[str] | None = None) -> list[int]:
        """Layers no combination of live peers can compute."""
        return [layer for layer in range(self.num_layers)
                if self.route(layer, dead=dead) is None]


def assign(num_layers: int, num_experts: int, *, layers: str | Sequence[int] = "all",
           experts: str | Sequence[int] | None = None, split: str = "none", shards: int = 1,
           index: int = 0) -> tuple[list[int], list[int] | None]:
    """What FfnWorker number ``index`` holds: (layers, experts or None for whole FFNs).

    ``split: layers`` gives worker ``index`` the ``index % shards``-th contiguous slice
    of ``layers``; ``split: experts`` the slice of the experts (expert parallel, every
    listed layer); ``none`` gives every worker the same holdings. Workers beyond
    ``shards`` are replicas (``ServiceArgs.workers: shards * replicas``)."""
    held = parse_ranges(layers, num_layers, "layers")
    held_experts: list[int] | None = None
    if experts is not None and experts != "all":
        if num_experts == 0:
            raise ValueError("experts: the model is dense (no experts to split)")
        held_experts = parse_ranges(experts, num_experts, "experts")
    if shards < 1:
        raise ValueError("shards must be at least 1")
    part = index % shards
    if split == "layers":
        held = [held[i] for i in shard_of(part, shards, len(held))]
    elif split == "experts":
        if num_experts == 0:
            raise ValueError("split: experts needs an MoE model; this one is dense")
        pool = held_experts if held_experts is not None else list(range(num_experts))
        held_experts = [pool[i] for i in shard_of(part, shards, len(pool))]
    elif split != "none":
        raise ValueError(f"split must be none, layers or experts, not {split!r}")
    elif shards != 1:
        raise ValueError("shards > 1 needs split: layers or experts")
    if held_experts is not None and len(held_experts) == num_experts:
        held_experts = None
    return held, held_experts
