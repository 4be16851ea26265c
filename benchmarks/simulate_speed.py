"""How fast ``dynamo simulate`` replays the Mooncake conversation trace, and what it reports.

    python benchmarks/simulate_speed.py [--workers 16] [--trace FILE] [--modes kv]

Runs ``dynamo simulate graphs.mocker_router -f configs/mocker_mooncake.yaml`` in this
process once per worker count and routing mode (``--Processor.router-mode``; the
engines per process are ``--MockerWorker.engines-per-process``), on the whole trace at
its own pace, and records the CPU seconds and wall time of each run with its summary
(TTFT and ITL percentiles, cache hit rate, goodput, worker-seconds). Issue 49's target:
the whole trace at 16 workers in <= 5 minutes of one core. Writes
benchmarks/results/simulate_speed.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REPO, machine_info, publish, run_line  # noqa: E402
from dynagraph.simulate.run import SimulateOptions, simulate  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TARGET_CPU_S = 300.0


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="16", help="comma-separated simulated worker counts")
    p.add_argument("--modes", default="kv", help="comma-separated Processor router-modes")
    p.add_argument("--trace", default=str(TRACE))
    return p.parse_args()


def run_one(trace: str, workers: int, mode: str) -> dict[str, Any]:
    overrides = (f"--MockerWorker.engines-per-process={workers}",
                 f"--Processor.router-mode={mode}")
    with tempfile.TemporaryDirectory(prefix="simulate-speed-") as out:
        cpu0 = time.process_time()
        summary = simulate(SimulateOptions(
            target="graphs.mocker_router", config=str(REPO / "configs/mocker_mooncake.yaml"),
            trace=trace, out=out, overrides=overrides, plots=False))
        cpu_s = time.process_time() - cpu0
    return {"workers": workers, "mode": mode, "cpu_s": round(cpu_s, 1), "summary": summary}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# dynamo simulate: the Mooncake conversation trace",
        "",
        run_line("python benchmarks/simulate_speed.py " + result["argv"], result["machine"],
                 python=True) + ".",
        "",
        "`graphs.mocker_router`, `configs/mocker_mooncake.yaml` (h200-llama8b-bf16 profile), "
        "the whole trace (12,031 requests over one hour) at its own pace, no plots. CPU: "
        "this process's CPU seconds for the run (parse, simulate, write).",
        "",
        "| workers | mode | CPU s | wall s | completed | rejected | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p99 ms | cache hit rate | goodput req/s | worker-s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        s, t, i = r["summary"], r["summary"]["ttft_ms"], r["summary"]["itl_ms"]
        lines.append(
            f"| {r['workers']} | {r['mode']} | {r['cpu_s']:.0f} | {s['wall_s']:.0f} | "
            f"{s['completed']} | {s['rejected']} | {t['p50']:.0f} / {t['p90']:.0f} / "
            f"{t['p99']:.0f} | {i['p50']:.1f} / {i['p99']:.1f} | {s['cache_hit_rate']:.3f} | "
            f"{s['goodput_rps']:.2f} | {s['worker_seconds']:.0f} |")
    lines += ["", f"Target (issue 49): the whole trace at 16 workers in <= {TARGET_CPU_S:.0f} "
              "CPU seconds of one core.", ""]
    return "\n".join(lines)


def main() -> int:
    args = _args()
    machine = machine_info()
    runs = [run_one(args.trace, int(w), m) for w in args.workers.split(",")
            for m in args.modes.split(",")]
    argv = " ".join(sys.argv[1:])
    publish("simulate_speed", {"argv": argv, "machine": machine, "runs": runs}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
