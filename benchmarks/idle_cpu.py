"""CPU a served graph burns while idle, per component (after some traffic).

Serves ``graphs.<graph>:Frontend -f configs/<graph>.yaml`` on the tiny model (etcd and
NATS started for it), sends a few completions long enough to be prefilled remotely in
the disagg graphs (so NIXL connections exist), lets it settle, then reads the CPU time
of the whole process tree over ``--seconds``.

    python benchmarks/idle_cpu.py                                  # disagg, default NIXL mode
    python benchmarks/idle_cpu.py --nixl-progress-delay-us 0       # NIXL's busy-spin
    python benchmarks/idle_cpu.py --nixl-progress-delay-us null    # no NIXL progress thread
    python benchmarks/idle_cpu.py --graph agg_router
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    cpu_delta,
    infra_env,
    machine_info,
    process_tree_cpu,
    serve_command,
    write_results,
)
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

NIXL_COMPONENTS = ("VllmWorker", "PrefillWorker")


def _complete(url: str, prompt: str) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - loopback
        resp.read()


def measure(graph: str, seconds: float, settle: float, delay: str | None) -> dict[str, Any]:
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    port = free_port()
    with local_infra(etcd=True, nats=True) as infra:
        env = infra_env(infra)
        cmd = serve_command(graph, graph, port, model_dir, "--Common.max-model-len=2048")
        if delay is not None and graph.startswith("disagg"):
            cmd += [f"--{c}.nixl-progress-delay-us={delay}" for c in NIXL_COMPONENTS]
        server = ManagedProcess(cmd, env, name=graph)
        try:
            server.wait_line(lambda s: "dynamo serve: graph " in s, 300)
            url = f"http://127.0.0.1:{port}"
            for i in range(3):  # ~700 tokens each: over max-local-prefill-length (512)
                _complete(url, f"Idle check {i}. " + "The graph should rest when idle. " * 60)
            time.sleep(settle)
            before = process_tree_cpu(server.proc.pid)
            time.sleep(seconds)
            used = cpu_delta(before, process_tree_cpu(server.proc.pid))
        finally:
            server.stop()
    per: dict[str, float] = {}
    for key, cpu in used.items():
        name = " ".join(key.rsplit(":", 1)[0].split())[:32] or "?"  # inline scripts: 1 line
        per[name] = per.get(name, 0.0) + cpu / seconds
    return {"graph": graph, "nixl_progress_delay_us": delay, "seconds": seconds,
            "total_cores": round(sum(per.values()), 4),
            "per_process_cores": {k: round(v, 4) for k, v in sorted(per.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", default="disagg")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--nixl-progress-delay-us", default=None,
                    help="override both NIXL components' nixl-progress-delay-us (YAML value)")
    ap.add_argument("--name", default=None, help="results file name (default idle_cpu_GRAPH)")
    args = ap.parse_args()
    result = measure(args.graph, args.seconds, args.settle, args.nixl_progress_delay_us)
    result["machine"] = machine_info()
    lines = [f"{k:24} {v:7.4f}" for k, v in result["per_process_cores"].items()]
    text = (f"# Idle CPU of graphs.{args.graph}\n\n`python benchmarks/idle_cpu.py --graph "
            f"{args.graph}" + (f" --nixl-progress-delay-us {args.nixl_progress_delay_us}"
                               if args.nixl_progress_delay_us is not None else "")
            + f"`: cores used over {args.seconds:g} s after 3 long requests and "
            f"{args.settle:g} s to settle; provisional (shared 2-core VM).\n\n```\n"
            + "\n".join(lines) + f"\n{'total':24} {result['total_cores']:7.4f}\n```\n")
    write_results(args.name or f"idle_cpu_{args.graph}", result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
