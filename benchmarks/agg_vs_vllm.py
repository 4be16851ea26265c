"""The agg graph against vLLM's own OpenAI server: same model, same engine settings.

    python benchmarks/agg_vs_vllm.py [--rounds 3] [--only ours|vllm]

Both servers are started (one after the other) and stay up for the whole run; only
one is driven at a time, so a shared machine's background load hits both alike. After
a warm-up of each, a bounded streaming load over ``/v1/completions`` on 127.0.0.1:

  (a) latency: ``--ttft-requests`` sequential requests (concurrency 1) in blocks of
      ``--ttft-block``, each block sent to one server then to the other (the order
      alternates), a ``--prompt-tokens`` token prompt, ``--ttft-output`` tokens
      (ignore_eos): TTFT p50/p99 and the paired per-request TTFT difference;
  (b) throughput, ``--rounds`` times per server (the order alternates):
      ``--tput-requests`` requests with ``--concurrency`` in flight, ``--tput-output``
      tokens each (ignore_eos): output tokens/s (median over rounds), TPOT, ITL, TTFT.

Prompts are random token ids (seeded, one per request, the same for both servers), so
a server's prefix cache never hits. Before each block and round the script waits until
both servers are quiet: vLLM's CPU worker keeps spinning up to ~1 s after its last
step, which would otherwise steal CPU from the server driven next. Both servers run vLLM v1 with its engine core
in a child process, ``--block-size 32``, ``--max-model-len``, ``--max-num-seqs``, a
1 GiB KV cache, eager mode, prefix caching on, stat logging off, no access log. The
CPU seconds each process used during (b) are recorded (``cpu_s``), and so is what the
idle server used meanwhile. Every process
started is stopped through its process group, also on failure.

Targets (issue 3): output tokens/s at 16 streams >= 0.9x vLLM's; TTFT p50 overhead
<= 5 ms. Writes benchmarks/results/agg_vs_vllm.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    StreamResult,
    cpu_delta,
    load_average,
    machine_info,
    percentile,
    process_tree_cpu,
    run_line,
    run_load,
    stream_request,
    stream_stats,
    summarize,
    wait_quiet,
    write_results,
)
from dynagraph.runtime.infra import free_port  # noqa: E402

log = logging.getLogger("bench.agg_vs_vllm")

MODEL_NAME = "tiny-llama"
TARGET_TPUT_RATIO = 0.9
TARGET_TTFT_OVERHEAD_MS = 5.0
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ETCD_ENDPOINTS", "NATS_SERVER", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    return {**env, **ENGINE_ENV}


def start_ours(model: Path, args: argparse.Namespace, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> tuple[ManagedProcess, str]:
    """``dynamo serve graphs.agg:Frontend`` (embedded etcd/NATS) on a free port; ``extra``:
    more overrides; ``env``: more environment variables."""
    mml = str(args.max_model_len)
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", "graphs.agg:Frontend",
           "-f", "configs/agg.yaml", "--Frontend.port=0", f"--Common.model={model}",
           f"--Processor.model={model}", f"--VllmWorker.model={model}",
           f"--Frontend.max-model-len={mml}", f"--Processor.max-model-len={mml}",
           f"--VllmWorker.max-model-len={mml}", f"--VllmWorker.max-num-seqs={args.max_num_seqs}",
           "--VllmWorker.block-size=32", "--VllmWorker.kv-cache-space-gib=1",
           "--VllmWorker.enforce-eager=true", *extra]
    proc = ManagedProcess(cmd, {**_env(), **(env or {})}, name="dynamo serve")
    try:
        proc.wait_line(lambda s: "dynamo serve: graph " in s and " ready in " in s,
                       args.start_timeout)
        line, _ = proc.wait_line(lambda s: "url=http://" in s, 5)
    except BaseException:
        proc.stop()
        raise
    m = re.search(r"url=(http://\S+)", line)
    assert m is not None
    return proc, m.group(1)


def rpc_addresses(proc: ManagedProcess) -> dict[str, str]:
    """Component name -> request-plane address, from the ready banner."""
    out: dict[str, str] = {}
    for line in proc.lines:
        m = re.match(r"\s+(\w+)\[0\] pid=\d+ rpc=(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def start_vllm(model: Path, args: argparse.Namespace) -> tuple[ManagedProcess, str]:
    """vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "32", "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager", "--seed", "0",
           "--disable-log-stats", "--disable-uvicorn-access-log"]
    proc = ManagedProcess(cmd, _env(), name="vllm api_server", own_tmpdir=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    try:
        while True:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.proc.returncode}:\n"
                                   f"{proc.output()}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=1.0) as r:  # noqa: S310
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server not ready after {args.start_timeout:.0f}s:\n"
                                   f"{proc.output()}")
            time.sleep(0.25)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def bodies(n: int, prompt_tokens: int, output_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{
        "model": MODEL_NAME,
        "prompt": [rng.randrange(100, 2000) for _ in range(prompt_tokens)],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } for _ in range(n)]


