"""The agg_router graph's two workers, each engine's runner bound to a core of its own
(``cpu-threads-bind: spread``): on a 2-core box every core is an engine's, so the graph's
processes keep every core and the engines get their ``engine-nice`` from ``dynamo serve``'s
core keeper; on a larger one the graph keeps off those cores."""

from __future__ import annotations

import pytest

from tests.support.cores import assert_cores_kept
from tests.support.serve import ServeProcess

pytestmark = [pytest.mark.vllm]


def test_engines_yield_to_the_graph_only_where_they_share_its_cores(
        router_graph: ServeProcess) -> None:
    assert_cores_kept(router_graph.proc.pid, router_graph.output())
