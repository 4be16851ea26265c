"""Attention-FFN disaggregation: exchange latency, and served throughput/ITL vs monolithic.

    python benchmarks/afd.py                      # both parts, ~30 minutes on 2 busy cores
    python benchmarks/afd.py --part exchange      # per-layer exchange latency only
    python benchmarks/afd.py --part served        # served tokens/s and ITL only
    python benchmarks/afd.py --gpu-results FILE --cpu-results FILE
                                                  # also fold in benchmarks/afd_gpu.py's

Part ``exchange``: an FfnServer in its own process (``--serve-ffn``), one engine-side
``FfnChannel`` per transport (``shm``: Unix socket + shared memory; ``tcp``), one layer
call at a time for several row counts. With an identity "FFN" the round trip is the
transport alone; with the tiny model's real FFN (vLLM's ``LlamaMLP``) it is what one
layer costs the engine; the worker reports its compute time, so overhead = round trip -
compute. The same FFN computed in this process (no exchange) is the monolithic cost.

Part ``served``: ``dynamo serve`` of ``graphs.agg`` (monolithic, its engine on both
cores, and on core 0 only) and ``graphs.agg_afd`` (two FfnWorkers, layer split; attention on core 0, the
FfnWorkers on core 1) with shared memory and ping-pong, without ping-pong, over TCP, and
with every process on both cores; a streaming load at 1 and 8 concurrent requests;
output tokens/s, ITL and TPOT, plus the engine's exchange counters
(``dynamo_worker_afd_*``).

Results: ``benchmarks/results/afd.json`` and ``afd.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import REPO, ManagedProcess, machine_info, run_load, write_results  # noqa: E402
from dynagraph.llm.afd.channel import Endpoint, FfnChannel  # noqa: E402
from tools.entry_points import shim_path  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

ROWS = (1, 8, 64, 256)


class EchoFfn:
    """An "FFN" that returns its input: the exchange without any compute."""

    model = "echo"
    dtype = torch.bfloat16
    experts = None

    def __init__(self, hidden: int, layers: list[int]) -> None:
        self.hidden_size = hidden
        self.layers = layers

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def serve_ffn(model: str, kind: str) -> None:
    """``--serve-ffn``: an FfnServer for the benchmark, until SIGTERM."""
    from dynagraph.llm.afd.ffn import VllmFfn, read_model_info
    from dynagraph.llm.afd.server import FfnServer

    info = read_model_info(model)
    layers = list(range(info.num_layers))
    compute: Any = (EchoFfn(info.hidden_size, layers) if kind == "echo"
                    else VllmFfn(model, layers, threads=1))
    server = FfnServer(compute, instance=kind)
    server.start()
    print("PEER " + json.dumps({"tcp": server.tcp_address, "uds": server.uds_address,
                                "model": compute.model}), flush=True)
    while True:
        time.sleep(3600)


def _start_ffn(model: Path, kind: str) -> tuple[ManagedProcess, dict[str, str]]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = ManagedProcess([sys.executable, __file__, "--serve-ffn", str(model), kind], env,
                          name=f"ffn-{kind}")
    line, _ = proc.wait_line(lambda s: s.startswith("PEER "), 300)
    return proc, json.loads(line[5:])


def _round_trips(channels: dict[str, FfnChannel], rows: int, n: int, hidden: int
                 ) -> dict[str, dict[str, float]]:
    """Calls alternate between the transports, so a busy moment hits them alike."""
    x = torch.randn(rows, hidden).to(torch.bfloat16)
    for ch in channels.values():
        for _ in range(20):
            ch.collect(ch.submit(0, x))
    rts: dict[str, list[float]] = {t: [] for t in channels}
    comp: dict[str, list[float]] = {t: [] for t in channels}
    for i in range(n):
        for t, ch in channels.items():
            t0 = time.perf_counter()
            _, us = ch.collect(ch.submit(i % 2, x))
            rts[t].append((time.perf_counter() - t0) * 1e6)
            comp[t].append(us)
    out = {}
    for t in channels:
        rt, c = statistics.median(rts[t]), statistics.median(comp[t])
        out[t] = {"rt_us_p50": rt, "rt_us_p90": statistics.quantiles(rts[t], n=10)[-1],
                  "compute_us_p50": c, "overhead_us_p50": rt - c}
    return out


def exchange(model: Path, n: int) -> dict[str, Any]:
    from dynagraph.llm.afd.ffn import VllmFfn, read_model_info

    info = read_model_info(model)
    out: dict[str, Any] = {}
    for kind in ("echo", "ffn"):
        proc, peer = _start_ffn(model, kind)
        try:
            channels = {t: FfnChannel(Endpoint(kind, peer["tcp"], peer["uds"]), t,
                                      model=peer["model"], hidden_size=info.hidden_size,
                                      dtype=torch.bfloat16, client="bench", max_rows=max(ROWS))
                        for t in ("shm", "tcp")}
            for ch in channels.values():
                ch.connect()
            for rows in ROWS:
                for t, r in _round_trips(channels, rows, n, info.hidden_size).items():
                    out[f"{kind}/{t}/{rows}"] = r
                    print(kind, t, rows, {k: round(v) for k, v in r.items()}, flush=True)
            for ch in channels.values():
                ch.close()
        finally:
            proc.stop()
    local = VllmFfn(model, [0], threads=1)
    for rows in ROWS:
        x = torch.randn(rows, info.hidden_size).to(local.dtype)
        for _ in range(20):
            local.forward(0, x)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            local.forward(0, x)
            ts.append((time.perf_counter() - t0) * 1e6)
        out[f"in-process/{rows}"] = {"compute_us_p50": statistics.median(ts)}
    return out


# -- served --------------------------------------------------------------------------------

AFD = ("graphs.agg_afd:Frontend", "configs/agg_afd.yaml")
SPLIT_CORES = ['--VllmWorker.cpu-threads-bind="0"', '--FfnWorker.cpus="1"']
"""Attention on core 0, both FfnWorkers on core 1: the two cores the monolithic engine
uses, with room for attention and FFN to overlap."""
SERVED = {
    "monolithic": ("graphs.agg:Frontend", "configs/agg.yaml", []),
    "monolithic-core0": ("graphs.agg:Frontend", "configs/agg.yaml",
                         ['--VllmWorker.cpu-threads-bind="0"']),
    "afd-shm-pingpong": (*AFD, SPLIT_CORES),
    "afd-shm-no-pingpong": (*AFD, [*SPLIT_CORES, "--VllmWorker.afd={ping-pong: false}"]),
    "afd-tcp-pingpong": (*AFD, [*SPLIT_CORES, "--VllmWorker.afd={transport: tcp}"]),
    "afd-shm-pingpong-shared-cores": (*AFD, []),
}


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:  # noqa: S310
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(dynamo_worker_afd_\w+)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def served(model: Path, name: str, requests: int, tokens: int, env: dict[str, str]
           ) -> dict[str, Any]:
    target, config, extra = SERVED[name]
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", target, "-f", config,
           "--Frontend.port=0", f"--Common.model={model}", *extra]
    proc = ManagedProcess(cmd, env, name=name)
    try:
        proc.wait_line(lambda s: "dynamo serve: graph " in s and " ready in " in s, 400)
        line, _ = proc.wait_line(lambda s: "url=http://" in s, 5)
        url = re.search(r"url=(http://\S+)", line).group(1)  # type: ignore[union-attr]
        worker = next(m.group(1) for s in proc.lines
                      if (m := re.search(r"VllmWorker\[0\] pid=\d+ .*metrics=(\S+)", s)))
        result: dict[str, Any] = {}
        for conc in (1, 8):
            bodies = [{"model": "tiny-llama", "prompt": f"Request {i}: the Python language",
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True} for i in range(requests if conc > 1 else requests // 2)]
            asyncio.run(run_load(f"{url}/v1/completions", bodies[:2], conc))  # warm-up
            before = _scrape(worker)
            stats = asyncio.run(run_load(f"{url}/v1/completions", bodies, conc))
            time.sleep(0.6)  # the engine publishes its exchange counters twice a second
            after = _scrape(worker)
            stats["afd"] = {k: after[k] - before.get(k, 0.0) for k in after}
            result[f"c{conc}"] = stats
            print(name, conc, round(stats["output_tokens_per_s"], 1),
                  round(stats["itl_ms"]["p50"], 2), stats["afd"], flush=True)
        return result
    finally:
        proc.stop()


def markdown(res: dict[str, Any], cmd: str) -> str:
    lines = ["# Attention-FFN disaggregation", "", f"`{cmd}`", "",
             f"Machine: {res['machine']}", ""]
    ex = res.get("exchange")
    if ex:
        lines += ["## Per-layer exchange (tiny-llama, hidden 256, bf16), one call at a time",
                  "", "| rows | transport | echo round trip p50 (us) | FFN round trip p50 (us) "
                  "| worker FFN compute (us) | exchange overhead (us) | same FFN in-process (us) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for rows in ROWS:
            for t in ("shm", "tcp"):
                e, f = ex[f"echo/{t}/{rows}"], ex[f"ffn/{t}/{rows}"]
                lines.append(f"| {rows} | {t} | {e['rt_us_p50']:.0f} | {f['rt_us_p50']:.0f} | "
                             f"{f['compute_us_p50']:.0f} | {f['overhead_us_p50']:.0f} | "
                             f"{ex[f'in-process/{rows}']['compute_us_p50']:.0f} |")
        lines.append("")
    sv = res.get("served")
    if sv:
        lines += [f"## Served (`dynamo serve`), {res.get('tokens', 64)} output tokens per "
                  "request, best of "
                  f"{len(res.get('served_rounds', [0]))} rounds", "",
                  "| graph | concurrency | output tok/s | ITL p50 (ms) | TPOT p50 (ms) "
                  "| micro-batched forwards | engine wait on FFN (s) | failovers |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, by_conc in sv.items():
            for conc, s in by_conc.items():
                a = s.get("afd", {})
                lines.append(
                    f"| {name} | {conc[1:]} | {s['output_tokens_per_s']:.0f} | "
                    f"{s['itl_ms']['p50']:.2f} | {s['tpot_ms']['p50']:.2f} | "
                    f"{a.get('dynamo_worker_afd_microbatched_forwards_total', 0):.0f} | "
                    f"{a.get('dynamo_worker_afd_exchange_wait_seconds_total', 0):.2f} | "
                    f"{a.get('dynamo_worker_afd_failovers_total', 0):.0f} |")
        lines.append("")
    gpu = res.get("gpu")
    if gpu:
        cpu = res.get("cpu", {})
        lines += [f"## One layer's FFN on a GPU ({gpu.get('device')}, bf16, eager torch; "
                  "`benchmarks/afd_gpu.py`)", "",
                  "| layer | rows | GPU compute (us) | host<->GPU copy of the rows (us) "
                  "| same on this CPU, 1 thread (us) |",
                  "| --- | --- | --- | --- | --- |"]
        for key, value in gpu.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[1] == "h2d+d2h":
                continue
            copy = gpu.get(f"{parts[0]}/h2d+d2h/{parts[2]}")
            here = cpu.get(key)
            lines.append(f"| {parts[0]} {parts[1]} | {parts[2]} | {value:.0f} | "
                         f"{'' if copy is None else f'{copy:.0f}'} | "
                         f"{'' if here is None else f'{here:.0f}'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "exchange", "served"], default="all")
    p.add_argument("--calls", type=int, default=300, help="layer calls per exchange point")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2,
                   help="served rounds; the table shows each point's best round (other "
                        "jobs share the cores)")
    p.add_argument("--gpu-results", type=Path, default=None,
                   help="benchmarks/afd_gpu.py's output on the GPU machine")
    p.add_argument("--cpu-results", type=Path, default=None,
                   help="benchmarks/afd_gpu.py's output here (cpu), shown next to the GPU's")
    p.add_argument("--combine", nargs="+", type=Path, default=None,
                   help="merge earlier result files (later ones win) into afd.json/.md")
    p.add_argument("--serve-ffn", nargs=2, metavar=("MODEL", "KIND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_ffn:
        serve_ffn(*args.serve_ffn)
        return 0
    if args.combine:
        merged: dict[str, Any] = {}
        commands = []
        for path in args.combine:
            part = json.loads(path.read_text())
            commands.append(str(part.pop("command", path.name)))
            merged.update(part)
        if args.gpu_results:
            merged["gpu"] = json.loads(args.gpu_results.read_text())
            commands.append(f"python benchmarks/afd_gpu.py cuda {args.gpu_results.name} (H200)")
        if args.cpu_results:
            merged["cpu"] = json.loads(args.cpu_results.read_text())
            commands.append(f"python benchmarks/afd_gpu.py cpu {args.cpu_results.name}")
        merged["command"] = "; ".join(commands)
        j, m = write_results("afd", merged, markdown(merged, merged["command"]))
        print(f"wrote {j} and {m}")
        return 0
    model = ensure_model(REPO / "models" / "tiny-llama")
    res: dict[str, Any] = {"machine": machine_info()}
    if args.part in ("all", "exchange"):
        res["exchange"] = exchange(model, args.calls)
    if args.part in ("all", "served"):
        env = {k: v for k, v in os.environ.items()
               if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the same engine layout for all four
        with tempfile.TemporaryDirectory() as tmp:
            shim = shim_path(Path(tmp))
            if shim is not None:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim),
                                                                  env.get("PYTHONPATH")]))
            rounds = [{name: served(model, name, args.requests, args.tokens, env)
                       for name in SERVED} for _ in range(args.rounds)]
            res["served_rounds"] = rounds
            res["tokens"] = args.tokens
            res["served"] = {name: {c: max((r[name][c] for r in rounds),
                                           key=lambda s: s["output_tokens_per_s"])
                                    for c in rounds[0][name]} for name in SERVED}
    if args.gpu_results:
        res["gpu"] = json.loads(args.gpu_results.read_text())
    if args.cpu_results:
        res["cpu"] = json.loads(args.cpu_results.read_text())
    res["machine_after"] = machine_info()
    cmd = "python benchmarks/afd.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res["command"] = cmd.strip()
    name = "afd" if args.part == "all" else f"afd_{args.part}"
    j, m = write_results(name, res, markdown(res, cmd.strip()))
    print(f"wrote {j} and {m}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
