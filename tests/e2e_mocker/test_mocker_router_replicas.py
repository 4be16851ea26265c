"""``graphs.mocker_router`` with two Processors and two Router replicas, served as users
run it (``--Processor.ServiceArgs.workers=2 --Router.ServiceArgs.workers=2``).

Each Router follows the other's in-flight stream and builds the same index, so a repeated
prefix is found cached whichever Processor and Router carry the repeat; a Router that is
SIGKILLed comes back (dynamo serve restarts it) with a full index, and requests sent
meanwhile all succeed.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import complete, records, token_ids, wait_records

pytestmark = pytest.mark.integration

ENGINES = 4
BLOCK = 32
rng = random.Random(48)


def tokens(n: int) -> list[int]:
    return token_ids(rng, n)


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_router:Frontend", "-f", "configs/mocker_router.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}",
                 f"--MockerWorker.engines-per-process={ENGINES}",
                 "--Processor.ServiceArgs.workers=2", "--Router.ServiceArgs.workers=2",
                 "--Router.overlap-weight=2"],  # as test_mocker_router.py, for its reason
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


def index_full_times(output: str) -> list[float]:
    return [float(s) for s in re.findall(r"index full: .* in ([0-9.]+) s", output)]


def test_two_routers_follow_each_other_and_repeats_hit_through_either(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    etcd = mocker_infra[0].url
    routers = wait_records(etcd, "Router", 2)
    assert len({r["pid"] for r in routers.values()}) == 2
    assert len(wait_records(etcd, "Processor", 2)) == 2
    deadline = time.monotonic() + 10
    while graph.output().count("following Router replica") < 2:
        assert time.monotonic() < deadline, graph.output()[-3000:]
        time.sleep(0.1)
    for _ in range(3):
        prefix = tokens(8 * BLOCK)
        assert complete(graph.url(), prefix + tokens(20))[
            "usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # round robin at both hops: the repeats go through both Processors and both Routers
        for _ in range(4):
            again = complete(graph.url(), prefix + tokens(20))
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK


def test_a_killed_router_comes_back_with_a_full_index_and_loses_nothing(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    etcd = mocker_infra[0].url
    before = wait_records(etcd, "Router", 2)
    seen = len(index_full_times(graph.output()))
    victim = int(next(iter(before.values()))["pid"])
    prefix = tokens(8 * BLOCK)
    complete(graph.url(), prefix + tokens(20))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    answered = 0
    while True:  # requests keep coming while the Router is gone and comes back
        complete(graph.url(), prefix + tokens(20))  # asserts 200
        answered += 1
        pids = {int(r["pid"]) for r in asyncio.run(records(etcd, "Router")).values()}
        if victim not in pids and len(pids) == 2:
            break
        assert time.monotonic() < deadline, graph.output()[-3000:]
    times = index_full_times(graph.output())
    assert len(times) > seen, graph.output()[-3000:]
    assert times[-1] < 2.0
    # the new Router's index holds the prefix: repeats through it (and the other) hit
    for _ in range(4):
        again = complete(graph.url(), prefix + tokens(20))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
    assert answered > 0
