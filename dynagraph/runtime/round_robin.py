"""Round robin over a list of candidates that may change between calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


class RoundRobin:
    """One counter: the n-th pick is ``items[n % len(items)]``. Pure; not thread-safe."""

    def __init__(self) -> None:
        self.counter = 0

    def pick(self, items: Sequence[T]) -> T:
        """The next candidate (``IndexError`` if there is none)."""
        if not items:
            raise IndexError("round robin over no candidates")
        item = items[self.counter % len(items)]
        self.counter += 1
        return item

    def order(self, items: Sequence[T]) -> list[T]:
        """Every candidate, starting with the one ``pick`` would return (counts as one pick)."""
        if not items:
            return []
        start = self.counter % len(items)
        self.counter += 1
        return [*items[start:], *items[:start]]
