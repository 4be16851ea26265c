"""``graphs.mocker_disagg_planner`` served as users run it: the Planner scales prefill.

Long prompts (over ``max-local-prefill-length``) from many clients fill the prefill queue
(NATS JetStream): the Planner adds MockerPrefillWorker processes, which pull from the
shared queue. When the load stops it retires them down to ``min-prefill-replicas``
(each finishes the jobs in hand first); every request completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import Load, until_processes

pytestmark = pytest.mark.integration

PREFILL = "MockerPrefillWorker"


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_disagg_planner:Frontend", "-f",
                 "configs/mocker_disagg_planner.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}", "--drain-grace", "30",
                 "--Planner.adjustment-interval=2", "--Planner.metric-pulling-interval=0.25",
                 "--Planner.max-prefill-replicas=2", "--Planner.max-decode-replicas=2",
                 "--Planner.gpu-budget=4"],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


async def test_prefill_workers_follow_the_prefill_queue(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    etcd = mocker_infra[0].url
    assert (await until_processes(etcd, "==", 1, within=10, component=PREFILL)) == [1]
    load = Load(graph.url(), clients=16, max_tokens=4, prompt_len=1500)
    task = asyncio.create_task(load.run())
    try:
        up = await until_processes(etcd, ">=", 2, within=90, component=PREFILL)
    finally:
        load.stop.set()
        await asyncio.wait_for(task, 120)
    down = await until_processes(etcd, "==", 1, within=90, component=PREFILL)
    assert up[-1] == 2 and down[-1] == 1
    assert load.failed == [] and load.done and set(load.done) == {4}
    out = graph.output()
    assert f"scaling {PREFILL} from 1 to 2" in out
    assert f"scaling {PREFILL} from 2 to 1" in out
