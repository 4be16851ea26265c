"""One agg_router graph (two vLLM workers, KV events, Router, two Processors) shared by
these tests.

Their async code runs in an event loop of this package (``loop_scope="package"``), not
the session's: at the end of a long session, the session loop stopped seeing some of its
sockets become readable (the Frontend's complete answers sat unread in the test process,
CLOSE-WAIT with data queued, until the client's read timeout), which broke the 400-stream
and migration tests only when run after the other e2e packages. The deaf sockets had low,
reused fd numbers; why the loop missed them is not established (no selector key with a
closed socket was found). The load clients of the migration and overload tests also run
in fresh loops on threads of their own: with the package loop alone it happened once more."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support.paths import shm_dir
from tests.support.serve import ServeProcess, graph_env, served

from ._probe import GraphProbe

MAX_MODEL_LEN = 1024
POOL_GIB = 0.02
"""Each worker keeps a small host KV pool (``kv-offload-gib``), as users may, with a tier
under it that both share (``kv-offload-dir``, on /dev/shm: ``shared_tier``). With a tier the
pool's region lives in /dev/shm too: small, so a small /dev/shm (containers) holds both."""
TIER_LIMIT_GIB = 1
"""A limit on the shared tier (``kv-offload-dir-gib``) that these tests never reach: its
trimmer runs and reports the tier's size, deleting nothing the tests look for."""
MODEL = "tiny-llama"


@pytest.fixture(scope="package")
def shared_tier() -> Iterator[Path]:
    with shm_dir("dynagraph-test-tier-") as path:
        yield path


@pytest.fixture(scope="package")
def router_graph(model_dir: Path, etcd_url: str, nats_url: str,
                 shared_tier: Path) -> Iterator[ServeProcess]:
    # Engine cores in their own processes, as in production: two in-process engine cores
    # on 2 cores can starve a worker's event loop and its lease keepalive.
    with served(["graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}",
                 f"--Common.max-model-len={MAX_MODEL_LEN}", "--VllmWorker.max-num-seqs=8",
                 f"--VllmWorker.kv-offload-gib={POOL_GIB}",
                 f"--VllmWorker.kv-offload-dir={shared_tier}",
                 f"--VllmWorker.kv-offload-dir-gib={TIER_LIMIT_GIB}",
                 "--Frontend.max-inflight-requests=48", "--Frontend.max-queued-requests=48",
                 "--Frontend.queue-timeout=5", "--Processor.ServiceArgs.workers=2"],
                graph_env(etcd_url, nats_url), clean_exit=False) as sp:
        yield sp


@pytest.fixture(scope="package")
def router_url(router_graph: ServeProcess) -> str:
    return router_graph.url()


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def probe(router_graph: ServeProcess, etcd_url: str) -> AsyncIterator[GraphProbe]:
    p = GraphProbe(etcd_url)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
