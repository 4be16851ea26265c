"""How fast ``dynamo serve`` brings a five-component graph up and down.

    python benchmarks/serve_lifecycle.py [--runs 5] [--modes external,embedded]

Runs ``dynamo serve benchmarks._lifecycle_graph:First`` (five light components, no
engine) ``--runs`` times in each mode:

- ``external``: etcd and NATS started once by this script (``ETCD_ENDPOINTS`` /
  ``NATS_SERVER`` set), as in production;
- ``embedded``: nothing set, so ``dynamo serve`` starts its own etcd and NATS.

Per run: seconds from spawning ``dynamo serve`` to reading its ready banner
(``dynamo serve: graph ... ready in``), one request through all five hops, then seconds
from SIGTERM (to the supervisor only, as a service manager sends it) to its exit, and
whether any process of its group survived. Milestones in the output (etcd/NATS up,
children spawned, each child's discovery connected and registered) are timed by when
their lines were read. Also measures the import time of the supervisor and of one
component process (``python -X importtime``). Targets (issue 2): ready <= 3 s,
stopped <= 2 s. Writes benchmarks/results/serve_lifecycle.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    READY_BANNER,
    REPO,
    ManagedProcess,
    load_average,
    machine_info,
    run_line,
    write_results,
)

log = logging.getLogger("bench.serve_lifecycle")

TARGET = "benchmarks._lifecycle_graph:First"
COMPONENTS = ["First", "Second", "Third", "Fourth", "Fifth"]
TARGET_READY_S = 3.0
TARGET_STOP_S = 2.0
MILESTONES: dict[str, re.Pattern[str]] = {
    "etcd_up": re.compile(r"started a local etcd"),
    "nats_up": re.compile(r"started a local nats-server"),
    "first_spawned": re.compile(r"^\[ *[\d.]+s\] \w+\[0\] +started, pid "),
    **{f"{c}_discovery": re.compile(rf"^\[{c}:0\] .*etcd discovery started") for c in COMPONENTS},
    **{f"{c}_ready": re.compile(rf"^\[ *[\d.]+s\] {c}\[0\] +ready in ") for c in COMPONENTS},
}


def parse_importtime(stderr: str, top: int = 12) -> list[tuple[str, float]]:
    """Top-level packages by cumulative import time (ms) from ``-X importtime`` output."""
    per_pkg: dict[str, float] = {}
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m is None or len(m.group(2)) != 1:  # only the outermost imports
            continue
        pkg = m.group(3).split(".")[0]
        per_pkg[pkg] = per_pkg.get(pkg, 0.0) + int(m.group(1)) / 1000.0
    return sorted(per_pkg.items(), key=lambda kv: -kv[1])[:top]


def import_profile(code: str, env: dict[str, str]) -> dict[str, Any]:
    """Wall time of ``python -c code`` and its slowest top-level imports."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    wall = time.monotonic() - t0
    bare_t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], cwd=REPO, env=env, timeout=30, check=True)
    bare = time.monotonic() - bare_t0
    return {"code": code, "wall_s": wall, "bare_python_s": bare,
            "top_imports_ms": parse_importtime(done.stderr)}


