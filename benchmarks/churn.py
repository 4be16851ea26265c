"""Churn without hangs: streamed load on the Planner-scaled mocker graph while workers come
and go; every request must complete or end with a clean error within its deadline.

    python benchmarks/churn.py                       # 300 s of load, ~6 min in all
    python benchmarks/churn.py --duration 120 --server-log /tmp/churn-serve.log

Serves ``graphs.mocker_planner:Frontend -f configs/mocker_planner.yaml --drain-grace S``
(the Planner scales MockerWorker processes between the config's min and max replicas; a
retired one drains first) against an etcd and a NATS this script starts. The load is
closed-loop streamed ``/v1/completions`` (``ignore_eos``: every answer is ``--max-tokens``
long) in phases of ``--phase-s`` seconds that alternate ``--low`` and ``--high``
concurrent streams, so the Planner scales up and down during the run. Meanwhile a random
live MockerWorker process is SIGKILLed every ``--kill-every`` seconds (PIDs from ``dynamo
serve``'s output; it restarts the killed worker). The MockerWorker processes registered
in etcd are counted every 0.5 s. A client whose request failed waits ``--retry-after``
seconds before its next one.

Every request has a ``--deadline``; the client gives up then. Each request is exactly one of:

    completed   [DONE], a finish reason and all max-tokens tokens
    refused     a clean error: an HTTP error status or an error event in the stream
    truncated   ended without an error event but short: no finish reason / [DONE], too
                few tokens, or the connection dropped mid-stream
    hung        neither its end nor an error by the deadline

Goal: hung = 0 (NVIDIA Dynamo's tracker reports 1.6% hung requests under churn). Per
phase (requests by their start time) and in total: those counts, migrations (the
Processor's ``dynamo_processor_migrations_total``), p99 TTFT of the completed ones and the
replica count (min / max); per kill, the requests refused in the 10 s after it. Results: ``benchmarks/results/churn.{json,md}`` (or ``--name``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as bench  # noqa: E402
from benchmarks._mocker import exit_on_sigterm  # noqa: E402
from benchmarks.chaos import migrations, pids_of, short  # noqa: E402
from benchmarks.mocker_planner import count_workers, planner_decisions  # noqa: E402
from dynagraph.runtime.infra import free_port, start_etcd, start_nats  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.churn")

MODEL = "tiny-llama"
WORKER = "MockerWorker"
OUTCOMES = ("completed", "refused", "truncated", "hung")
SCALING_LINE = re.compile(r"scaling MockerWorker from|MockerWorker:\d+ (retired|did not drain"
                          r"|\(pid \d+\) exited)|restarting MockerWorker")


@dataclass
class Phase:
    index: int
    concurrency: int
    start: float
    end: float = 0.0
    migrations: float = 0.0
    results: list[bench.StreamResult] = field(default_factory=list)


@dataclass
class Kill:
    at: float
    note: str


# -- classifying a request --------------------------------------------------------------

def outcome(r: bench.StreamResult, max_tokens: int) -> str:
    """completed / refused / truncated / hung (see the module docstring)."""
    if r.error is None:
        return "truncated" if short(r, max_tokens) else "completed"
    if re.match(r"(Server)?TimeoutError\b", r.error):
        return "hung"  # the client's deadline (aiohttp's total timeout) ran out
    if re.match(r"\w+: ", r.error):
        return "truncated"  # a client exception: the connection dropped, no error event
    return "refused"  # "HTTP 503: ..." or an error event's object


# -- the load -----------------------------------------------------------------------------

def prompt(rng: random.Random, i: int, words: int) -> str:
    """A prompt of its own (no shared prefix to pin requests to one worker)."""
    vocab = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud", "ember"]
    return f"Request {i}: " + " ".join(rng.choice(vocab) for _ in range(words))


async def load(url: str, phases: list[Phase], stop: asyncio.Event, args: argparse.Namespace
               ) -> None:
    """``max(concurrency)`` closed-loop clients; client k sends while k < the current
    phase's concurrency. Each result goes to the phase it started in."""
    import aiohttp

    rng = random.Random(args.seed)
    counter = iter(range(10**9))

    async def client(k: int, session: Any) -> None:
        while not stop.is_set():
            phase = phases[-1] if phases else None
            if phase is None or k >= phase.concurrency:
                await asyncio.sleep(0.2)
                continue
            i = next(counter)
            body = {"model": MODEL, "prompt": prompt(rng, i, args.prompt_words),
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            try:
                res = await bench.stream_request(session, f"{url}/v1/completions", body,
                                                 args.deadline)
            except Exception as exc:  # noqa: BLE001 - one request's surprise, not the run's
                res = bench.StreamResult(start=time.perf_counter(),
                                         error=f"{type(exc).__name__}: {exc}")
            phase.results.append(res)
            if res.error is not None:
                await asyncio.sleep(args.retry_after)  # refused: back off, as a client would

    most = max(args.low, args.high)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=most)) as session:
        await asyncio.gather(*(client(k, session) for k in range(most)))


