"""``dynamo status`` and ``dynamo settings`` against graphs served by ``dynamo serve``
(external etcd and NATS: the session's), run as users run them: as commands."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynagraph.runtime.discovery import EtcdDiscovery
from dynagraph.runtime.rpc import RpcClient
from dynagraph.sdk import EndpointClient
from tests.integration.cli.slow_graph import GATE
from tests.support.poll import collect, until
from tests.support.serve import REPO, ServeProcess, graph_env, served

pytestmark = pytest.mark.integration

DEMO = "tests.integration.sdk.demo_graph:Entry"
ROUTER = "tests.integration.cli.router_graph:Router"


@pytest.fixture
def env(etcd_url: str, nats_url: str, tmp_path: Path) -> dict[str, str]:
    """The served graph's and the commands' environment; state files in a private dir."""
    return {**graph_env(etcd_url, nats_url), "DYNAGRAPH_STATE_DIR": str(tmp_path / "state")}


def dynamo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dynagraph.cli.main", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def demo(env: dict[str, str], tmp_path: Path) -> Iterator[ServeProcess]:
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("Source:\n  ServiceArgs:\n    workers: 2\n")
    with served([DEMO, "-f", str(cfg)], env, ready_timeout=60) as sp:
        yield sp


def banner_pids(sp: ServeProcess) -> dict[str, int]:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^  (\w+\[\d+\]) pid=(\d+) ", sp.output(), re.M)}


def test_status_finds_every_component_with_its_instances(
        demo: ServeProcess, env: dict[str, str]) -> None:
    out = dynamo(env, "status", "--json")  # ETCD_ENDPOINTS set: the state file names the graph
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["found"].startswith(f"etcd {env['ETCD_ENDPOINTS']}, used by dynamo serve pid "
                                    f"{demo.pid}: {DEMO}")
    assert snap["namespaces"] == ["demo"]
    assert snap["components"] == {"Entry": {"ready": 1, "starting": 0, "expected": 1},
                                  "Relay": {"ready": 1, "starting": 0, "expected": 1},
                                  "Source": {"ready": 2, "starting": 0, "expected": 2}}
    pids = banner_pids(demo)
    seen = {f"{i['component']}[{i['worker_index']}]": i for i in snap["instances"]}
    assert {k: v["pid"] for k, v in seen.items()} == pids
    assert all(i["health"] == "ok" and i["state"] == "ready" for i in seen.values()), seen
    assert all(0 <= snap["taken_at"] - i["started_at"] < 120 for i in seen.values())

    table = dynamo(env, "status")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0] == f"dynamo status: {snap['found']}"
    assert rows[2].split() == ["COMPONENT", "READY", "INSTANCE", "ADDRESS", "PID", "UPTIME",
                               "HEALTH", "RUNNING", "WAITING", "KV", "USED"]
    body = rows[3:]
    assert [r.split()[:2] for r in body if not r.startswith(" ")] == [
        ["Entry", "1/1"], ["Relay", "1/1"], ["Source", "2/2"]]
    assert len(body) == 4 and body[3].startswith(" ")  # Source's second instance
    assert sorted(int(r.split()[-3]) for r in body) == sorted(pids.values())
    assert [r.split()[-1] for r in body] == ["ok"] * 4


def test_status_without_etcd_endpoints_finds_the_local_serve_and_stops_finding_it(
        env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("Source:\n  ServiceArgs:\n    workers: 1\n")
    local = {k: v for k, v in env.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    with served([DEMO, "-f", str(cfg)], local, ready_timeout=60) as sp:
        out = dynamo(local, "status", "--json")
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert snap["found"].endswith("(started by it)") and f"pid {sp.pid}" in snap["found"]
        assert {n: c["ready"] for n, c in snap["components"].items()} == {
            "Entry": 1, "Relay": 1, "Source": 1}
    gone = dynamo(local, "status")
    assert gone.returncode == 1
    assert "no running dynamo serve found" in gone.stderr
    assert not list((tmp_path / "state").glob("serve-*.json"))


def test_two_local_graphs_are_told_apart(env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("Source:\n  ServiceArgs:\n    workers: 1\n")
    local = {k: v for k, v in env.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    with served([DEMO, "-f", str(cfg)], local, ready_timeout=60) as one, \
            served([ROUTER], local, ready_timeout=60) as two:
        both = dynamo(local, "status")
        assert both.returncode == 2
        first, *listed = both.stderr.strip().splitlines()
        assert first == ("dynamo status: found 2 running dynamo serve processes; choose one "
                         "with --pid (or --namespace):")
        assert [line.split(": ")[0] for line in listed] == [
            f"  dynamo serve pid {one.pid}", f"  dynamo serve pid {two.pid}"]
        by_ns = dynamo(local, "status", "--json", "--namespace", "opstest")
        assert by_ns.returncode == 0, by_ns.stderr
        snap = json.loads(by_ns.stdout)
        assert f"pid {two.pid}: {ROUTER}" in snap["found"] and snap["namespaces"] == ["opstest"]
        assert snap["components"] == {"Router": {"ready": 1, "starting": 0, "expected": 1}}
        by_pid = dynamo(local, "status", "--json", "--pid", str(one.pid))
        assert by_pid.returncode == 0, by_pid.stderr
        assert list(json.loads(by_pid.stdout)["components"]) == ["Entry", "Relay", "Source"]
        setting = dynamo(local, "settings", "get", "Router", "mode")
        assert setting.returncode == 2  # which graph's Router? the user must say
        ok = dynamo(local, "settings", "get", "--pid", str(two.pid), "Router", "mode")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.split() == ["Router", "mode", "=", "kv", "config", "(one", "of", "kv,",
                                     "kv-load,", "round-robin,", "random)"]


async def test_a_process_in_its_start_hooks_shows_as_starting(
        env: dict[str, str], etcd_url: str) -> None:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    await disc.delete(GATE)
    sp = ServeProcess(["tests.integration.cli.slow_graph:Slow"], env)
    try:
        async def snapshot() -> dict[str, Any]:
            out = await asyncio.to_thread(dynamo, env, "status", "--json")
            return json.loads(out.stdout) if out.returncode == 0 else {}

        starting: dict[str, Any] = {}  # until both the state file and the process are seen
        while not starting.get("instances") or \
                starting["components"]["Slow"]["expected"] is None:
            assert sp.proc.poll() is None, sp.output()[-3000:]
            starting = await asyncio.wait_for(snapshot(), 60)
        assert starting["components"] == {"Slow": {"ready": 0, "starting": 1, "expected": 1}}
        [inst] = starting["instances"]
        assert (inst["state"], inst["health"], inst["address"]) == ("starting", "-", None)
        table = (await asyncio.to_thread(dynamo, env, "status")).stdout.splitlines()
        assert table[3].split()[:3] == ["Slow", "0/1", "(+1"]
        assert table[3].split()[-1] == "starting"
        await disc.put(GATE, "open")
        await asyncio.to_thread(sp.wait_ready, 60)
        ready = await snapshot()
        assert ready["components"] == {"Slow": {"ready": 1, "starting": 0, "expected": 1}}
        assert ready["instances"][0]["instance_id"] == inst["instance_id"]
    finally:
        await disc.delete(GATE)
        await disc.close()
        assert sp.stop() == 0, sp.output()[-3000:]


class RouterClient:
    """Asks the served Router for decisions, as the Processor does."""

    def __init__(self, etcd_url: str) -> None:
        self.disc = EtcdDiscovery(etcd_url)
        self.rpc = RpcClient()
        self.watch: Any = None
        self.client: EndpointClient | None = None

    async def __aenter__(self) -> RouterClient:
        await self.disc.start()
        self.watch = await self.disc.watch_instances("opstest", "Router", "generate")
        await self.watch.wait_for(1, timeout=10)
        self.client = EndpointClient(self.rpc, self.watch, "Router", "generate")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.watch.close()
        await self.rpc.close()
        await self.disc.close()

    async def decide(self) -> dict[str, Any]:
        assert self.client is not None
        [decision] = await collect(self.client.round_robin({"token_ids": list(range(64))}))
        return dict(decision)


async def test_settings_set_changes_the_router_mode_live(
        env: dict[str, str], etcd_url: str) -> None:
    with served([ROUTER], env, ready_timeout=60) as sp:
        async with RouterClient(etcd_url) as router:
            await until(lambda: "worker" in sp.output() and sp.output().count("joined") >= 2,
                        within=10, what="the Router to see both workers")
            assert (await router.decide())["mode"] == "kv"

            bad = await asyncio.to_thread(dynamo, env, "settings", "set", "Router", "mode",
                                          "fastest")
            assert bad.returncode == 2
            assert bad.stderr.strip() == (
                "dynamo settings: Router mode: 'fastest' is not allowed: expected one of "
                "kv, kv-load, round-robin, random")
            assert await router.disc.get("/opstest/settings/Router/mode") is None

            done = await asyncio.to_thread(dynamo, env, "settings", "set", "Router", "mode",
                                           "round-robin")
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == ("Router mode: kv (config) -> round-robin "
                                           "(etcd /opstest/settings/Router/mode)")
            assert await router.disc.get("/opstest/settings/Router/mode") == "round-robin"
            await until(lambda: "mode: kv -> round-robin" in sp.output(), within=10,
                        what="the Router's log of the new mode")
            decisions = [await router.decide() for _ in range(6)]
            assert {d["mode"] for d in decisions} == {"round-robin"}
            workers = [d["worker_id"] for d in decisions]
            assert len(set(workers)) == 2
            assert all(a != b for a, b in zip(workers, workers[1:], strict=False))

            shown = await asyncio.to_thread(dynamo, env, "status")
            assert shown.returncode == 0, shown.stderr
            assert re.search(r"^  Router\s+mode\s+round-robin\s+etcd$", shown.stdout, re.M)
            assert re.search(r"^  Router\s+overlap-weight\s+1\s+config$", shown.stdout, re.M)
            rows = shown.stdout.splitlines()
            worker_rows = [r for r in rows if r.startswith(("VllmWorker", "    "))]
            assert worker_rows[0].split()[:2] == ["VllmWorker", "2/2"] and len(worker_rows) == 2
            for row in worker_rows:  # the workers' load gauges: 1 running, 2 waiting, 25/100
                assert row.split()[-5:] == ["ok", "1", "2", "25.0%", "(25/100)"]

            undone = await asyncio.to_thread(dynamo, env, "settings", "unset", "Router", "mode")
            assert undone.returncode == 0, undone.stderr
            assert undone.stdout.strip() == "Router mode: round-robin (etcd) -> kv (config)"
            await until(lambda: "mode: round-robin -> kv (deleted; config value)"
                        in sp.output(), within=10, what="the Router going back to kv")
            assert (await router.decide())["mode"] == "kv"
