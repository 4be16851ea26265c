"""The agg graph against vLLM's own OpenAI server: same model, same engine settings.

    python benchmarks/agg_vs_vllm.py [--rounds 2] [--only ours|vllm]

Each round starts each server in turn (the order alternates between rounds), warms
it up, then drives a bounded streaming load over ``/v1/completions`` on 127.0.0.1:

  (a) latency: ``--ttft-requests`` sequential requests (concurrency 1), a
      ``--prompt-tokens`` token prompt, ``--ttft-output`` tokens (ignore_eos): TTFT p50/p99;
  (b) throughput: ``--tput-requests`` requests with ``--concurrency`` in flight,
      ``--tput-output`` tokens each (ignore_eos): output tokens/s, TPOT and ITL p50, TTFT.

Prompts are random token ids (seeded, one per request, the same for both servers in
a round), so the prefix cache never hits. Both servers run vLLM v1 with its engine core
in a child process, ``--block-size 32``, ``--max-model-len``, ``--max-num-seqs``, a
1 GiB KV cache, eager mode, prefix caching on, stat logging off, no access log. The
CPU seconds each process used during (b) are recorded (``cpu_s``). Every process
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    cpu_delta,
    load_average,
    machine_info,
    process_tree_cpu,
    run_load,
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


def start_ours(model: Path, args: argparse.Namespace) -> tuple[ManagedProcess, str]:
    """``dynamo serve graphs.agg:Frontend`` (embedded etcd/NATS) on a free port."""
    mml = str(args.max_model_len)
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", "graphs.agg:Frontend",
           "-f", "configs/agg.yaml", "--Frontend.port=0", f"--Common.model={model}",
           f"--Processor.model={model}", f"--VllmWorker.model={model}",
           f"--Frontend.max-model-len={mml}", f"--Processor.max-model-len={mml}",
           f"--VllmWorker.max-model-len={mml}", f"--VllmWorker.max-num-seqs={args.max_num_seqs}",
           "--VllmWorker.block-size=32", "--VllmWorker.kv-cache-space-gib=1",
           "--VllmWorker.enforce-eager=true"]
    proc = ManagedProcess(cmd, _env(), name="dynamo serve")
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


def start_vllm(model: Path, args: argparse.Namespace) -> tuple[ManagedProcess, str]:
    """vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "32", "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager", "--seed", "0",
           "--disable-log-stats", "--disable-uvicorn-access-log"]
    proc = ManagedProcess(cmd, _env(), name="vllm api_server")
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


def measure(system: str, url: str, pid: int, args: argparse.Namespace, seed: int
            ) -> dict[str, Any]:
    endpoint = f"{url}/v1/completions"
    warm = bodies(args.concurrency, args.prompt_tokens, 16, seed + 1000)
    asyncio.run(run_load(endpoint, warm, args.concurrency))
    asyncio.run(run_load(endpoint, warm[:4], 1))
    out: dict[str, Any] = {"system": system}

    out["load_before_latency"] = load_average()
    lat = asyncio.run(run_load(
        endpoint, bodies(args.ttft_requests, args.prompt_tokens, args.ttft_output, seed + 1), 1))
    out["latency"] = lat

    out["load_before_throughput"] = load_average()
    cpu0 = process_tree_cpu(pid)
    tput = asyncio.run(run_load(
        endpoint, bodies(args.tput_requests, args.prompt_tokens, args.tput_output, seed + 2),
        args.concurrency))
    out["cpu_s"] = cpu_delta(cpu0, process_tree_cpu(pid))
    out["throughput"] = tput
    out["load_after"] = load_average()
    for name, phase in (("latency", lat), ("throughput", tput)):
        if phase["errors"]:
            raise RuntimeError(f"{system} {name}: {phase['errors']} failed requests, "
                               f"first: {phase['first_error']}")
    log.info("%s: TTFT p50 %.1f ms p99 %.1f ms | %d streams: %.0f tok/s, TPOT p50 %.2f ms "
             "(load %.2f)", system, lat["ttft_ms"]["p50"], lat["ttft_ms"]["p99"],
             args.concurrency, tput["output_tokens_per_s"], tput["tpot_ms"]["p50"],
             out["load_after"])
    return out


