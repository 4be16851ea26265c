"""``graphs.mocker_planner`` served as users run it: the Planner scales the decode workers.

Heavy load (more concurrent requests than one engine's batch) makes requests wait: the
Planner asks ``dynamo serve`` (its scale key in etcd) for more MockerWorker processes,
which register and take requests. Then a light load of long requests keeps running
while the Planner scales back down to one worker: the retired workers withdraw and
drain, so every request of both phases completes in full (no request lost).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import Load, until_processes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_planner:Frontend", "-f", "configs/mocker_planner.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}", "--drain-grace", "30",
                 "--Planner.adjustment-interval=2", "--Planner.metric-pulling-interval=0.25",
                 "--Planner.max-decode-replicas=3", "--Planner.gpu-budget=3"],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


async def test_scales_up_under_load_and_down_when_idle_losing_no_request(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    etcd = mocker_infra[0].url
    assert (await until_processes(etcd, "==", 1, within=10)) == [1]
    heavy = Load(graph.url(), clients=24, max_tokens=24)
    heavy_task = asyncio.create_task(heavy.run())
    light = Load(graph.url(), clients=3, max_tokens=150)  # about one per worker
    light_task: asyncio.Task[None] | None = None
    try:
        up = await until_processes(etcd, ">=", 3, within=90)
        # the light load starts before the heavy one stops: with a gap between them (the
        # heavy clients finishing their last requests, slow on a loaded machine) the
        # Planner could scale down before any light request was in flight to drain
        light_task = asyncio.create_task(light.run())
        heavy.stop.set()
        down = await until_processes(etcd, "==", 1, within=90)
    finally:
        heavy.stop.set()
        light.stop.set()
        await asyncio.wait_for(heavy_task, 120)
        if light_task is not None:
            await asyncio.wait_for(light_task, 120)
    deadline = time.monotonic() + 45  # the retired workers finish draining

    def retired() -> int:
        return graph.output().count("retired (exit code 0)")

    while retired() < 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls the output
        await asyncio.sleep(0.25)
    out = graph.output()
    assert up[0] == 1 and up[-1] == 3, up
    assert down[0] >= 2 and down[-1] == 1, down
    assert heavy.failed == [] and light.failed == [], (heavy.failed, light.failed,
                                                       out[-6000:])
    assert heavy.done and set(heavy.done) == {24}
    assert light.done and set(light.done) == {150}
    assert "scaling MockerWorker from 1 to " in out
    assert out.count("retired (exit code 0)") >= 2, out[-3000:]
    # a retired worker had requests in flight: it drained them (they all completed above)
    drained = [ln for ln in out.splitlines()
               if ln.startswith("[MockerWorker:") and "draining" in ln]
    assert drained, out[-3000:]
    assert "did not drain" not in out and "still running after" not in out