async def run_phases(graph: bench.ManagedProcess, phases: list[Phase],
                     args: argparse.Namespace) -> None:
    """Alternate low / high concurrency every ``--phase-s`` until ``--duration``."""
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < args.duration:
        conc = args.low if i % 2 == 0 else args.high
        before = await asyncio.to_thread(migrations, graph)
        phase = Phase(i, conc, time.perf_counter(), migrations=before)
        phases.append(phase)
        log.info("phase %d: %d streams", i, conc)
        await asyncio.sleep(min(args.phase_s, args.duration - (phase.start - t0)))
        phase.end = time.perf_counter()
        i += 1


async def killer(graph: bench.ManagedProcess, stop: asyncio.Event, kills: list[Kill],
                 every: float, rng: random.Random) -> None:
    """SIGKILL one random live MockerWorker process every ``every`` seconds."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return
        pids = pids_of(graph, WORKER)
        if not pids:
            kills.append(Kill(time.perf_counter(), f"no live {WORKER} process"))
            continue
        victim = rng.choice(pids)
        try:
            os.kill(victim, signal.SIGKILL)
            note = f"SIGKILL {WORKER} pid {victim} (of {len(pids)} live)"
        except ProcessLookupError:
            note = f"{WORKER} pid {victim} was already gone"
        kills.append(Kill(time.perf_counter(), note))
        log.info("%s", note)


# -- one run --------------------------------------------------------------------------

async def churn(graph: bench.ManagedProcess, url: str, etcd_url: str,
                args: argparse.Namespace) -> dict[str, Any]:
    phases: list[Phase] = []
    kills: list[Kill] = []
    replicas: list[tuple[float, int]] = []
    stop_load, stop_kill, stop_count = asyncio.Event(), asyncio.Event(), asyncio.Event()
    t0, wall0 = time.perf_counter(), time.time()
    counter = asyncio.create_task(count_workers(etcd_url, stop_count, replicas))
    phaser = asyncio.create_task(run_phases(graph, phases, args))
    loader = asyncio.create_task(load(url, phases, stop_load, args))
    kill_task = asyncio.create_task(killer(graph, stop_kill, kills, args.kill_every,
                                           random.Random(args.seed)))
    await phaser
    stop_load.set()
    stop_kill.set()
    await kill_task
    # every request in flight ends by its deadline: wait for them (and a margin)
    await asyncio.wait_for(loader, args.deadline + 30)
    for p, nxt in zip(phases, [*phases[1:], None], strict=True):
        after = nxt.migrations if nxt is not None else await asyncio.to_thread(migrations,
                                                                                graph)
        p.migrations = after - p.migrations
    stop_count.set()
    await counter
    decisions = await planner_decisions(etcd_url)
    return {"t0": t0, "wall0": wall0, "phases": phases, "kills": kills,
            "replicas": [(t - wall0, n) for t, n in replicas], "decisions": decisions}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(Path("models/tiny-llama"))
    etcd, nats = start_etcd(), start_nats()
    port = free_port()
    graph = bench.ManagedProcess(
        bench.serve_command("mocker_planner", "mocker_planner", port, model_dir,
                            f"--drain-grace={args.drain_grace}", "--ready-timeout=300",
                            *args.serve_arg),
        bench.infra_env({"etcd": etcd, "nats": nats}), name="mocker_planner")
    try:
        graph.wait_line(lambda s: s.startswith("dynamo serve: graph "), 330)
        got = asyncio.run(churn(graph, f"http://127.0.0.1:{port}", etcd.url, args))
    finally:
        graph.stop(timeout=args.drain_grace + 15)
        if args.server_log is not None:
            args.server_log.write_text("\n".join(graph.lines) + "\n")
        nats.stop()
        etcd.stop()
    got["serve_scaling_lines"] = [ln.strip() for ln in graph.lines if SCALING_LINE.search(ln)]
    return got


# -- results ----------------------------------------------------------------------------

def counts(results: list[bench.StreamResult], max_tokens: int) -> dict[str, int]:
    got = {o: 0 for o in OUTCOMES}
    for r in results:
        got[outcome(r, max_tokens)] += 1
    return {"sent": len(results), **got}


def ttft_p99(results: list[bench.StreamResult], max_tokens: int) -> float | None:
    ttft = [r.chunk_times[0] * 1000 for r in results
            if outcome(r, max_tokens) == "completed" and r.chunk_times]
    return round(bench.percentile(ttft, 99), 1) if ttft else None


def replica_range(samples: list[tuple[float, int]], lo: float, hi: float) -> list[int]:
    inside = [n for t, n in samples if lo <= t < hi]
    return [min(inside), max(inside)] if inside else []


def timeline(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The replica count's change points: (seconds into the run, count)."""
    out: list[tuple[float, int]] = []
    for t, n in samples:
        if not out or out[-1][1] != n:
            out.append((round(t, 1), n))
    return out