def _check(system: str, phase: str, stats: dict[str, Any]) -> None:
    if stats["errors"]:
        raise RuntimeError(f"{system} {phase}: {stats['errors']} failed requests, "
                           f"first: {stats['first_error']}")


Caller = Callable[[dict[str, Any]], Awaitable[StreamResult]]


def http_caller(session: Any, url: str) -> Caller:
    async def call(body: dict[str, Any]) -> StreamResult:
        return await stream_request(session, f"{url}/v1/completions", body, 120.0)
    return call


def rpc_caller(client: Any, address: str, component: str) -> Caller:
    """Calls our Processor or VllmWorker directly over the request plane (no HTTP)."""
    from dynagraph.llm.protocol import (
        CompletionRequest,
        OpenAIRequestEnvelope,
        PreprocessedRequest,
        SamplingParams,
    )

    counter = [0]

    async def call(body: dict[str, Any]) -> StreamResult:
        counter[0] += 1
        rid = f"bench-{component}-{counter[0]}"
        if component == "VllmWorker":
            payload = PreprocessedRequest(
                request_id=rid, token_ids=list(body["prompt"]),
                sampling=SamplingParams(max_tokens=body["max_tokens"], temperature=0.0,
                                        ignore_eos=True)).to_wire()
        else:
            req = CompletionRequest.model_validate(
                {k: v for k, v in body.items() if k != "stream_options"})
            payload = OpenAIRequestEnvelope.wrap(req, rid).to_wire()
        res = StreamResult(start=time.perf_counter())
        n = 0
        async for item in client.call(address, "generate", payload,
                                      headers={"x-request-id": rid}):
            k = len(item.get("token_ids") or []) if component == "VllmWorker" else (
                1 if item.get("text") else 0)
            if k:
                res.chunk_times.append(time.perf_counter() - res.start)
                n += k
        res.end = time.perf_counter() - res.start
        res.completion_tokens = n
        return res
    return call


async def latency_interleaved(targets: dict[str, str], rpc: dict[str, tuple[str, str]],
                              pids: list[int], requests: list[dict[str, Any]], block: int
                              ) -> dict[str, list[StreamResult]]:
    """Blocks of ``block`` sequential requests, sent to each target in turn (the order
    alternates), waiting for the servers to be quiet between blocks.

    ``targets``: name -> HTTP base URL; ``rpc``: name -> (address, component) of our
    components called directly over the request plane.
    """
    import aiohttp

    from dynagraph.runtime.rpc import RpcClient

    sessions = [aiohttp.ClientSession() for _ in targets]
    client = RpcClient()
    callers: dict[str, Caller] = {n: http_caller(sess, url)
                                  for (n, url), sess in zip(targets.items(), sessions, strict=True)}
    callers.update({n: rpc_caller(client, addr, comp) for n, (addr, comp) in rpc.items()})
    names = list(callers)
    out: dict[str, list[StreamResult]] = {n: [] for n in names}
    try:
        for k, start in enumerate(range(0, len(requests), block)):
            for n in names if k % 2 == 0 else list(reversed(names)):
                await asyncio.to_thread(wait_quiet, pids)
                for body in requests[start:start + block]:
                    try:
                        out[n].append(await callers[n](body))
                    except Exception as exc:  # noqa: BLE001 - recorded and reported
                        out[n].append(StreamResult(start=0.0, error=repr(exc)))
    finally:
        for sess in sessions:
            await sess.close()
        await client.close()
    return out


