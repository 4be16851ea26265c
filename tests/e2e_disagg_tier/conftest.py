"""The disagg graph with ``kv-transport: tier`` (``dynamo serve graphs.disagg:Frontend``):
decode and prefill worker share a KV tier on /dev/shm. Its own package, so the NIXL
graph of ``tests/e2e_disagg`` is stopped before this one starts; the agg reference and
the infrastructure fixtures are that package's (imported: same prompts, own instances)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import DisaggGraph, agg_reference, infra, serve_disagg
from tests.support.paths import shm_dir

__all__ = ["agg_reference", "infra", "tier_graph"]


@pytest.fixture(scope="package")
def shm_tier() -> Iterator[Path]:
    with shm_dir("dynagraph-test-kv-") as path:
        yield path


@pytest.fixture(scope="package")
def tier_graph(model_dir: Path, infra: tuple[LocalService, LocalService], shm_tier: Path,
               agg_reference: object) -> Iterator[DisaggGraph]:
    with serve_disagg(model_dir, infra, [f"--{c}.{k}" for c in ("VllmWorker", "PrefillWorker")
                                         for k in ("kv-offload-gib=0.02",
                                                   f"kv-offload-dir={shm_tier}",
                                                   "kv-transport=tier")]) as g:
        yield g
