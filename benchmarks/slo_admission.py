"""SLO-aware admission under overload: interactive TTFT attainment with it off and on.

    python benchmarks/slo_admission.py [--duration 40] [--interactive-rate 2]
        [--batch-rate 10] [--batch-output 512] [--settings off,on] [--engine-nice 19]
        [--serve-arg=--X.key=v]
    python benchmarks/slo_admission.py --graph mocker [--workers 4] [--engines 8]
        [--speed 0.2] ...   # the same at scale, on simulated engines

Serves ``graphs.agg_router`` (``configs/agg_router.yaml``: two real vLLM workers on the
tiny model, the Router, the Processor in ``router-mode: kv``) once per setting, with a
tenants file holding an ``interactive`` tenant (TTFT target 1000 ms) and a ``batch``
tenant. vLLM's priority scheduling is on in both settings (``scheduling-policy:
priority``) and the engines run at ``--engine-nice`` (``VllmWorker.engine-nice``, 19 by
default: on a 2-core box the Frontend, Processor and Router share the engines' cores and
must run first), so what differs is only the Processor's ``slo-admission``. Do not run
it under ``nice``: engine-nice is added to the niceness the graph starts with and stops
at 19, so a niced run leaves the engines barely below the light processes.

Load: open-loop Poisson arrivals (seeded, the same schedule in both settings) over
``--duration`` s: interactive requests (a short prompt, ``--interactive-output`` tokens)
and batch requests (a longer prompt, ``--batch-output`` tokens, ignore_eos), all
streamed ``/v1/completions``. The batch rate is chosen to overload the two workers.

``--graph mocker`` serves ``graphs.mocker_router`` (``configs/mocker_router.yaml``) instead:
``--workers`` processes of ``--engines`` simulated engines (the ``cpu-tiny`` profile at
``--speed``, with the mocker's own ``priority`` scheduling policy), the same Router,
Processor, tenants and admission; scale the rates with the engines (see the README).

Reported per setting: interactive TTFT p50/p90/p99 and SLO attainment (the share of
interactive requests whose first token came within the target; an error counts as a
miss); what batch paid: its TTFT, completed and shed (HTTP 429) counts, output tokens/s.
Writes benchmarks/results/slo_admission.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    StreamResult,
    load_average,
    percentile,
    publish,
    stream_request,
)
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.slo_admission")

MODEL = "tiny-llama"
KEYS = {"interactive": "sk-bench-live-6f1e2d3c4b5a", "batch": "sk-bench-nightly-0a9b8c7d6e5f"}
TARGET_MS = 1000.0  # the interactive class's default ttft-ms


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--interactive-rate", type=float, default=2.0, help="requests/s")
    p.add_argument("--batch-rate", type=float, default=10.0, help="requests/s")
    p.add_argument("--interactive-output", type=int, default=16)
    p.add_argument("--batch-output", type=int, default=512)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--settings", default="off,on")
    p.add_argument("--admission", default="{enabled: true, delay-at-requests: 4, "
                   "shed-at-requests: 16, delay-step: 0.25, max-delay: 10, delay-at-prefills: 1}",
                   help="the Processor's slo-admission block for the 'on' setting")
    p.add_argument("--engine-nice", type=int, default=19,
                   help="VllmWorker.engine-nice in every setting (0: engines at the graph's)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="--Component.key=value",
                   help="an override for dynamo serve in every setting (repeatable), e.g. "
                        "--serve-arg=--VllmWorker.engine-nice=10")
    p.add_argument("--graph", choices=("vllm", "mocker"), default="vllm")
    p.add_argument("--workers", type=int, default=4, help="mocker processes (--graph mocker)")
    p.add_argument("--engines", type=int, default=8, help="engines per mocker process")
    p.add_argument("--speed", type=float, default=0.2, help="mocker speed factor")
    p.add_argument("--name", default="slo_admission")
    return p.parse_args()


def schedule(args: argparse.Namespace) -> list[tuple[float, str, dict[str, Any]]]:
    """(send at, class, body) for every request, in time order."""
    rng = random.Random(args.seed)
    out: list[tuple[float, str, dict[str, Any]]] = []
    for cls, rate in (("interactive", args.interactive_rate), ("batch", args.batch_rate)):
        t, n = 0.0, 0
        while True:
            t += rng.expovariate(rate)
            if t >= args.duration:
                break
            n += 1
            if cls == "interactive":
                prompt = f"Question {n}: " + " ".join(f"q{rng.randrange(10**6)}" for _ in range(12))
                body = {"max_tokens": args.interactive_output}
            else:
                prompt = f"Document {n}: " + " ".join(f"d{rng.randrange(10**6)}" for _ in range(60))
                body = {"max_tokens": args.batch_output, "ignore_eos": True}
            out.append((t, cls, {"model": MODEL, "prompt": prompt, "stream": True,
                                 "temperature": 0, **body}))
    return sorted(out, key=lambda x: x[0])


async def drive(url: str, plan: list[tuple[float, str, dict[str, Any]]]
                ) -> tuple[list[tuple[float, str, StreamResult]], float]:
    import aiohttp

    sessions = {cls: aiohttp.ClientSession(
        headers={"authorization": f"Bearer {key}"},
        connector=aiohttp.TCPConnector(limit=0)) for cls, key in KEYS.items()}
    t0 = time.perf_counter()

    async def one(at: float, cls: str, body: dict[str, Any]) -> tuple[float, str, StreamResult]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        return at, cls, await stream_request(sessions[cls], f"{url}/v1/completions", body, 300.0)

    try:
        results = await asyncio.gather(*(one(*p) for p in plan))
    finally:
        for s in sessions.values():
            await s.close()
    return list(results), time.perf_counter() - t0


def stats(results: list[tuple[float, str, StreamResult]], wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"wall_s": round(wall_s, 1)}
    for cls in KEYS:
        rs = [r for _, c, r in results if c == cls]
        ok = [r for r in rs if r.error is None and r.chunk_times]
        ttft = [r.chunk_times[0] * 1000.0 for r in ok]
        shed = [r for r in rs if r.error is not None and r.error.startswith("HTTP 429")]
        errors = [r for r in rs if r.error is not None and r not in shed]
        s: dict[str, Any] = {
            "sent": len(rs), "completed": len(ok), "shed_429": len(shed), "errors": len(errors),
            "ttft_ms": {q: round(percentile(ttft, v), 1)
                        for q, v in (("p50", 50), ("p90", 90), ("p99", 99))},
            "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall_s, 1),
        }
        if cls == "interactive":
            met = sum(1 for t in ttft if t <= TARGET_MS)
            s["ttft_target_ms"] = TARGET_MS
            s["slo_attainment"] = round(met / len(rs), 4) if rs else None
        if errors:
            s["first_error"] = errors[0].error
        if shed:
            s["first_shed"] = shed[0].error
        out[cls] = s
    # Every request as it went (sent at s, TTFT ms or None, error): shows whether
    # interactive misses come in bursts and what batch work started around them.
    for cls in KEYS:
        out[f"{cls}_samples"] = [
            [round(at, 3), round(r.chunk_times[0] * 1000.0, 1) if r.chunk_times else None,
             (r.error or "")[:120]]
            for at, c, r in results if c == cls]
    return out


def run_setting(setting: str, args: argparse.Namespace, infra: dict[str, Any], model_dir: Path,
                tenants: Path, plan: list[tuple[float, str, dict[str, Any]]]) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "ETCD_ENDPOINTS": infra["etcd"].url, "NATS_SERVER": infra["nats"].url,
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve"]
    if args.graph == "mocker":
        cmd += ["graphs.mocker_router:Frontend", "-f", "configs/mocker_router.yaml",
                "--MockerWorker.scheduling-policy=priority", f"--MockerWorker.speed={args.speed}",
                f"--MockerWorker.ServiceArgs.workers={args.workers}",
                f"--MockerWorker.engines-per-process={args.engines}"]
    else:
        cmd += ["graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml",
                "--VllmWorker.scheduling-policy=priority",
                f"--VllmWorker.engine-nice={args.engine_nice}"]
    cmd += [f"--Frontend.port={port}", f"--Common.model={model_dir}",
            "--Common.max-model-len=1024", f"--Frontend.tenants-file={tenants}",
            "--ready-timeout=420"]
    cmd += args.serve_arg
    if setting == "on":
        cmd.append(f"--Processor.slo-admission={args.admission}")
    server = ManagedProcess(cmd, env, name=f"agg_router-{setting}")
    try:
        server.wait_line(lambda s: "dynamo serve: graph " in s, 420)
        load0 = load_average()
        results, wall = asyncio.run(drive(f"http://127.0.0.1:{port}", plan))
        out = stats(results, wall)
        out["load_average_before"] = load0
        out["load_average_after"] = load_average()
        out["command"] = " ".join(cmd[1:])
        return out
    finally:
        server.stop()


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    mocker = a.get("graph") == "mocker"
    what = (f"mocker_router, {a['workers'] * a['engines']} simulated engines (cpu-tiny at "
            f"speed {a['speed']:g})" if mocker else "agg_router, two real vLLM workers, tiny model")
    lines = [
        f"# SLO-aware admission under overload ({what})",
        "",
        f"Command: `python benchmarks/slo_admission.py --duration {a['duration']:g} "
        f"--interactive-rate {a['interactive_rate']:g} --batch-rate {a['batch_rate']:g} "
        f"--batch-output {a['batch_output']} --settings {a['settings']} "
        + (f"--graph mocker --workers {a['workers']} --engines {a['engines']} "
           f"--speed {a['speed']:g}" if mocker else f"--engine-nice {a.get('engine_nice', 0)}")
        + "".join(f" --serve-arg={x}" for x in a.get("serve_arg") or [])
        + (f" --name {a['name']}" if a.get("name", "slo_admission") != "slo_admission" else "")
        + "`",
        "",
        "Machine: a 2-core CPU box (24 GiB, no GPU) shared by the graph's processes and "
        "the load generator; load averages below. Absolute latencies are noisy; compare "
        "within one run.",
        "",
        f"Load: Poisson arrivals over {a['duration']:g} s, interactive {a['interactive_rate']:g}/s "
        f"({a['interactive_output']} output tokens), batch {a['batch_rate']:g}/s "
        f"({a['batch_output']} output tokens, ignore_eos); the same schedule in every setting. "
        + ("The mocker's priority scheduling on in every setting. " if mocker else
         f"vLLM priority scheduling on and engines at engine-nice {a.get('engine_nice', 0)} in "
         "every setting. ") + f"'on' = `slo-admission: {a['admission']}`.",
        "",
        "| setting | interactive TTFT p50 / p90 / p99 ms | interactive SLO attainment "
        "(TTFT <= 1 s) | batch completed / shed (429) / errors | batch TTFT p50 / p90 ms "
        "| batch output tok/s | load avg before/after |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, r in result["runs"].items():
        i, b = r["interactive"], r["batch"]
        lines.append(
            f"| {setting} | {i['ttft_ms']['p50']} / {i['ttft_ms']['p90']} / {i['ttft_ms']['p99']} "
            f"| {i['slo_attainment']:.1%} ({i['completed']}/{i['sent']} served, "
            f"{i['errors'] + i['shed_429']} failed) "
            f"| {b['completed']} / {b['shed_429']} / {b['errors']} of {b['sent']} "
            f"| {b['ttft_ms']['p50']} / {b['ttft_ms']['p90']} | {b['output_tokens_per_s']} "
            f"| {r['load_average_before']:.1f} / {r['load_average_after']:.1f} |")
    lines += ["", "Served with: `" + next(iter(result["runs"].values()))["command"] + "`", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = _args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    plan = schedule(args)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, local_infra(etcd=True, nats=True) as infra:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(f"{KEYS['interactive']}: {{tenant: live-co, slo-class: interactive}}\n"
                           f"{KEYS['batch']}: {{tenant: nightly, slo-class: batch}}\n")
        for setting in args.settings.split(","):
            log.info("setting %s: serving and sending %d requests", setting, len(plan))
            runs[setting] = run_setting(setting, args, infra, model_dir, tenants, plan)
            log.info("setting %s: %s", setting, runs[setting])
    publish(args.name, {"args": vars(args), "runs": runs}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
