"""NIXL progress-thread modes: KV READ latency (with a completion notification) and idle CPU.

Why ``dynagraph.llm.kv.transfer.nixl_connector`` keeps NIXL's progress thread but gives it a poll delay.
Two processes, as a decode (initiator) and a prefill (target) engine: the initiator
READs 2 MiB in 4 descriptors (vLLM's merged layout for a 1k-token prompt of the tiny
model) with a notification, like vLLM's NixlConnector, and checks for completion every
``--step-ms`` (an engine step); the target calls ``get_new_notifs`` every
``--step-ms`` too (its engine step). Modes:

- ``no-thread``: no progress thread; UCX moves only when an agent is polled;
- ``busy``: NIXL's default (thread on, ``pthrDelay = 0`` hard-coded in ``nixl._api``);
- ``delay-N``: thread on, ``pthrDelay = N`` us, set the way ``nixl_connector`` sets it.

Agents are made as vLLM makes them (``num_threads=4``, NIXL's threaded UCX engine);
``--num-threads 0`` gives the plain UCX engine, whose progress thread behaves differently.

Per mode: median READ time (post to DONE) over ``--reps`` and the CPU each process
burns while idle (``time.process_time`` over 2 s with nothing to move).

    python benchmarks/nixl_progress.py     # table; writes benchmarks/results/nixl_progress.*
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
SIZE = 2 << 20
DESCS = 4
MODES: dict[str, int | None] = {"no-thread": None, "busy": 0, "delay-100": 100,
                                "delay-10000": 10_000}
IDLE_S = 2.0
NUM_THREADS = 4
"""As vLLM's NixlConnector makes its agents (``num_threads`` 4: NIXL's threaded UCX engine)."""


def _agent(name: str, delay_us: int | None, num_threads: int) -> Any:
    import nixl._api as api
    from nixl._api import nixl_agent, nixl_agent_config

    from dynagraph.llm.kv.transfer.nixl_side import delayed_agent_config

    if delay_us is not None:  # 0 included: the modes run one after another here
        api.nixlBind.nixlAgentConfig = delayed_agent_config(api.nixlBind.nixlAgentConfig,
                                                            delay_us)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=delay_us is not None,
                                              capture_telemetry=True, num_threads=num_threads))


def _target(conn: Connection, delay_us: int | None, step_s: float, num_threads: int) -> None:
    agent = _agent("target", delay_us, num_threads)
    buf = np.ones(SIZE, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SIZE, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not conn.poll(step_s):  # one "engine step" per poll
        agent.get_new_notifs()
    conn.recv()
    cpu0, wall0 = time.process_time(), time.monotonic()
    conn.poll(IDLE_S + 5)  # idle: no polling, only the progress thread (if any)
    conn.send((time.process_time() - cpu0) / (time.monotonic() - wall0))


def _descs(base: int) -> np.ndarray:
    part = SIZE // DESCS
    return np.array([(base + i * part, part, 0) for i in range(DESCS)], dtype=np.uint64)


def run_mode(delay_us: int | None, reps: int, step_s: float, num_threads: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, delay_us, step_s, num_threads),
                       daemon=True)
    proc.start()
    try:
        meta, remote_base = parent.recv()
        agent = _agent("initiator", delay_us, num_threads)
        buf = np.zeros(SIZE, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, SIZE, 0, "")], "DRAM")
        remote = agent.add_remote_agent(meta)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(buf.ctypes.data), "DRAM")
        rh = agent.prep_xfer_dlist(remote, _descs(remote_base), "DRAM")
        idx = np.arange(DESCS)
        times = []
        for i in range(reps + 2):  # two warm-ups (connection wire-up)
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", lh, idx, rh, idx, notif_msg=b"req-%d" % i)
            state = agent.transfer(h)
            while state != "DONE":
                if state == "ERR" or time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"NIXL READ failed: {state}")
                time.sleep(step_s)
                state = agent.check_xfer_state(h)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
        parent.send("idle")
        cpu0 = time.process_time()
        time.sleep(IDLE_S)
        idle_initiator = (time.process_time() - cpu0) / IDLE_S
        idle_target = parent.recv() if parent.poll(IDLE_S + 10) else float("nan")
        if not np.array_equal(buf[:8], np.ones(8, dtype=np.uint8)):
            raise RuntimeError("READ data mismatch")
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    med = statistics.median(times)
    return {"median_ms": round(med * 1e3, 3), "gib_per_s": round(SIZE / med / 2**30, 2),
            "idle_cpu_initiator": round(idle_initiator, 3),
            "idle_cpu_target": round(float(idle_target), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=5.0,
                    help="how often each side polls NIXL (an engine step)")
    ap.add_argument("--num-threads", type=int, default=NUM_THREADS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = [{"mode": mode, **run_mode(delay, args.reps, args.step_ms / 1e3, args.num_threads)}
            for mode, delay in MODES.items()]
    head = f"{'mode':12} {'READ median ms':>15} {'GiB/s':>7} {'idle CPU initiator':>19} {'target':>7}"
    lines = [head] + [f"{r['mode']:12} {r['median_ms']:15.3f} {r['gib_per_s']:7.2f} "
                      f"{r['idle_cpu_initiator']:19.3f} {r['idle_cpu_target']:7.3f}" for r in rows]
    print("\n".join(lines))
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    meta = {"reps": args.reps, "step_ms": args.step_ms, "num_threads": args.num_threads, "bytes": SIZE, "descriptors": DESCS,
            "note": "2-core VM shared with other work: provisional numbers"}
    (RESULTS / "nixl_progress.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                           indent=2) + "\n")
    (RESULTS / "nixl_progress.md").write_text(
        "# NIXL progress-thread modes: READ + notification latency and idle CPU\n\n"
        f"`python benchmarks/nixl_progress.py --step-ms {args.step_ms:g}` ({args.reps} READs "
        f"of 2 MiB in {DESCS} descriptors; both sides poll NIXL every {args.step_ms:g} ms like "
        "an engine step; idle CPU in cores over 2 s); provisional (shared 2-core VM).\n\n"
        "```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
