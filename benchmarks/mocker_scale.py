"""256 mocker engines behind one Router: how long until ready, what they cost at idle.

    python benchmarks/mocker_scale.py [--workers 4] [--engines 64] [--idle-seconds 10]

Serves ``graphs.mocker_router`` (``configs/mocker_router.yaml``) with ``--workers``
MockerWorker processes of ``--engines`` engines each, every engine its own instance
in discovery, on its own etcd and NATS. Measures:

- ready time: the ready banner's figure (every instance registered) and the wall time
  from spawning ``dynamo serve`` to the banner; then how much later the Router follows
  every engine (it has applied each one's KV snapshot: ``dynamo_router_index_blocks``
  has a sample per engine); instances found in etcd;
- a first routed completion (HTTP 200 through Frontend, Processor, Router, an engine);
- idle CPU: cores used over ``--idle-seconds`` by every process (the supervisor's tree,
  etcd, NATS), after ``--settle`` seconds; and each process's resident memory.

Target (issue 14): ready in <= 120 s with 4 x 64 engines. Writes
benchmarks/results/mocker_scale.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REPO,
    cpu_delta,
    process_tree_cpu,
    publish,
)
from benchmarks._mocker import (  # noqa: E402
    engine_counters,
    exit_on_sigterm,
    instance_records,
    serve_graph,
)
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.mocker_scale")
TARGET_READY_S = 120.0


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--name", default="mocker_scale")
    return p.parse_args()


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, pid in pids.items():
        for key, secs in process_tree_cpu(pid).items():
            out[f"{label}/{key}" if label != "graph" else key] = secs
    return out


def _rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, pid in pids.items():
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                cmd = p.cmdline()
                name = (f"{cmd[cmd.index('--component') + 1]}:{cmd[cmd.index('--index') + 1]}"
                        if "--component" in cmd else (label if label != "graph" else "supervisor"))
                out[name] = round(p.memory_info().rss / 2**20, 1)
            except (psutil.NoSuchProcess, ValueError, IndexError):
                continue
    return out


async def _router_follows(disc: EtcdDiscovery) -> int:
    """Engines whose KV snapshot the Router has applied (a ``dynamo_router_index_blocks``
    sample each)."""
    import aiohttp

    recs = await disc.get_prefix("/dynamo/instances/Router/")
    address = next(iter(recs.values()))["metrics"]
    async with aiohttp.ClientSession() as s, s.get(f"http://{address}/metrics") as r:
        text = await r.text()
    return sum(1 for line in text.splitlines() if line.startswith("dynamo_router_index_blocks{"))


async def _probe(url: str, etcd_url: str, want: int) -> dict[str, Any]:
    import aiohttp

    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        t0 = time.monotonic()
        while True:  # polling another process's /metrics: no event to wait on
            following = await _router_follows(disc)
            if following >= want or time.monotonic() - t0 > 60:
                break
            await asyncio.sleep(0.1)
        follow_s = time.monotonic() - t0
        recs = await instance_records(disc, "MockerWorker")
        t0 = time.monotonic()
        body = {"model": "tiny-llama", "prompt": list(range(10, 600)), "max_tokens": 8}
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                        json=body) as r:
            status, answer = r.status, await r.json()
        first_s = time.monotonic() - t0
        counters = await engine_counters(disc, "MockerWorker",
                                         ("dynamo_worker_kv_total_blocks",))
    finally:
        await disc.close()
    return {"instances": len(recs), "expected": want, "router_follows": following,
            "router_follows_all_after_banner_s": round(follow_s, 2),
            "processes": len({r["pid"] for r in recs.values()}),
            "distinct_addresses": len({r["address"] for r in recs.values()}),
            "engines_exporting_load": sum(1 for c in counters.values()
                                          if c["dynamo_worker_kv_total_blocks"] > 0),
            "first_request_status": status, "first_request_s": round(first_s, 3),
            "first_request_tokens": answer.get("usage", {}).get("completion_tokens")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    want = args.workers * args.engines
    overrides = [f"--Common.model={model_dir}",
                 f"--MockerWorker.ServiceArgs.workers={args.workers}",
                 f"--MockerWorker.engines-per-process={args.engines}"]
    with serve_graph("graphs.mocker_router:Frontend", "configs/mocker_router.yaml",
                     overrides) as g:
        log.info("ready in %.2f s (banner), %.2f s from spawn", g.ready_s, g.spawn_to_ready_s)
        probe = asyncio.run(_probe(g.url, g.etcd.url, want))
        time.sleep(args.settle)
        pids = {"graph": g.server.pid, "etcd": g.etcd.proc.pid, "nats": g.nats.proc.pid}
        before = _cpu(pids)
        time.sleep(args.idle_seconds)
        used = cpu_delta(before, _cpu(pids))
        rss = _rss_mib(pids)
        banner = [s for s in g.server.lines
                  if s.startswith("  MockerWorker") or s.startswith("    pid=")]
        output_lines = len(g.server.lines)
    per: dict[str, float] = {}
    for key, secs in used.items():
        name = key.rsplit(":", 1)[0]
        per[name] = round(per.get(name, 0.0) + secs / args.idle_seconds, 4)
    return {
        "args": vars(args), "instances_wanted": want,
        "ready_s": g.ready_s, "spawn_to_ready_s": round(g.spawn_to_ready_s, 2),
        "probe": probe, "idle_seconds": args.idle_seconds,
        "idle_cores_total": round(sum(per.values()), 4), "idle_cores": per,
        "rss_mib": rss, "banner_worker_lines": banner, "output_lines_until_stop": output_lines,
    }


def markdown(r: dict[str, Any]) -> str:
    a, p = r["args"], r["probe"]
    ok = r["ready_s"] <= TARGET_READY_S and p["instances"] == r["instances_wanted"]
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(r["idle_cores"].items()))
    mem = "\n".join(f"| {k} | {v:.0f} |" for k, v in sorted(r["rss_mib"].items()))
    return "\n".join([
        f"# {r['instances_wanted']} mocker engines behind one Router",
        "",
        f"`python benchmarks/mocker_scale.py --workers {a['workers']} --engines "
        f"{a['engines']}` (graphs.mocker_router, configs/mocker_router.yaml, cpu-tiny "
        "profile at real speed; own etcd and NATS). Shared 2-core machine, load average "
        f"{r['machine']['loadavg_1m']:.1f} at the end: provisional.",
        "",
        f"- **Ready in {r['ready_s']:.2f} s** (banner: every instance registered; "
        f"{r['spawn_to_ready_s']:.2f} s from spawning `dynamo serve`), target <= "
        f"{TARGET_READY_S:.0f} s: {'met' if ok else 'MISSED'}.",
        f"- Instances in etcd: {p['instances']} of {r['instances_wanted']}, in "
        f"{p['processes']} processes, {p['distinct_addresses']} distinct request-plane "
        f"addresses; engines exporting their load: {p['engines_exporting_load']}; the "
        f"Router followed {p['router_follows']} engines "
        f"{p['router_follows_all_after_banner_s']:.2f} s after the banner.",
        f"- First routed completion: HTTP {p['first_request_status']}, "
        f"{p['first_request_tokens']} tokens, {p['first_request_s'] * 1000:.0f} ms.",
        f"- **Idle: {r['idle_cores_total']:.3f} cores** over {r['idle_seconds']:g} s "
        "(every process, etcd and NATS included):",
        "",
        "| process | cores |",
        "| --- | --- |",
        rows,
        "",
        "Resident memory (MiB):",
        "",
        "| process | RSS MiB |",
        "| --- | --- |",
        mem,
        "",
        "The ready banner's worker lines:",
        "",
        "```",
        *r["banner_worker_lines"],
        "```",
        "",
        f"Machine: {json.dumps(r['machine'])}",
        "",
    ])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    args = _args()
    result = run(args)
    publish(args.name, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