def measure(servers: dict[str, tuple[ManagedProcess, str]], args: argparse.Namespace
            ) -> dict[str, Any]:
    """Warm up, then latency (interleaved blocks), then throughput rounds."""
    urls = {n: url for n, (_, url) in servers.items()}
    rpc: dict[str, tuple[str, str]] = {}
    if "ours" in servers and not args.no_hops:
        addrs = rpc_addresses(servers["ours"][0])
        rpc = {f"ours@{c}": (addrs[c], c) for c in ("Processor", "VllmWorker") if c in addrs}
    pids = {n: proc.pid for n, (proc, _) in servers.items()}
    names = list(servers)
    for n in names:
        warm = bodies(args.concurrency, args.prompt_tokens, 16, 1000)
        _check(n, "warm-up", asyncio.run(run_load(f"{urls[n]}/v1/completions", warm,
                                                   args.concurrency)))
        _check(n, "warm-up", asyncio.run(run_load(f"{urls[n]}/v1/completions", warm[:4], 1)))

    load_lat = load_average()
    t0 = time.perf_counter()
    lat_raw = asyncio.run(latency_interleaved(
        urls, rpc, list(pids.values()),
        bodies(args.ttft_requests, args.prompt_tokens, args.ttft_output, 1), args.ttft_block))
    lat_wall = time.perf_counter() - t0
    latency = {n: stream_stats(r, lat_wall) for n, r in lat_raw.items()}
    for n in latency:
        _check(n, "latency", latency[n])
    paired = [(a.chunk_times[0] - b.chunk_times[0]) * 1000.0
              for a, b in zip(lat_raw["ours"], lat_raw["vllm"], strict=True)
              if a.chunk_times and b.chunk_times] if set(names) == {"ours", "vllm"} else []
    log.info("latency (load %.2f): %s; paired TTFT difference p50 %.2f ms", load_lat,
             ", ".join(f"{n} TTFT p50 {latency[n]['ttft_ms']['p50']:.1f} ms "
                       f"p99 {latency[n]['ttft_ms']['p99']:.1f} ms" for n in latency),
             percentile(paired, 50))

    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else list(reversed(names))
        reqs = bodies(args.tput_requests, args.prompt_tokens, args.tput_output, 100 + rnd)
        for n in order:
            quiet_s = wait_quiet(list(pids.values()))
            load = load_average()
            cpu0 = {m: process_tree_cpu(pid) for m, pid in pids.items()}
            stats = asyncio.run(run_load(f"{urls[n]}/v1/completions", reqs, args.concurrency))
            cpu = {m: cpu_delta(cpu0[m], process_tree_cpu(pid)) for m, pid in pids.items()}
            _check(n, "throughput", stats)
            idle = {m: round(sum(c.values()), 3) for m, c in cpu.items() if m != n}
            rounds.append({"round": rnd + 1, "system": n, "loadavg_1m": load, "stats": stats,
                           "cpu_s": cpu[n], "idle_servers_cpu_s": idle,
                           "idle_server_cpu_detail": {m: c for m, c in cpu.items() if m != n},
                           "waited_for_quiet_s": round(quiet_s, 2)})
            log.info("round %d %s: %.0f tok/s, TPOT p50 %.2f ms, TTFT p50 %.1f ms "
                     "(load %.2f; idle server used %s CPU s)", rnd + 1, n,
                     stats["output_tokens_per_s"], stats["tpot_ms"]["p50"],
                     stats["ttft_ms"]["p50"], load, idle)
    return {"latency": latency, "latency_loadavg_1m": load_lat,
            "paired_ttft_diff_ms": summarize(paired), "throughput_rounds": rounds}


def aggregate(m: dict[str, Any], system: str) -> dict[str, Any]:
    if system not in m["latency"]:
        return {}
    lat = m["latency"][system]
    mine = [r for r in m["throughput_rounds"] if r["system"] == system]

    def med(f: Any) -> float:
        return float(statistics.median(f(r["stats"]) for r in mine))

    return {
        "ttft_p50_ms": lat["ttft_ms"]["p50"],
        "ttft_p99_ms": lat["ttft_ms"]["p99"],
        "latency_tpot_p50_ms": lat["tpot_ms"]["p50"],
        "tokens_per_s": med(lambda s: s["output_tokens_per_s"]),
        "tokens_per_s_rounds": [r["stats"]["output_tokens_per_s"] for r in mine],
        "tput_itl_p50_ms": med(lambda s: s["itl_ms"]["p50"]),
        "tput_tpot_p50_ms": med(lambda s: s["tpot_ms"]["p50"]),
        "tput_ttft_p50_ms": med(lambda s: s["ttft_ms"]["p50"]),
        "loadavg_1m": statistics.median(r["loadavg_1m"] for r in mine),
    }


