"""How long a graph with vLLM engines takes to come up, and where the time goes.

    python benchmarks/engine_startup.py [--runs 2] [--variants agg,agg@huge-pages=true]

A variant is a shipped graph (``agg``, ``agg_router``, ``disagg``, ``disagg_router``),
optionally followed by ``@key=value`` settings given to every engine component
(``VllmWorker`` and, where the graph has one, ``PrefillWorker``). Each run starts
``dynamo serve graphs.<graph>:Frontend -f configs/<graph>.yaml`` on the local tiny model
(it starts its own etcd and NATS), waits for the ready banner, stops it with SIGTERM and
records: seconds to the banner, and per engine worker the seconds of vLLM's start-up
phases as the progress lines tell them (importing vLLM, starting the engine core process,
the model runner and weights, ``engine initialised in`` for profiling + KV cache +
warm-up). Runs are interleaved (variant order rotates each run).
Writes benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
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
    markdown_table,
    publish,
    run_line,
    serve_command,
)

log = logging.getLogger("bench.engine_startup")

ENGINE_INIT = re.compile(r"^\[ *[\d.]+s\] (\w+\[\d+\]) +loading: engine initialised in ([0-9.]+) s")
ENGINES = {"agg": ["VllmWorker"], "agg_router": ["VllmWorker"],
           "disagg": ["VllmWorker", "PrefillWorker"],
           "disagg_router": ["VllmWorker", "PrefillWorker"]}


def variant_args(variant: str) -> tuple[str, list[str]]:
    """``graph@key=value@...`` -> (graph, ``--Component.key=value`` for its engines)."""
    graph, *settings = variant.split("@")
    if graph not in ENGINES:
        raise SystemExit(f"unknown graph {graph!r} in {variant!r}: one of {sorted(ENGINES)}")
    args = []
    for setting in settings:
        key, _, value = setting.partition("=")
        args += [f"--{c}.{key}={value}" for c in ENGINES[graph]]
    return graph, args


def one_run(variant: str, model_dir: Path, ready_timeout: float) -> dict[str, Any]:
    graph, args = variant_args(variant)
    cmd = serve_command(graph, graph, 0, model_dir, *args)
    out: dict[str, Any] = {"variant": variant, "loadavg_1m": load_average()}
    t0 = time.monotonic()
    proc = ManagedProcess(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"},
                          name=f"dynamo serve ({variant})")
    try:
        _, t_ready = proc.wait_line(lambda s: READY_BANNER.search(s) is not None, ready_timeout)
        out["ready_s"] = round(t_ready - t0, 2)
        out["engine_init_s"] = {m.group(1): float(m.group(2)) for s in proc.lines
                                if (m := ENGINE_INIT.search(s))}
    except TimeoutError as exc:
        out["error"] = str(exc).splitlines()[0]
        log.error("%s: %s", variant, out["error"])
    finally:
        proc.stop(timeout=30, sig=signal.SIGTERM, leader_only=True)
    return out


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        ok = [r for r in runs if r["variant"] == v and "ready_s" in r]
        inits = [t for r in ok for t in r["engine_init_s"].values()]
        rows.append({
            "variant": v, "runs": len(ok),
            "ready s (median)": round(statistics.median(r["ready_s"] for r in ok), 1) if ok else "",
            "ready s (each)": ", ".join(f"{r['ready_s']:.1f}" for r in ok),
            "engine initialised s (each engine)": ", ".join(f"{t:.1f}" for t in inits),
            "failed": sum(1 for r in runs if r["variant"] == v and "error" in r),
        })
    return rows


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Graph start-up with vLLM engines",
        "",
        run_line(data["command"], m) + ". Ready: spawning `dynamo serve` to reading its "
        "ready banner. `engine initialised`: vLLM's profiling, KV cache allocation and "
        "warm-up, as each engine worker's progress line reports it.",
        "",
        *markdown_table(["variant", "runs", "ready s (median)", "ready s (each)",
                         "engine initialised s (each engine)", "failed"], data["summary"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--variants", default="agg,agg@huge-pages=true")
    p.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny-llama")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--name", default="engine_startup")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        variant_args(v)  # fail on a bad variant before anything starts
    runs = []
    for i in range(args.runs):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            log.info("run %d: %s", i + 1, v)
            runs.append(one_run(v, args.model_dir, args.ready_timeout))
    command = "python benchmarks/engine_startup.py " + " ".join(argv if argv is not None
                                                                  else sys.argv[1:])
    publish(args.name, {"command": command.strip(), "runs": runs,
                        "summary": summarize(runs, variants)}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
