"""The agg_router graph's two workers, each engine's runner bound to a core of its own
(``cpu-threads-bind: spread``): on a 2-core box every core is an engine's, so the graph's
processes keep every core and the engines get their ``engine-nice`` from ``dynamo serve``'s
core keeper; on a larger one the graph keeps off those cores.

The graph is the package's: a worker another test killed may still be restarting. While
one engine is gone the keeper rightly keeps the graph off the survivor's core (and the
survivor keeps the niceness it had: it only goes up), so the check waits for both workers
and then for the keeper's next scans to settle."""

from __future__ import annotations

import contextlib

import pytest

from dynagraph.cli.core_keeper import INTERVAL_S
from tests.support.cores import assert_cores_kept
from tests.support.poll import until
from tests.support.serve import ServeProcess

from ._probe import GraphProbe

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="package")]


async def test_engines_yield_to_the_graph_only_where_they_share_its_cores(
        router_graph: ServeProcess, probe: GraphProbe) -> None:
    await probe.wait_workers(2)

    def kept() -> bool:
        try:
            assert_cores_kept(router_graph.proc.pid, router_graph.output())
        except AssertionError:
            return False
        return True

    with contextlib.suppress(AssertionError):  # the check below says what is wrong
        await until(kept, 5 * INTERVAL_S, "the keeper's scans to settle", INTERVAL_S / 4)
    assert_cores_kept(router_graph.proc.pid, router_graph.output())