def incidents(results: list[bench.StreamResult], t0: float, max_tokens: int
              ) -> list[dict[str, Any]]:
    """Every request that did not complete: when it started, how it ended, what it got."""
    return [{"outcome": outcome(r, max_tokens), "started_s": round(r.start - t0, 2),
             "ended_after_s": round(r.end, 2), "tokens": r.completion_tokens,
             "last_token_at_s": round(r.chunk_times[-1], 2) if r.chunk_times else None,
             "finish_reason": r.finish_reason, "done": r.done, "error": r.error}
            for r in results if outcome(r, max_tokens) != "completed"]


def kill_rows(got: dict[str, Any], max_tokens: int, window: float = 10.0
              ) -> list[dict[str, Any]]:
    """Each kill, the MockerWorker processes registered just before it, and the requests
    refused (ended with a clean error) within ``window`` seconds after it."""
    t0 = got["t0"]
    ends = [r.start - t0 + r.end for p in got["phases"] for r in p.results
            if outcome(r, max_tokens) == "refused"]
    kills = [k.at - t0 for k in got["kills"]]
    rows = []
    for at, k, nxt in zip(kills, got["kills"], [*kills[1:], float("inf")], strict=True):
        before = [n for t, n in got["replicas"] if t <= at]
        rows.append({"at_s": round(at, 1), "what": k.note,
                     "registered_before": before[-1] if before else None,
                     "refused_after": sum(at <= e < min(at + window, nxt) for e in ends)})
    return rows


def summarize(got: dict[str, Any], args: argparse.Namespace, command: str) -> dict[str, Any]:
    m, t0, wall0 = args.max_tokens, got["t0"], got["wall0"]
    samples = got["replicas"]
    rows = []
    for p in got["phases"]:
        lo, hi = p.start - t0, p.end - t0
        rows.append({"phase": p.index, "streams": p.concurrency, "from_s": round(lo, 1),
                     "to_s": round(hi, 1), **counts(p.results, m),
                     "migrated": p.migrations, "ttft_p99_ms": ttft_p99(p.results, m),
                     "replicas_min_max": replica_range(samples, lo, hi)})
    everything = [r for p in got["phases"] for r in p.results]
    ns = [n for _, n in samples]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        "command": command, "args": settings, "machine": bench.machine_info(),
        "total": {**counts(everything, m), "migrated": sum(p.migrations for p in got["phases"]),
                  "ttft_p99_ms": ttft_p99(everything, m)},
        "phases": rows,
        "replicas": {"min": min(ns, default=0), "max": max(ns, default=0),
                     "timeline": timeline(samples)},
        "kills": kill_rows(got, m),
        "serve_scaling_lines": got["serve_scaling_lines"],
        "planner_decisions": [{**d, "t": round(d["t"] - wall0, 2)} for d in got["decisions"]],
        "not_completed": incidents(everything, t0, m),
    }


