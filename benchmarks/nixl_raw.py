"""Raw NIXL READ bandwidth between two processes on this machine (the ceiling for KV moves).

A target process registers a host buffer; the initiator (this process) registers its
own, loads the target's agent metadata, and READs with the prepped path
(``prep_xfer_dlist`` + ``make_prepped_xfer``), polling ``check_xfer_state`` until done.
Layouts, for the KV sizes of a 1k- and a 4k-token prompt of the tiny model (64 KiB per
32-token block: 4 layers x K/V x 8 KiB):

- ``kv-blocks``: one 8 KiB descriptor per (layer, K/V, block), each (layer, K/V) region
  contiguous, like vLLM's NixlConnector with consecutive block ids;
- ``kv-scattered``: the same descriptors every other block (nothing merges);
- ``contiguous``: one descriptor of the whole size.

Both agents run without NIXL's progress thread, as the engines do (``nixl_connector``); the
target polls ``get_new_notifs`` every 0.5 ms instead, as a vLLM engine does every step.
``--progress-thread`` turns the thread on for comparison.

    python benchmarks/nixl_raw.py            # prints a table, writes benchmarks/results/nixl_raw.*
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_TOKENS = 32
DESC_BYTES = 8 * 1024  # 32 tokens x 2 KV heads x 64 dims x 2 bytes (bf16)
LAYERS_KV = 8  # 4 layers x (K, V)
PROMPTS = {"1k": 1024, "4k": 4000}


def _agent(name: str, progress_thread: bool) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread))


def _target(conn: Connection, size: int, progress_thread: bool) -> None:
    agent = _agent("target", progress_thread)
    buf = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy()
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    # Without a progress thread UCX moves only when the agent is polled (connection
    # wire-up needs the target too), as a vLLM engine does on every step.
    while not conn.poll(0.0005):
        agent.get_new_notifs()
    conn.close()


def _descs(base: int, n_blocks: int, scattered: bool, region: int) -> np.ndarray:
    step = 2 if scattered else 1
    rows = [(base + r * region + b * step * DESC_BYTES, DESC_BYTES, 0)
            for r in range(LAYERS_KV) for b in range(n_blocks)]
    return np.array(rows, dtype=np.uint64)


def _read(agent: Any, remote: str, local: np.ndarray, far: np.ndarray, reps: int,
          windows: int) -> list[float]:
    """READ ``reps`` times; rep i uses window ``i % windows`` (so the data is not cache-hot)."""
    n = len(local)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _windows(local, windows), "DRAM")
    rh = agent.prep_xfer_dlist(remote, _windows(far, windows), "DRAM")
    times: list[float] = []
    try:
        for i in range(reps):
            idx = np.arange(n) + (i % windows) * n
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
            state = agent.transfer(h)
            deadline = t0 + 10
            while state != "DONE":
                if state == "ERR" or time.perf_counter() > deadline:
                    raise RuntimeError(f"NIXL READ failed: {state}")
                state = agent.check_xfer_state(h)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
    finally:
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    return times


def _windows(descs: np.ndarray, windows: int) -> np.ndarray:
    """``descs`` repeated ``windows`` times, window k shifted by k * WINDOW_BYTES."""
    shifted = [descs.copy() for _ in range(windows)]
    for k, d in enumerate(shifted):
        d[:, 0] += np.uint64(k * WINDOW_BYTES)
    return np.concatenate(shifted)


WINDOW_BYTES = 0  # set by run(): the span of one layout copy


def run(reps: int, progress_thread: bool, windows: int) -> list[dict[str, Any]]:
    global WINDOW_BYTES
    max_blocks = max(PROMPTS.values()) // BLOCK_TOKENS + 1
    region = 2 * max_blocks * DESC_BYTES  # room for the scattered layout
    WINDOW_BYTES = LAYERS_KV * region
    size = WINDOW_BYTES * windows
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, size, progress_thread), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(30):
            raise RuntimeError("target process did not start")
        meta, remote_base = parent.recv()
        agent = _agent("initiator", progress_thread)
        buf = np.zeros(size, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
        remote = agent.add_remote_agent(meta)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        for label, tokens in PROMPTS.items():
            n_blocks = -(-tokens // BLOCK_TOKENS)
            nbytes = n_blocks * LAYERS_KV * DESC_BYTES
            layouts = {
                "kv-blocks": (_descs(buf.ctypes.data, n_blocks, False, region),
                              _descs(remote_base, n_blocks, False, region)),
                "kv-scattered": (_descs(buf.ctypes.data, n_blocks, True, region),
                                 _descs(remote_base, n_blocks, True, region)),
                "contiguous": (np.array([(buf.ctypes.data, nbytes, 0)], dtype=np.uint64),
                               np.array([(remote_base, nbytes, 0)], dtype=np.uint64)),
            }
            for layout, (local, far) in layouts.items():
                _read(agent, remote, local, far, 3, 1)  # warm-up (connection set-up)
                times = _read(agent, remote, local, far, reps, windows)
                med = statistics.median(times)
                rows.append({"prompt": label, "tokens": tokens, "layout": layout,
                             "cache": "cold" if windows > 1 else "hot",
                             "descriptors": len(local), "bytes": nbytes,
                             "median_ms": round(med * 1e3, 3),
                             "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
                             "gib_per_s": round(nbytes / med / 2**30, 3)})
        if not np.array_equal(buf[:64], np.arange(8, dtype=np.uint64).view(np.uint8)):
            raise RuntimeError("READ data mismatch")
    finally:
        parent.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--progress-thread", action="store_true")
    ap.add_argument("--windows", type=int, default=16,
                    help="copies of the layout read in turn (16 x 15.7 MiB: not cache-hot); 1 = hot")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = run(args.reps, args.progress_thread, args.windows)
    head = f"{'prompt':6} {'layout':13} {'descs':>6} {'MiB':>7} {'median ms':>10} {'GiB/s':>7}"
    lines = [head] + [
        f"{r['prompt']:6} {r['layout']:13} {r['descriptors']:6d} {r['bytes'] / 2**20:7.2f} "
        f"{r['median_ms']:10.3f} {r['gib_per_s']:7.2f}" for r in rows]
    print("\n".join(lines))
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    meta = {"reps": args.reps, "progress_thread": args.progress_thread, "windows": args.windows,
            "note": "2-core VM shared with other work: provisional numbers"}
    (RESULTS / "nixl_raw.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / "nixl_raw.md").write_text(
        "# Raw NIXL READ bandwidth, two processes, same machine\n\n"
        f"`python benchmarks/nixl_raw.py --windows {args.windows}` ({args.reps} reps, each "
        "reading the next of `windows` copies of the layout so data is not cache-hot when "
        "windows > 1; progress thread "
        f"{'on' if args.progress_thread else 'off'}); provisional (shared 2-core VM).\n\n"
        "```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
