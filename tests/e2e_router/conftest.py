"""One agg_router graph (two vLLM workers, KV events, Router) shared by these tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.serve import ServeProcess

from ._probe import GraphProbe

MAX_MODEL_LEN = 1024
MODEL = "tiny-llama"


@pytest.fixture(scope="package")
def router_graph(model_dir: Path, etcd_url: str, nats_url: str) -> Iterator[ServeProcess]:
    # Engine cores in their own processes, as in production: with two in-process engine
    # cores on 2 cores, a worker's event loop (and its lease keepalive) can starve.
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    sp = ServeProcess(
        ["graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml", "--Frontend.port=0",
         f"--Common.model={model_dir}", f"--Common.max-model-len={MAX_MODEL_LEN}",
         "--VllmWorker.max-num-seqs=8"],
        env,
    )
    try:
        sp.wait_ready(240)
        yield sp
    finally:
        sp.stop()
        log_path = os.environ.get("DYNAGRAPH_TEST_GRAPH_LOG")
        if log_path:  # the graph's whole output, for post-mortems of a CI run
            Path(log_path).write_text(sp.output())


@pytest.fixture(scope="package")
def router_url(router_graph: ServeProcess) -> str:
    return router_graph.url()


@pytest.fixture(scope="package")
async def probe(router_graph: ServeProcess, etcd_url: str) -> AsyncIterator[GraphProbe]:
    p = GraphProbe(etcd_url)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
