"""The disagg graph with ``kv-transport: tier`` (``dynamo serve graphs.disagg:Frontend``):
decode and prefill worker share a KV tier on /dev/shm. Its own package, so the NIXL
graph of ``tests/e2e_disagg`` is stopped before this one starts; the agg reference and
the infrastructure fixtures are that package's (imported: same prompts, own instances)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import THRESHOLD, DisaggGraph, agg_reference, infra
from tests.support.paths import shm_dir
from tests.support.serve import graph_env, served

__all__ = ["agg_reference", "infra", "tier_graph"]


@pytest.fixture(scope="package")
def shm_tier() -> Iterator[Path]:
    with shm_dir("dynagraph-test-kv-") as path:
        yield path


@pytest.fixture(scope="package")
def tier_graph(model_dir: Path, infra: tuple[LocalService, LocalService], shm_tier: Path,
              agg_reference: object) -> Iterator[DisaggGraph]:
    etcd, nats = infra
    tier = [f"--{c}.{k}" for c in ("VllmWorker", "PrefillWorker") for k in (
        "kv-offload-gib=0.02", f"kv-offload-dir={shm_tier}", "kv-transport=tier")]
    with served(["graphs.disagg:Frontend", "-f", "configs/disagg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}",
                 f"--VllmWorker.max-local-prefill-length={THRESHOLD}", *tier],
                graph_env(etcd.url, nats.url)) as sp:
        banner = sp.wait_for_line("VllmWorker[0] pid=")
        m = re.search(r"metrics=(\S+)", banner)
        assert m is not None, banner
        yield DisaggGraph(sp, sp.url(), m.group(1), etcd.url, nats.url)
