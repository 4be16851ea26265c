"""The disagg graph with its KV int8-encoded on the NIXL wire (``kv-transfer-compression:
int8`` on both workers, ``kv-transport: nixl``). Its own package, so the other disagg
graphs are stopped before this one starts; the agg reference and the infrastructure
fixtures are ``tests/e2e_disagg``'s (imported: same prompts, own instances)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.e2e_disagg.conftest import NIXL_ONLY, THRESHOLD, DisaggGraph, agg_reference, infra
from tests.support.serve import graph_env, served

__all__ = ["agg_reference", "infra", "wire_graph"]

CODEC = ["--VllmWorker.kv-transfer-compression=int8",
         "--PrefillWorker.kv-transfer-compression=int8"]


@pytest.fixture(scope="package")
def wire_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
               agg_reference: object) -> Iterator[DisaggGraph]:
    etcd, nats = infra
    with served(["graphs.disagg:Frontend", "-f", "configs/disagg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}",
                 f"--VllmWorker.max-local-prefill-length={THRESHOLD}", *NIXL_ONLY, *CODEC],
                graph_env(etcd.url, nats.url)) as sp:
        banner = sp.wait_for_line("VllmWorker[0] pid=")
        m = re.search(r"metrics=(\S+)", banner)
        assert m is not None, banner
        yield DisaggGraph(sp, sp.url(), m.group(1), etcd.url, nats.url)
