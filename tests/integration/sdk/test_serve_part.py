"""One graph from two ``dynamo serve`` processes (``--service-name``) sharing etcd, as on
two hosts; each is ready when *its own* instances are, never counting the other's."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from dynagraph.runtime.discovery import EtcdDiscovery
from tests.integration.cli.slow_graph import GATE
from tests.integration.sdk.test_serve_graph import CONFIG, TARGET, Harness
from tests.support.poll import collect
from tests.support.serve import ServeProcess

pytestmark = pytest.mark.integration

SLOW = "tests.integration.cli.slow_graph:Slow"


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    p = tmp_path / "demo.yaml"
    p.write_text(CONFIG)
    return p


def banner_components(sp: ServeProcess) -> list[str]:
    return [m.group(1) for line in sp.lines if (m := re.match(r"  (\w+)\[\d+\] pid=", line))]


async def test_two_serves_run_one_graph_each_its_part(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    front = run_serve(TARGET, "-f", str(config_file), "--service-name", "Entry",
                      "--service-name", "Relay")
    back = run_serve(TARGET, "-f", str(config_file), "--service-name", "Source")
    await asyncio.gather(asyncio.to_thread(front.wait_ready, 60),
                         asyncio.to_thread(back.wait_ready, 60))
    assert banner_components(front) == ["Entry", "Relay"]
    assert banner_components(back) == ["Source", "Source"]
    assert "(here: Entry, Relay; the rest elsewhere)" in front.output()
    async with Harness(etcd_url) as h:
        entry = await h.client("Entry")
        items = await collect(entry.round_robin({"n": 50}))
        assert [i for i, _ in items] == list(range(50))
        records = await h.records()
        by_component: dict[str, set[str]] = {}
        for key, rec in records.items():
            by_component.setdefault(key.split("/")[3], set()).add(rec["serve_id"])
        assert by_component["Entry"] == by_component["Relay"]
        assert len(by_component["Source"]) == 1
        assert by_component["Source"] != by_component["Entry"]
        source_pids = {r["pid"] for k, r in records.items() if "/Source/" in k}
        pids = {pid for _ in range(6) for _, pid in await collect(entry.round_robin({"n": 1}))}
        assert pids == source_pids
    assert back.stop() == 0
    assert front.stop() == 0


async def test_readiness_counts_only_its_own_instances(
    run_serve: Callable[..., ServeProcess], serve_env: dict[str, str], etcd_url: str
) -> None:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        await disc.put(GATE, "open")
        first = run_serve(SLOW)
        await asyncio.to_thread(first.wait_ready, 60)
        await disc.delete(GATE)
        # Another serve of the same component: its own instance never starts (gate
        # closed), and the first serve's registered instance must not make it ready.
        second = run_serve(SLOW, "--ready-timeout", "4")
        code = await asyncio.to_thread(second.proc.wait, 60)
        assert code == 1, second.output()
        assert "still missing: Slow (1 of 1 instances)" in second.output()
        assert first.proc.poll() is None
        assert first.stop() == 0
    finally:
        await disc.delete(GATE)
        await disc.close()
