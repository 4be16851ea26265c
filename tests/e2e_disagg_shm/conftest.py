"""The disagg graph with ``kv-transport: shm`` (``dynamo serve graphs.disagg:Frontend``):
both engines' KV caches in shared memory, the decode engine copies the prefill engine's
blocks. Its own package, so the NIXL graph of ``tests/e2e_disagg`` is stopped before this
one starts; the agg reference and the infrastructure fixtures are that package's
(imported: same prompts, own instances)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import THRESHOLD, DisaggGraph, agg_reference, infra
from tests.support.serve import graph_env, served

__all__ = ["agg_reference", "infra", "shm_graph"]


@pytest.fixture(scope="package")
def shm_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
              agg_reference: object) -> Iterator[DisaggGraph]:
    etcd, nats = infra
    with served(["graphs.disagg:Frontend", "-f", "configs/disagg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}",
                 f"--VllmWorker.max-local-prefill-length={THRESHOLD}",
                 "--VllmWorker.kv-transport=shm", "--PrefillWorker.kv-transport=shm"],
                graph_env(etcd.url, nats.url)) as sp:
        banner = sp.wait_for_line("VllmWorker[0] pid=")
        m = re.search(r"metrics=(\S+)", banner)
        assert m is not None, banner
        yield DisaggGraph(sp, sp.url(), m.group(1), etcd.url, nats.url)
