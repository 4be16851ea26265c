"""Does a loaded engine starve the graph's control plane? Lost etcd leases and broken
streams per ``VllmWorker.engine-nice`` setting.

For each setting, serves ``graphs.agg:Frontend -f configs/agg.yaml`` on the tiny model as
``tests/multihost`` records its reference (engine threads bound to core 0, no reserved
core; etcd and NATS started for it), sends ``--requests`` completions one after another
(``--tokens`` tokens each, ``logprobs: 5``, ``ignore_eos``), and counts what went wrong:
requests that failed (a ``StreamBroken`` idle timeout, say) and etcd leases the graph's
processes found expired ("lease ... no longer exists"; each is a moment when that
component was missing from discovery). ``--runs`` graphs per setting.

    python benchmarks/engine_nice_probe.py                      # settings 0,10,19
    python benchmarks/engine_nice_probe.py --settings 0,19 --runs 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    infra_env,
    machine_info,
    serve_command,
    write_results,
)
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "su", "te", "ra") for b in ("n", "sh", "p", "t", "x")]
LEASE_LOST = "no longer exists in etcd"


def lost_leases(lines: list[str]) -> list[str]:
    """The log lines of a graph's processes that found their etcd lease expired."""
    return [line for line in lines if LEASE_LOST in line]


def prompt(i: int) -> str:
    return f"Stream {i}: " + " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(120))


def one_graph(nice: int, requests: int, tokens: int, engine_cores: str = "keep-off"
              ) -> dict[str, Any]:
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    port = free_port()
    with local_infra(etcd=True, nats=True) as infra:
        cmd = serve_command("agg", "agg", port, model_dir, '--VllmWorker.cpu-threads-bind="0"',
                            "--VllmWorker.cpu-reserved-cores=0",
                            f"--VllmWorker.engine-nice={nice}", f"--engine-cores={engine_cores}")
        server = ManagedProcess(cmd, infra_env(infra), name=f"agg engine-nice {nice}")
        seconds: list[float] = []
        errors: list[str] = []
        try:
            server.wait_line(lambda s: "dynamo serve: graph " in s, 300)
            ready_at = len(server.lines)
            for i in range(requests):
                began = time.monotonic()
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
                    "model": "tiny-llama", "prompt": prompt(i), "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": 5})
                seconds.append(round(time.monotonic() - began, 2))
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
            served = server.lines[ready_at:]
            lost_lines = lost_leases(served)
            lost = len(lost_lines)
            lost_by = sorted({line.split("]")[0].lstrip("[") if line.startswith("[")
                              else "dynamo serve" for line in lost_lines})
            keepalive = [line for line in served if "lease keepalive" in line][:10]
        finally:
            server.stop()
    return {"engine_nice": nice, "request_seconds": seconds, "errors": errors,
            "leases_lost": lost, "lost_by": lost_by, "keepalive_log": keepalive}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="0,10,19", help="engine-nice values, comma-separated")
    ap.add_argument("--runs", type=int, default=2, help="graphs per setting")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--engine-cores", choices=["keep-off", "share"], default="keep-off",
                    help="dynamo serve's: keep-off (the default) keeps the graph off the "
                    "engine's core and leaves the engine at niceness 0 there")
    ap.add_argument("--name", default="engine_nice_probe")
    args = ap.parse_args()
    runs = [one_graph(int(n), args.requests, args.tokens, args.engine_cores)
            for n in args.settings.split(",") for _ in range(args.runs)]
    rows = [f"| {r['engine_nice']} | {r['leases_lost']} ({', '.join(r['lost_by']) or '-'}) | "
            f"{len(r['errors'])} | {' / '.join(f'{s:.1f}' for s in r['request_seconds'])} |"
            for r in runs]
    text = (f"# Engine niceness vs the control plane\n\n`python benchmarks/engine_nice_probe.py "
            f"--settings {args.settings} --runs {args.runs} --engine-cores {args.engine_cores}`: "
            "agg graph, engine on core 0 ("
            + ("the graph's processes kept off it, the engine at niceness 0 while they are"
               if args.engine_cores == "keep-off" else "shared with the graph's processes")
            + "), "
            f"{args.requests} x {args.tokens}-token completions with logprobs 5, one at a "
            "time; leases the graph's processes found expired, failed requests, seconds per "
            "request. Provisional (shared 2-core VM).\n\n"
            "| engine-nice | etcd leases lost (by) | failed requests | seconds per request |\n"
            "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    errors = [e for r in runs for e in r["errors"]]
    if errors:
        text += "\nFailures:\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    write_results(args.name, {**vars(args), "runs": runs, "machine": machine_info()}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