def run_one(system: str, model: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    t0 = time.monotonic()
    proc, url = (start_ours if system == "ours" else start_vllm)(model, args)
    ready = time.monotonic() - t0
    try:
        result = measure(system, url, proc.pid, args, seed)
        result["ready_s"] = ready
        return result
    finally:
        code, took = proc.stop()
        log.info("%s stopped (exit %s) in %.1fs", system, code, took)


def aggregate(runs: list[dict[str, Any]], system: str) -> dict[str, float]:
    mine = [r for r in runs if r["system"] == system]
    if not mine:
        return {}

    def med(f: Any) -> float:
        return statistics.median(f(r) for r in mine)

    return {
        "ttft_p50_ms": med(lambda r: r["latency"]["ttft_ms"]["p50"]),
        "ttft_p99_ms": med(lambda r: r["latency"]["ttft_ms"]["p99"]),
        "latency_itl_p50_ms": med(lambda r: r["latency"]["itl_ms"]["p50"]),
        "tokens_per_s": med(lambda r: r["throughput"]["output_tokens_per_s"]),
        "tput_itl_p50_ms": med(lambda r: r["throughput"]["itl_ms"]["p50"]),
        "tput_tpot_p50_ms": med(lambda r: r["throughput"]["tpot_ms"]["p50"]),
        "latency_tpot_p50_ms": med(lambda r: r["latency"]["tpot_ms"]["p50"]),
        "tput_ttft_p50_ms": med(lambda r: r["throughput"]["ttft_ms"]["p50"]),
        "loadavg_1m": med(lambda r: r["load_before_throughput"]),
    }


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    o, v = result["summary"]["ours"], result["summary"]["vllm"]
    m = result["machine"]

    def ratio(a: str) -> str:
        return f"{o[a] / v[a]:.2f}x" if o and v and v[a] else "-"

    def fmt(d: dict[str, float], k: str, spec: str) -> str:
        return format(d[k], spec) if d else "-"

    lines = [
        "# Agg graph vs vLLM's own OpenAI server",
        "",
        f"`{result['command']}` at {m['at']}, Python {m['python']}, {m['cpus']} CPUs, "
        f"1-min load average {m['loadavg_1m']:.2f} at start "
        "(provisional: 2-core machine shared with other jobs).",
        f"Model `{args.model}`, block size 32, max-model-len {args.max_model_len}, "
        f"max-num-seqs {args.max_num_seqs}, 1 GiB KV cache, eager, engine core in a child "
        f"process for both. Prompts {args.prompt_tokens} random token ids; "
        f"(a) {args.ttft_requests} sequential requests x {args.ttft_output} tokens; "
        f"(b) {args.tput_requests} requests x {args.tput_output} tokens at "
        f"{args.concurrency} concurrent streams; ignore_eos. Median of {args.rounds} "
        "round(s), server order alternating.",
        "",
        "| metric | ours (agg graph) | vLLM server | ours / vLLM | target |",
        "| --- | --- | --- | --- | --- |",
        f"| TTFT p50, concurrency 1 (ms) | {fmt(o, 'ttft_p50_ms', '.1f')} | "
        f"{fmt(v, 'ttft_p50_ms', '.1f')} | overhead {result['ttft_overhead_ms']:+.1f} ms | "
        f"overhead <= {TARGET_TTFT_OVERHEAD_MS:.0f} ms |",
        f"| TTFT p99, concurrency 1 (ms) | {fmt(o, 'ttft_p99_ms', '.1f')} | "
        f"{fmt(v, 'ttft_p99_ms', '.1f')} | {ratio('ttft_p99_ms')} | |",
        f"| output tokens/s, {args.concurrency} streams | {fmt(o, 'tokens_per_s', ',.0f')} | "
        f"{fmt(v, 'tokens_per_s', ',.0f')} | {ratio('tokens_per_s')} | "
        f">= {TARGET_TPUT_RATIO}x |",
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
        "CPU seconds per process during (b), per round:",
        "",
    ]
    for r in result["runs"]:
        parts = ", ".join(f"{k.rsplit(':', 1)[0]} {s:.2f}" for k, s in
                          sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]) if s >= 0.05)
        lines.append(f"- round {r['round']} {r['system']}: {parts} "
                     f"(wall {r['throughput']['wall_s']:.2f} s)")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-llama")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=["ours", "vllm"], default=None)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--ttft-requests", type=int, default=30)
    p.add_argument("--ttft-output", type=int, default=32)
    p.add_argument("--tput-requests", type=int, default=64)
    p.add_argument("--tput-output", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--no-write", action="store_true", help="print only; keep result files")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from dynagraph.llm.model_builder import ensure_model

    model = ensure_model(REPO / args.model)
    info = machine_info()
    runs: list[dict[str, Any]] = []
    systems = [args.only] if args.only else ["ours", "vllm"]
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        for system in order:
            r = run_one(system, model, args, seed=rnd * 10)
            r["round"] = rnd + 1
            runs.append(r)
    summary = {"ours": aggregate(runs, "ours"), "vllm": aggregate(runs, "vllm")}
    o, v = summary["ours"], summary["vllm"]
    result: dict[str, Any] = {
        "command": "python benchmarks/agg_vs_vllm.py " + " ".join(argv or sys.argv[1:]),
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k != "no_write"},
        "summary": summary,
        "tokens_per_s_ratio": o["tokens_per_s"] / v["tokens_per_s"] if o and v else None,
        "ttft_overhead_ms": o["ttft_p50_ms"] - v["ttft_p50_ms"] if o and v else float("nan"),
        "targets": {"tokens_per_s_ratio": TARGET_TPUT_RATIO,
                    "ttft_overhead_ms": TARGET_TTFT_OVERHEAD_MS},
        "runs": runs,
    }
    md = markdown(result, args)
    print(md)
    if not args.no_write:
        for path in write_results("agg_vs_vllm", result, md):
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
