"""The disagg graph with its KV int8-encoded on the NIXL wire (``kv-transfer-compression:
int8`` on both workers, ``kv-transport: nixl``). Its own package, so the other disagg
graphs are stopped before this one starts; the agg reference and the infrastructure
fixtures are ``tests/e2e_disagg``'s (imported: same prompts, own instances)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import NIXL_ONLY, DisaggGraph, agg_reference, infra, serve_disagg

__all__ = ["agg_reference", "infra", "wire_graph"]

CODEC = ["--VllmWorker.kv-transfer-compression=int8",
         "--PrefillWorker.kv-transfer-compression=int8"]


@pytest.fixture(scope="package")
def wire_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
               agg_reference: object) -> Iterator[DisaggGraph]:
    with serve_disagg(model_dir, infra, [*NIXL_ONLY, *CODEC]) as g:
        yield g
