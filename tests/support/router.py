"""Router state for unit tests: workers known and reporting, nothing cached yet."""

from __future__ import annotations

import random

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router import RouterState


def state_with(*workers: int) -> RouterState:
    """A RouterState (seeded) with ``workers`` live, each with 1,000 free KV blocks."""
    s = RouterState(random.Random(0))
    for w in workers:
        s.add_worker(w)
        s.set_load(w, EngineLoad(kv_blocks_total=1000))
    return s
