"""The disagg graph with ``kv-transport: shm`` (``dynamo serve graphs.disagg:Frontend``):
both engines' KV caches in shared memory, the decode engine copies the prefill engine's
blocks. Its own package, so the NIXL graph of ``tests/e2e_disagg`` is stopped before this
one starts; the agg reference and the infrastructure fixtures are that package's
(imported: same prompts, own instances)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import DisaggGraph, agg_reference, infra, serve_disagg

__all__ = ["agg_reference", "infra", "shm_graph"]


@pytest.fixture(scope="package")
def shm_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
              agg_reference: object) -> Iterator[DisaggGraph]:
    with serve_disagg(model_dir, infra, ["--VllmWorker.kv-transport=shm",
                                         "--PrefillWorker.kv-transport=shm"]) as g:
        yield g
