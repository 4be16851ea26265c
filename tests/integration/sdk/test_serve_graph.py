"""End to end: `dynamo serve` runs a three-component graph as real processes on etcd."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dynagraph.runtime.discovery import EtcdDiscovery
from dynagraph.runtime.rpc import RpcClient
from dynagraph.sdk import EndpointClient
from tests.support.poll import collect
from tests.support.process import pid_alive
from tests.support.serve import ServeProcess

pytestmark = pytest.mark.integration

TARGET = "tests.integration.sdk.demo_graph:Entry"
CONFIG = """
Source:
  step: 1
  ServiceArgs:
    workers: 2
"""


class Harness:
    """A test-side client of the served graph: etcd + request plane."""

    def __init__(self, etcd_url: str) -> None:
        self.disc = EtcdDiscovery(etcd_url)
        self.rpc = RpcClient()
        self.watches: list[Any] = []

    async def __aenter__(self) -> Harness:
        await self.disc.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.watches:
            await w.close()
        await self.rpc.close()
        await self.disc.close()

    async def client(self, component: str, endpoint: str = "generate") -> EndpointClient:
        watch = await self.disc.watch_instances("demo", component, endpoint)
        self.watches.append(watch)
        await watch.wait_for(1, timeout=10)
        return EndpointClient(self.rpc, watch, component, endpoint)

    async def records(self) -> dict[str, Any]:
        return await self.disc.get_prefix("/demo/instances/")


async def serve_demo(run_serve: Callable[..., ServeProcess], config_file: Path, *extra: str,
                     **kw: Any) -> ServeProcess:
    """`dynamo serve` the demo graph and wait for its ready banner."""
    sp = run_serve(TARGET, "-f", str(config_file), *extra, **kw)
    await asyncio.to_thread(sp.wait_ready, 60)
    return sp


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    p = tmp_path / "demo.yaml"
    p.write_text(CONFIG)
    return p


async def test_stream_10k_responses_and_both_workers_serve(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    sp = await serve_demo(run_serve, config_file)
    async with Harness(etcd_url) as h:
        entry = await h.client("Entry")
        t0 = time.perf_counter()
        items = await collect(entry.round_robin({"n": 10_000}))
        elapsed = time.perf_counter() - t0
        assert [i for i, _ in items] == list(range(10_000))
        pids = {pid for _ in range(8) for _, pid in await collect(entry.round_robin({"n": 1}))}
        source_pids = {r["pid"] for k, r in (await h.records()).items() if "/Source/" in k}
        assert len(source_pids) == 2 and pids == source_pids
        print(f"10,000 responses through 3 processes in {elapsed * 1e3:.0f} ms")
        all_pids = [r["pid"] for r in (await h.records()).values()]
        assert len(all_pids) == 4
        t0 = time.perf_counter()
        assert sp.stop() == 0
        stop_secs = time.perf_counter() - t0
        assert stop_secs < 10, stop_secs
        assert not [p for p in all_pids if pid_alive(p)]
        # Only the namespace's graph secret stays (shared by every serve, on purpose).
        assert list(await h.disc.get_prefix("/demo/")) == ["/demo/graph-secret"]


async def test_sigkill_of_one_instance_is_forgotten_within_ttl(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    sp = await serve_demo(run_serve, config_file)
    async with Harness(etcd_url) as h:
        entry = await h.client("Entry")
        sources = await h.client("Source")
        victim = sources.instances()[0]
        os.kill(victim.metadata["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        while pid_alive(victim.metadata["pid"]):  # noqa: ASYNC110 - polling another process
            # a call racing the kill may break mid-stream
            await asyncio.sleep(0.005)
        ok = 0
        while victim.instance_id in sources.instance_ids():
            assert time.monotonic() - t0 < 3 + 1, "killed instance still registered after TTL + 1 s"
            # calls keep succeeding on the other instance meanwhile
            assert len(await collect(entry.round_robin({"n": 3}))) == 3
            ok += 1
        gone_after = time.monotonic() - t0
        print(f"killed instance gone from discovery after {gone_after:.2f}s ({ok} calls meanwhile)")
    assert sp.stop() == 0


async def test_restart_never_stops_the_graph_with_the_childs_exit_code(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    sp = await serve_demo(run_serve, config_file, "--restart", "never")
    async with Harness(etcd_url) as h:
        pids = [r["pid"] for r in (await h.records()).values()]
        source = await h.client("Source")
        os.kill(source.instances()[0].metadata["pid"], signal.SIGKILL)
        await asyncio.to_thread(sp.proc.wait, 15)
        assert sp.proc.returncode == 128 + signal.SIGKILL
        assert "stopping the graph (--restart never)" in sp.output()
        assert not [p for p in pids if pid_alive(p)]
        deadline = time.monotonic() + 5  # the killed one's lease expires within its TTL
        while await h.disc.get_prefix("/demo/instances/"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)


async def test_crashed_child_is_restarted_with_backoff(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    sp = await serve_demo(run_serve, config_file)
    async with Harness(etcd_url) as h:
        relay = await h.client("Relay")
        old = relay.instances()[0]
        os.kill(old.metadata["pid"], signal.SIGKILL)
        await asyncio.to_thread(sp.wait_for_line, "restarting Relay:0 in 1s", 10)
        deadline = time.monotonic() + 15
        while [i.instance_id for i in relay.instances()] in ([], [old.instance_id]):
            assert time.monotonic() < deadline, sp.output()
            await asyncio.sleep(0.05)
        entry = await h.client("Entry")
        assert len(await collect(entry.round_robin({"n": 5}))) == 5
    assert sp.stop() == 0


async def test_cancelled_stream_cancels_the_callee(
    run_serve: Callable[..., ServeProcess], config_file: Path, etcd_url: str
) -> None:
    sp = await serve_demo(run_serve, config_file)
    async with Harness(etcd_url) as h:
        entry = await h.client("Entry")
        it = entry.round_robin({"n": 2, "hold": True}, headers={"x-request-id": "cancel-me"})
        assert len([await it.__anext__(), await it.__anext__()]) == 2
        await it.aclose()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 3
        while await h.disc.get("/demo/cancelled/cancel-me") is None:
            assert time.monotonic() < deadline, f"Source was not cancelled:\n{sp.output()[-4000:]}"
            await asyncio.sleep(0.02)
        await h.disc.delete("/demo/cancelled/cancel-me")
    assert sp.stop() == 0


async def test_embedded_etcd_and_nats_are_started_and_stopped(
    run_serve: Callable[..., ServeProcess], config_file: Path, serve_env: dict[str, str]
) -> None:
    env = {k: v for k, v in serve_env.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    sp = await serve_demo(run_serve, config_file, env=env)
    pids = [int(m) for m in re.findall(r"started (?:etcd|nats-server) pid=(\d+)", sp.output())]
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    assert sp.stop() == 0
    assert not [p for p in pids if pid_alive(p)]


@pytest.mark.parametrize(
    ("text", "extra", "needle"),
    [
        ("Source:\n  stepp: 2\n", [], "component Source, key 'stepp': unknown key"),
        ("Source:\n  step: many\n", [], "component Source, key 'step': Input should be a valid integer"),
        ("Sink:\n  a: 1\n", [], "component Sink: unknown component"),
        ("Source: [\n", [], "broken YAML"),
        ("", ["--Source.step=x"], "component Source, key 'step'"),
    ],
)
def test_bad_config_exits_2_before_starting_anything(
    tmp_path: Path, serve_env: dict[str, str], text: str, extra: list[str], needle: str
) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "dynagraph.cli.main", "serve", TARGET, "-f", str(cfg), *extra],
        cwd=Path(__file__).resolve().parents[3], env=serve_env, capture_output=True, text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert needle in out.stderr and str(cfg) in out.stderr


def test_dry_run_prints_graph_and_resolved_config(config_file: Path, serve_env: dict[str, str]) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "dynagraph.cli.main", "serve", TARGET, "-f", str(config_file),
         "--dry-run", "--Source.step=5"],
        cwd=Path(__file__).resolve().parents[3], env=serve_env, capture_output=True, text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Entry (namespace demo" in out.stdout and '"step": 5' in out.stdout