async def _ping(address: str) -> list[Any]:
    from dynagraph.runtime.rpc import RpcClient

    client = RpcClient()
    try:
        async with asyncio.timeout(10):
            return [item async for item in client.call(address, "generate", {"count": 2})]
    finally:
        await client.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def one_run(env: dict[str, str], ready_timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", TARGET, "--stop-timeout", "8"]
    t0 = time.monotonic()
    proc = ManagedProcess(cmd, env, name="dynamo serve")
    out: dict[str, Any] = {"loadavg_1m": load_average()}
    try:
        try:
            line, t_ready = proc.wait_line(lambda s: READY_BANNER.search(s) is not None, ready_timeout)
        except TimeoutError as exc:
            log.error("run failed: %s", str(exc).splitlines()[0])
            out["error"] = str(exc).splitlines()[0]
            out["log"] = [s for s in proc.lines if "ERROR" in s or "Error" in s or "Trace" in s
                          or s.startswith("[") and "INFO" not in s][-60:]
            return out
        out["ready_s"] = t_ready - t0
        out["supervisor_ready_s"] = float(READY_BANNER.search(line).group(1))  # type: ignore[union-attr]
        first, _ = proc.wait_line(lambda s: s.lstrip().startswith("First[0]"), 5)
        m = re.search(r"rpc=(\S+)", first)
        assert m is not None, first
        items = asyncio.run(_ping(m.group(1)))
        out["ping_ok"] = len(items) == 2 and items[0]["path"] == COMPONENTS
        milestones: dict[str, float] = {}
        for i, text in enumerate(list(proc.lines)):
            for name, pat in MILESTONES.items():
                if name not in milestones and pat.search(text):
                    milestones[name] = round(proc.line_times[i] - t0, 3)
        out["milestones_s"] = milestones
        t_stop = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            log.error("dynamo serve did not exit 20 s after SIGTERM")
        out["stop_s"] = time.monotonic() - t_stop
        out["exit_code"] = proc.proc.returncode
        out["orphans"] = group_alive(proc.pid)
        stopped = [s for s in proc.lines if "stopped in" in s and "dynagraph.serve" in s]
        if stopped:
            sm = re.search(r"stopped in ([0-9.]+)s", stopped[-1])
            out["supervisor_stop_s"] = float(sm.group(1)) if sm else None
    finally:
        proc.stop(timeout=5)  # SIGKILLs whatever of the group is left
    out["tail"] = proc.lines[-3:] if out.get("exit_code") not in (0, None) else []
    return out


def summarize_runs(all_runs: list[dict[str, Any]]) -> dict[str, Any]:
    runs = [r for r in all_runs if "error" not in r]

    def stat(key: str) -> dict[str, float]:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return {"p50": statistics.median(vals), "max": max(vals)} if vals else {}

    names = sorted({k for r in runs for k in r.get("milestones_s", {})},
                   key=lambda k: statistics.median(r["milestones_s"].get(k, 0) for r in runs))
    return {
        "ready_s": stat("ready_s"),
        "supervisor_ready_s": stat("supervisor_ready_s"),
        "stop_s": stat("stop_s"),
        "loadavg_1m": stat("loadavg_1m"),
        "milestones_p50_s": {n: statistics.median(r["milestones_s"][n] for r in runs
                                                  if n in r["milestones_s"]) for n in names},
        "all_pings_ok": all(r.get("ping_ok") for r in runs),
        "all_exit_0": all(r.get("exit_code") == 0 for r in runs),
        "any_orphans": any(r.get("orphans") for r in runs),
        "failed_runs": len(all_runs) - len(runs),
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# `dynamo serve` lifecycle: a five-component graph",
        "",
        run_line(result["command"], m, python=True)
        + " (provisional: 2-core machine shared with other jobs).",
        f"Graph `{TARGET}` (five light components, no engine), {result['runs']} runs per "
        "mode. Ready = spawn to ready banner read; stop = SIGTERM to the supervisor until it "
        "exited.",
        "",
        "| mode | ready p50 | ready max | stop p50 | stop max | load avg | all ok | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, s in result["summary"].items():
        ok = (s["all_pings_ok"] and s["all_exit_0"] and not s["any_orphans"]
              and not s["failed_runs"])
        verdict = "yes" if ok else "NO"
        if s["failed_runs"]:
            verdict += f" ({s['failed_runs']} of {result['runs']} runs failed)"
        if not s["ready_s"]:
            lines.append(f"| {mode} | all {s['failed_runs']} runs failed | | | | | NO | |")
            continue
        lines.append(
            f"| {mode} | {s['ready_s']['p50']:.2f} s | {s['ready_s']['max']:.2f} s | "
            f"{s['stop_s']['p50']:.2f} s | {s['stop_s']['max']:.2f} s | "
            f"{s['loadavg_1m']['p50']:.2f} | {verdict} | "
            f"ready <= {TARGET_READY_S:.0f} s, stop <= {TARGET_STOP_S:.0f} s |")
    lines += ["", "Where start-up time goes (p50 seconds after spawn, by output line):", ""]
    for mode, s in result["summary"].items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in s["milestones_p50_s"].items())
        lines.append(f"- {mode}: {parts}")
    lines += ["", "Import time (one run each, `python -X importtime`):", ""]
    for what, prof in result["imports"].items():
        top = ", ".join(f"{k} {v:.0f} ms" for k, v in prof["top_imports_ms"][:8])
        lines.append(f"- {what}: wall {prof['wall_s']:.2f} s (bare interpreter "
                     f"{prof['bare_python_s']:.2f} s); {top}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--modes", default="external,embedded")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    base_env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    base_env["PYTHONUNBUFFERED"] = "1"
    info = machine_info()
    result: dict[str, Any] = {
        "command": "python benchmarks/serve_lifecycle.py " + " ".join(argv or sys.argv[1:]),
        "machine": info, "runs": args.runs, "summary": {}, "details": {},
        "targets": {"ready_s": TARGET_READY_S, "stop_s": TARGET_STOP_S},
    }
    result["imports"] = {
        "supervisor (dynagraph.cli.main + serve)": import_profile(
            "import dynagraph.cli.main, dynagraph.cli.serve, dynagraph.runtime.discovery._etcd",
            base_env),
        "component process (child + graph module)": import_profile(
            "import dynagraph.cli.child, dynagraph.runtime.discovery._etcd, "
            "benchmarks._lifecycle_graph, prometheus_client", base_env),
    }
    from dynagraph.runtime.infra import start_etcd, start_nats

    for mode in args.modes.split(","):
        services = []
        env = dict(base_env)
        try:
            if mode == "external":
                services = [start_etcd(), start_nats()]
                env["ETCD_ENDPOINTS"], env["NATS_SERVER"] = services[0].url, services[1].url
            elif mode != "embedded":
                raise SystemExit(f"unknown mode {mode!r} (external, embedded)")
            runs = []
            for i in range(args.runs):
                r = one_run(env, args.ready_timeout)
                runs.append(r)
                if "error" in r:
                    continue
                log.info("%s run %d: ready %.2f s, stop %.2f s, ping %s, exit %s, orphans %s "
                         "(load %.2f)", mode, i + 1, r["ready_s"], r["stop_s"], r["ping_ok"],
                         r["exit_code"], r["orphans"], r["loadavg_1m"])
        finally:
            for svc in reversed(services):
                svc.stop()
        result["details"][mode] = runs
        result["summary"][mode] = summarize_runs(runs)
    md = markdown(result)
    print(md)
    if not args.no_write:
        for path in write_results("serve_lifecycle", result, md):
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