def markdown(d: dict[str, Any]) -> str:
    a, tot, rep = d["args"], d["total"], d["replicas"]
    moves = [re.search(r"from (\d+) to (\d+)", s) for s in d["serve_scaling_lines"]]
    ups = sum(int(m.group(1)) < int(m.group(2)) for m in moves if m)
    downs = sum(int(m.group(1)) > int(m.group(2)) for m in moves if m)
    restarts = sum("restarting" in s for s in d["serve_scaling_lines"])
    lines = [
        "# Churn without hangs: graphs.mocker_planner", "",
        f"{bench.run_line(d['command'], d['machine'])}. {a['duration']:.0f} s of streamed "
        f"/v1/completions ({a['max_tokens']} tokens, ~{a['prompt_words']}-word prompts), "
        f"{a['low']} and {a['high']} streams in alternating {a['phase_s']:.0f} s phases, "
        f"deadline {a['deadline']:.0f} s per request; a random MockerWorker SIGKILLed every "
        f"{a['kill_every']:.0f} s; `--drain-grace {a['drain_grace']:.0f}`.", "",
        f"**Total: {tot['sent']} sent, {tot['completed']} completed, {tot['refused']} refused, "
        f"{tot['truncated']} truncated, {tot['hung']} hung** ({tot['migrated']:.0f} migrated; "
        f"TTFT p99 {tot['ttft_p99_ms']} ms).", "",
        "| phase | streams | s | sent | completed | refused | truncated | hung | migrated "
        "| TTFT p99 ms | replicas min-max |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["phases"]:
        mm = "-".join(map(str, r["replicas_min_max"]))
        lines.append(f"| {r['phase']} | {r['streams']} | {r['from_s']:.0f}-{r['to_s']:.0f} | "
                     f"{r['sent']} | {r['completed']} | {r['refused']} | {r['truncated']} | "
                     f"{r['hung']} | {r['migrated']:.0f} | {r['ttft_p99_ms']} | {mm} |")
    steps = ", ".join(f"{t:.0f}s: {n}" for t, n in rep["timeline"])
    lines += ["", f"MockerWorker processes in etcd (every 0.5 s): min {rep['min']}, max "
              f"{rep['max']}; changes: {steps}.", "",
              f"Kills: {len(d['kills'])} ({sum('SIGKILL' in k['what'] for k in d['kills'])} "
              f"SIGKILLs); dynamo serve restarted a worker {restarts} times, scaled MockerWorker "
              f"up {ups} and down {downs} times ({len(d['planner_decisions'])} Planner "
              "decisions in the JSON)."]
    lines += ["", "| kill at s | what | MockerWorkers registered before | refused in the "
              "next 10 s |", "|---|---|---|---|"]
    lines += [f"| {k['at_s']} | {k['what']} | {k['registered_before']} | {k['refused_after']} |"
              for k in d["kills"]]
    refused_after = sum(k["refused_after"] for k in d["kills"])
    if tot["refused"]:
        lines += ["", f"{refused_after} of the {tot['refused']} refused requests ended within "
                  "10 s after a kill."]
    lines += ["", "`migrated` counts the Processor's migrations "
              "(`dynamo_processor_migrations_total`), those of refused requests included."]
    refusals: dict[str, int] = {}
    for b in d["not_completed"]:
        if b["outcome"] == "refused":
            kind = re.sub(r"request \w+: ", "", b["error"])
            kind = re.sub(r"\d+(\.\d+){3}:\d+.*", "ADDRESS ...", kind)[:200]
            refusals[kind] = refusals.get(kind, 0) + 1
    if refusals:
        lines += ["", "Refusals by error (request ids and addresses elided):", ""]
        lines += [f"- {n} x `{kind}`" for kind, n in sorted(refusals.items(),
                                                           key=lambda kv: -kv[1])]
    bad = [b for b in d["not_completed"] if b["outcome"] in ("truncated", "hung")]
    if bad:
        lines += ["", "Truncated or hung requests (first 20):", ""]
        lines += [f"- {b['outcome']}: started at {b['started_s']} s, ended after "
                  f"{b['ended_after_s']} s, {b['tokens']} tokens (last at "
                  f"{b['last_token_at_s']} s), finish {b['finish_reason']}, [DONE] "
                  f"{b['done']}, error {b['error']}" for b in bad[:20]]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds per load phase")
    p.add_argument("--low", type=int, default=2, help="streams in the low phases")
    p.add_argument("--high", type=int, default=24, help="streams in the high phases")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--deadline", type=float, default=60.0,
                   help="seconds a request may take; none left open after it is hung")
    p.add_argument("--kill-every", type=float, default=20.0,
                   help="seconds between SIGKILLs of a random MockerWorker")
    p.add_argument("--drain-grace", type=float, default=30.0)
    p.add_argument("--retry-after", type=float, default=1.0,
                   help="seconds a client waits after a request that failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", type=Path, default=None,
                   help="write the graph's output (dynamo serve) to this file")
    p.add_argument("--name", default="churn", help="results name")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for dynamo serve (repeatable)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    exit_on_sigterm()  # the graph, etcd and NATS are stopped on SIGTERM too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("dynagraph").setLevel(logging.WARNING)  # our polls' connect lines
    command = "python benchmarks/churn.py " + shlex.join(sys.argv[1:])
    data = summarize(run(args), args, command)
    md = markdown(data)
    bench.write_results(args.name, data, md)
    print(md)
    return 0 if data["total"]["hung"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
