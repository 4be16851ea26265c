"""``graphs.mocker_disagg`` served as users run it: a long prompt is prefilled remotely.

The decode MockerWorker queues the job on the real prefill queue (NATS JetStream), the
MockerPrefillWorker prefills it on its simulated engine and hands the transfer
parameters back over the request plane; the decode engine waits out the simulated KV
transfer (counted in its ``dynamo_worker_kv_transfer_*``) and tells the prefill worker
it may free the blocks it held.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynagraph.runtime.infra import LocalService
from dynagraph.runtime.rpc import RpcClient
from tests.support.metrics import scrape, total
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import complete, wait_records

pytestmark = pytest.mark.integration

THRESHOLD = 512  # the config's max-local-prefill-length
KV_BYTES_PER_TOKEN = 2048  # the cpu-tiny profile's
rng = random.Random(41)


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_disagg:Frontend", "-f", "configs/mocker_disagg.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}"],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


async def _status(address: str) -> dict[str, Any]:
    rpc = RpcClient()
    try:
        stream = rpc.call(address, "status", {})
        try:
            async for item in stream:
                return dict(item)
        finally:
            await stream.aclose()
    finally:
        await rpc.close()
    raise AssertionError("no status")


def test_a_long_prompt_is_prefilled_remotely_and_its_kv_moved(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    etcd = mocker_infra[0].url
    decode = wait_records(etcd, "MockerWorker", 2)
    prefill = next(iter(wait_records(etcd, "MockerPrefillWorker", 1).values()))
    metrics = sorted({r["metrics"] for r in decode.values()})

    def decode_total(name: str, labels: str = "") -> float:
        return sum(total(scrape(m), name, labels) for m in metrics)

    short = complete(graph.url(), [rng.randrange(10, 900) for _ in range(100)])
    assert short["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert decode_total("dynamo_worker_prefill_requests_total", 'where="local"') == 1
    assert decode_total("dynamo_worker_kv_transfers_total") == 0

    n = 1500
    long = complete(graph.url(), [rng.randrange(10, 900) for _ in range(n)], max_tokens=8)
    assert long["usage"]["completion_tokens"] == 8
    assert long["usage"]["prompt_tokens_details"]["cached_tokens"] == n  # came from the peer
    assert decode_total("dynamo_worker_prefill_requests_total",
                        'reason="long-prompt",where="remote"') == 1
    assert decode_total("dynamo_worker_kv_transfers_total") == 1
    assert decode_total("dynamo_worker_kv_transfer_bytes_total") == n * KV_BYTES_PER_TOKEN
    # 3 MB at 4 GB/s + 1 ms: 1.8 ms simulated (the sum is what the engine waited)
    seconds = decode_total("dynamo_worker_kv_transfer_seconds_sum")
    assert 0.0015 <= seconds < 0.05, seconds
    assert total(scrape(prefill["metrics"]), "dynamo_prefill_queue_wait_seconds_count") == 1

    deadline = time.monotonic() + 10
    while True:  # the decode side said it read the blocks: the prefill engine frees them
        status = asyncio.run(_status(prefill["address"]))
        if status["load"]["kv_blocks_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["outcomes"] == {"handed-off": 1}
    assert status["load"]["kv_blocks_used"] == 0, status