def per_round_ratios(m: dict[str, Any]) -> list[float]:
    """ours / vLLM tokens/s within each round (the two runs are adjacent in time)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in m["throughput_rounds"]:
        by_round.setdefault(r["round"], {})[r["system"]] = r["stats"]["output_tokens_per_s"]
    return [d["ours"] / d["vllm"] for d in by_round.values() if "ours" in d and d.get("vllm")]


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    o, v = result["summary"]["ours"], result["summary"]["vllm"]
    m = result["machine"]

    def ratio(a: str) -> str:
        return f"{o[a] / v[a]:.2f}x" if o and v and v[a] else "-"

    def fmt(d: dict[str, float], k: str, spec: str) -> str:
        return format(d[k], spec) if d else "-"

    rr = result["tokens_per_s_ratio_per_round"]
    paired_ratio = f"{statistics.median(rr):.2f}x" if rr else "-"

    lines = [
        "# Agg graph vs vLLM's own OpenAI server",
        "",
        run_line(result["command"], m, python=True)
        + " (provisional: 2-core machine shared with other jobs).",
        f"Model `{args.model}`, block size 32, max-model-len {args.max_model_len}, "
        f"max-num-seqs {args.max_num_seqs}, 1 GiB KV cache, eager, engine core in a child "
        f"process for both. Prompts {args.prompt_tokens} random token ids; "
        f"(a) {args.ttft_requests} sequential requests x {args.ttft_output} tokens; "
        f"(b) {args.tput_requests} requests x {args.tput_output} tokens at "
        f"{args.concurrency} concurrent streams, {args.rounds} rounds per server (median); "
        "ignore_eos. Both servers up for the whole run, driven one at a time, order "
        "alternating.",
        "",
        "| metric | ours (agg graph) | vLLM server | ours / vLLM | target |",
        "| --- | --- | --- | --- | --- |",
        f"| TTFT p50, concurrency 1 (ms) | {fmt(o, 'ttft_p50_ms', '.1f')} | "
        f"{fmt(v, 'ttft_p50_ms', '.1f')} | overhead {result['ttft_overhead_ms']:+.1f} ms | "
        f"overhead <= {TARGET_TTFT_OVERHEAD_MS:.0f} ms |",
        f"| TTFT ours - vLLM, same prompt, p50 / p90 (ms) | | | "
        f"{result['paired_ttft_diff_ms']['p50']:+.1f} / {result['paired_ttft_diff_ms']['p90']:+.1f}"
        " | |",
        f"| TTFT p99, concurrency 1 (ms) | {fmt(o, 'ttft_p99_ms', '.1f')} | "
        f"{fmt(v, 'ttft_p99_ms', '.1f')} | {ratio('ttft_p99_ms')} | |",
        f"| output tokens/s, {args.concurrency} streams | {fmt(o, 'tokens_per_s', ',.0f')} | "
        f"{fmt(v, 'tokens_per_s', ',.0f')} | {ratio('tokens_per_s')} | "
        f">= {TARGET_TPUT_RATIO}x |",
        f"| same, median of per-round ratios | | | {paired_ratio} | >= {TARGET_TPUT_RATIO}x |",
        f"| TPOT p50, {args.concurrency} streams (ms) | {fmt(o, 'tput_tpot_p50_ms', '.2f')} | "
        f"{fmt(v, 'tput_tpot_p50_ms', '.2f')} | {ratio('tput_tpot_p50_ms')} | |",
        f"| ITL p50, {args.concurrency} streams (ms) | {fmt(o, 'tput_itl_p50_ms', '.2f')} | "
        f"{fmt(v, 'tput_itl_p50_ms', '.2f')} | {ratio('tput_itl_p50_ms')} | |",
        f"| TTFT p50, {args.concurrency} streams (ms) | {fmt(o, 'tput_ttft_p50_ms', '.1f')} | "
        f"{fmt(v, 'tput_ttft_p50_ms', '.1f')} | {ratio('tput_ttft_p50_ms')} | |",
        f"| TPOT p50, concurrency 1 (ms) | {fmt(o, 'latency_tpot_p50_ms', '.2f')} | "
        f"{fmt(v, 'latency_tpot_p50_ms', '.2f')} | {ratio('latency_tpot_p50_ms')} | |",
        f"| 1-min load average during (b) | {fmt(o, 'loadavg_1m', '.2f')} | "
        f"{fmt(v, 'loadavg_1m', '.2f')} | | |",
        "",
        f"1-min load average during (a): {result['measured']['latency_loadavg_1m']:.2f}. "
        "Output tokens/s per round: "
        + "; ".join(f"{n} " + ", ".join(f"{x:,.0f}" for x in d.get("tokens_per_s_rounds", []))
                    for n, d in result["summary"].items() if d) + ".",
        "",
        "Start-up to ready: " + ", ".join(f"{n} {t:.1f} s" for n, t in result["ready_s"].items())
        + "; SIGTERM to the main process until it exited: "
        + ", ".join(f"{n} {t:.1f} s" for n, t in result["stop_s"].items()) + ".",
        "",
        "CPU seconds per process during (b), per round:",
        "",
    ]
    hops = result["measured"]["latency"]
    hop_lines = ["", "TTFT at concurrency 1 where it is measured (same requests, same blocks): "
                 "directly at our VllmWorker and Processor over the request plane, through "
                 "our Frontend (HTTP), and vLLM's server (HTTP):", "",
                 "| measured at | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) |",
                 "| --- | --- | --- | --- |"]
    for name in ("ours@VllmWorker", "ours@Processor", "ours", "vllm"):
        if name in hops:
            h = hops[name]
            hop_lines.append(f"| {name} | {h['ttft_ms']['p50']:.1f} | {h['ttft_ms']['p90']:.1f} "
                             f"| {h['tpot_ms']['p50']:.2f} |")
    for r in result["measured"]["throughput_rounds"]:
        parts = ", ".join(f"{k.rsplit(':', 1)[0]} {s:.2f}" for k, s in
                          sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]) if s >= 0.05)
        lines.append(f"- round {r['round']} {r['system']}: {parts} "
                     f"(wall {r['stats']['wall_s']:.2f} s; idle server "
                     f"{sum(r['idle_servers_cpu_s'].values()):.2f})")
    if len(hop_lines) > 5:
        lines += hop_lines
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--only", choices=["ours", "vllm"], default=None)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--ttft-requests", type=int, default=30)
    p.add_argument("--ttft-output", type=int, default=32)
    p.add_argument("--ttft-block", type=int, default=5,
                   help="latency requests per server before switching to the other")
    p.add_argument("--tput-requests", type=int, default=64)
    p.add_argument("--tput-output", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--no-hops", action="store_true",
                   help="skip the direct request-plane calls of our Processor and VllmWorker")
    p.add_argument("--no-write", action="store_true", help="print only; keep result files")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from tools.model_builder import ensure_model

    model = ensure_model(REPO / args.model)
    info = machine_info()
    systems = [args.only] if args.only else ["ours", "vllm"]
    servers: dict[str, tuple[ManagedProcess, str]] = {}
    ready: dict[str, float] = {}
    try:
        for system in systems:  # one after the other: start-up is CPU-bound
            t0 = time.monotonic()
            starter = start_ours if system == "ours" else start_vllm
            try:
                servers[system] = starter(model, args)
            except (RuntimeError, TimeoutError) as exc:  # a shared machine: one more try
                log.warning("%s failed to start, trying once more: %s", system, exc)
                t0 = time.monotonic()
                servers[system] = starter(model, args)
            ready[system] = time.monotonic() - t0
            log.info("%s ready in %.1f s at %s", system, ready[system], servers[system][1])
        measured = measure(servers, args)
    finally:
        stopped: dict[str, float] = {}
        for system, (proc, _) in servers.items():
            code, stopped[system] = proc.stop(timeout=30, leader_only=True)
            log.info("%s stopped (exit %s) in %.1f s after SIGTERM to its main process",
                     system, code, stopped[system])
    summary = {"ours": aggregate(measured, "ours"), "vllm": aggregate(measured, "vllm")}
    o, v = summary["ours"], summary["vllm"]
    result: dict[str, Any] = {
        "command": "python benchmarks/agg_vs_vllm.py " + " ".join(argv or sys.argv[1:]),
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
        "ready_s": ready,
        "stop_s": stopped,
        "summary": summary,
        "tokens_per_s_ratio": o["tokens_per_s"] / v["tokens_per_s"] if o and v else None,
        "tokens_per_s_ratio_per_round": per_round_ratios(measured),
        "ttft_overhead_ms": o["ttft_p50_ms"] - v["ttft_p50_ms"] if o and v else float("nan"),
        "paired_ttft_diff_ms": measured["paired_ttft_diff_ms"],
        "targets": {"tokens_per_s_ratio": TARGET_TPUT_RATIO,
                    "ttft_overhead_ms": TARGET_TTFT_OVERHEAD_MS},
        "measured": measured,
    }
    md = markdown(result, args)
    print(md)
    if not args.no_write:
        for path in write_results("agg_vs_vllm", result, md):
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
