"""Request-plane benchmark: round trip and stream throughput between two processes.

    python benchmarks/request_plane.py [--calls 5000] [--items 500000] [--loop both]
                                       [--fan-out 64] [--steps 2000]

A server process (multiprocessing, spawn) serves an ``RpcServer`` and, on a second
port, a bare asyncio TCP server speaking length-prefixed msgpack frames with no RPC
layer (the floor). The parent measures, for each:

  (a) sequential one-response calls: round-trip p50 / p99 in microseconds;
  (b) one stream of N small items ({"i": n}): items per second;
  (c) RPC only: one-response calls from 32 concurrent tasks (sharing one connection);
  (d) RPC only, the shape of a decode worker's output: ``--fan-out`` streams fed in
      lockstep, one ~100-byte item each per 1 ms step (an engine step), for ``--steps``
      steps: CPU microseconds per item in the callee and in the caller process.

Everything binds to 127.0.0.1. Prints a table and writes
benchmarks/results/request_plane.json and .md. Targets (issue 2): p50 <= 100 us,
>= 200,000 items/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer  # noqa: E402
from dynagraph.runtime.rpc._framing import FrameDecoder  # noqa: E402

log = logging.getLogger("bench.request_plane")
RESULTS = Path(__file__).resolve().parent / "results"
_LEN = struct.Struct(">I")
TARGET_P50_US = 100.0
TARGET_ITEMS_PER_S = 200_000
CONCURRENCY = 32


def _frame(body: Any) -> bytes:
    data = msgpack.packb(body)
    return _LEN.pack(len(data)) + data


# -- the bare floor: asyncio.Protocol + msgpack frames, no RPC layer ---------------------

class _BareServer(asyncio.Protocol):
    """Answers [0, n]: with one [1, 0] frame if n == 0, else n [1, {"i": k}] frames + [2]."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.decoder = FrameDecoder(1 << 20)
        self.resumed: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (frame := self.decoder.next()) is not None:
            n = frame[1]
            if n == 0:
                self.transport.write(_frame((1, 0)))
            else:
                asyncio.get_running_loop().create_task(self._stream(n))

    async def _stream(self, n: int) -> None:
        pack = msgpack.Packer().pack
        out = bytearray()
        for k in range(n):
            data = pack((1, {"i": k}))
            out += _LEN.pack(len(data))
            out += data
            if len(out) >= 65536:
                self.transport.write(bytes(out))
                out.clear()
                if self.resumed is not None:
                    await self.resumed
        out += _frame((2,))
        self.transport.write(bytes(out))

    def pause_writing(self) -> None:
        self.resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resumed is not None:
            self.resumed.set_result(None)
            self.resumed = None


class _BareClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = FrameDecoder(1 << 20)
        self.done: asyncio.Future[int] | None = None
        self.count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (frame := self.decoder.next()) is not None:
            if frame[0] == 1:
                self.count += 1
            if frame[0] == 2 or self.count == self.expect:
                assert self.done is not None
                self.done.set_result(self.count)

    async def request(self, n: int, expect: int) -> int:
        self.count, self.expect = 0, expect
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(_frame((0, n)))
        return await asyncio.wait_for(self.done, 60)


# -- the server process ------------------------------------------------------------------

async def _one(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    yield 0


async def _many(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    for k in range(payload):
        yield {"i": k}


STEP_S = 0.001
"""The fan-out's step: every stream gets one item per step."""


class _Steps:
    """A clock of steps: ``await steps.next()`` returns at the next one."""

    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        await self._next

    async def run(self) -> None:
        while True:
            await asyncio.sleep(STEP_S)
            if self._next is not None:
                self._next.set_result(None)
                self._next = None


_STEPS = _Steps()


async def _stepped(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
    """``payload`` items, one per step: a token chunk of a decode worker's size."""
    for k in range(payload):
        await _STEPS.next()
        yield {"token_ids": [k], "text": " token", "finish_reason": None,
               "cum_logprob": None, "index": 0, "usage": None, "request_id": ctx.request_id}


async def _cpu(payload: Any, ctx: RequestContext) -> AsyncIterator[float]:
    yield time.process_time()


async def _serve(conn: Any) -> None:
    server = RpcServer()
    server.add_endpoint("one", _one)
    server.add_endpoint("many", _many)
    server.add_endpoint("stepped", _stepped)
    server.add_endpoint("cpu", _cpu)
    steps = asyncio.get_running_loop().create_task(_STEPS.run())
    await server.start()
    loop = asyncio.get_running_loop()
    bare = await loop.create_server(_BareServer, "127.0.0.1", 0)
    bare_port = bare.sockets[0].getsockname()[1]
    conn.send((server.address, f"127.0.0.1:{bare_port}"))
    await loop.run_in_executor(None, conn.recv)  # parent says stop
    bare.close()
    steps.cancel()
    await server.stop(grace=1.0)


def _server_main(conn: Any, use_uvloop: bool) -> None:
    _run(_serve(conn), use_uvloop)


def _run(coro: Any, use_uvloop: bool) -> Any:
    if use_uvloop:
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


# -- measurements ------------------------------------------------------------------------

def _percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    n = len(samples)
    return {"p50_us": round(samples[n // 2] * 1e6, 1),
            "p99_us": round(samples[min(n - 1, int(n * 0.99))] * 1e6, 1),
            "mean_us": round(statistics.fmean(samples) * 1e6, 1)}


async def _timed_calls(call: Callable[[], Any], calls: int) -> dict[str, float]:
    for _ in range(min(500, calls)):
        await call()
    samples = []
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        await call()
        samples.append(clock() - t0)
    return _percentiles(samples)


async def _measure(rpc_addr: str, bare_addr: str, calls: int, items: int,
                   fan_out: int, steps: int) -> dict[str, Any]:
    client = RpcClient()

    async def rpc_one() -> None:
        async for _ in client.call(rpc_addr, "one", None):
            pass

    async def rpc_stream(n: int) -> int:
        count = 0
        async for _ in client.call(rpc_addr, "many", n):
            count += 1
        return count

    host, port = bare_addr.rsplit(":", 1)
    _, bare = await asyncio.get_running_loop().create_connection(_BareClient, host, int(port))

    result: dict[str, Any] = {}
    result["rpc_round_trip"] = await _timed_calls(rpc_one, calls)
    result["bare_round_trip"] = await _timed_calls(lambda: bare.request(0, 1), calls)
    await rpc_stream(10_000)
    t0 = time.perf_counter()
    got = await rpc_stream(items)
    elapsed = time.perf_counter() - t0
    assert got == items, (got, items)
    result["rpc_stream"] = {"items": items, "seconds": round(elapsed, 3),
                            "items_per_s": round(items / elapsed)}
    t0 = time.perf_counter()
    got = await bare.request(items, items + 1)
    elapsed = time.perf_counter() - t0
    assert got == items, (got, items)
    result["bare_stream"] = {"items": items, "seconds": round(elapsed, 3),
                             "items_per_s": round(items / elapsed)}
    bare.transport.close()
    result["rpc_concurrent"] = await _concurrent(rpc_one, CONCURRENCY, calls)
    result["rpc_fan_out"] = await _fan_out(client, rpc_addr, fan_out, steps)
    await client.close()
    return result


async def _fan_out(client: RpcClient, address: str, streams: int, steps: int
                   ) -> dict[str, Any]:
    """``streams`` streams of ``steps`` items each, fed in lockstep (see ``_stepped``)."""
    async def server_cpu() -> float:
        [cpu] = [c async for c in client.call(address, "cpu", None)]
        return float(cpu)

    async def drain(n: int) -> int:
        return sum([1 async for _ in client.call(address, "stepped", n)])

    await asyncio.gather(*(drain(20) for _ in range(streams)))  # warm
    server0, client0, t0 = await server_cpu(), time.process_time(), time.perf_counter()
    got = await asyncio.gather(*(drain(steps) for _ in range(streams)))
    elapsed = time.perf_counter() - t0
    client_cpu, server1 = time.process_time() - client0, await server_cpu()
    items = sum(got)
    assert items == streams * steps, (items, streams * steps)
    return {"streams": streams, "steps": steps, "seconds": round(elapsed, 3),
            "server_us_per_item": round((server1 - server0) / items * 1e6, 2),
            "client_us_per_item": round(client_cpu / items * 1e6, 2)}


async def _concurrent(call: Callable[[], Any], tasks: int, calls: int) -> dict[str, Any]:
    """``tasks`` tasks each making sequential calls until ``calls`` are done in total."""
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    await asyncio.gather(*(worker() for _ in range(tasks)))  # warm the pool
    left = calls
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    elapsed = time.perf_counter() - t0
    return {"tasks": tasks, "calls": calls, "calls_per_s": round(calls / elapsed)}


def run_one(loop_kind: str, calls: int, items: int, fan_out: int, steps: int
            ) -> dict[str, Any]:
    use_uvloop = loop_kind == "uvloop"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_main, args=(child, use_uvloop), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise TimeoutError("benchmark server did not report its address within 30 s")
        rpc_addr, bare_addr = parent.recv()
        result: dict[str, Any] = _run(
            _measure(rpc_addr, bare_addr, calls, items, fan_out, steps), use_uvloop)
        parent.send("stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    result["loop"] = loop_kind
    return result


def _median_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median over repeated runs; the raw runs are kept under ``samples``."""
    merged: dict[str, Any] = {"loop": samples[0]["loop"], "repeat": len(samples)}
    for key, value in samples[0].items():
        if isinstance(value, dict):
            merged[key] = {k: round(statistics.median(s[key][k] for s in samples), 2)
                           for k in value}
    merged["samples"] = samples
    return merged


def _table(runs: list[dict[str, Any]]) -> str:
    lines = ["| loop | what | RPC | bare floor | target |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        rt, brt = r["rpc_round_trip"], r["bare_round_trip"]
        lines.append(f"| {r['loop']} | one-response round trip p50 | {rt['p50_us']} us | "
                     f"{brt['p50_us']} us | <= {TARGET_P50_US:.0f} us |")
        lines.append(f"| {r['loop']} | one-response round trip p99 | {rt['p99_us']} us | "
                     f"{brt['p99_us']} us | |")
        lines.append(f"| {r['loop']} | one stream, items/s | {r['rpc_stream']['items_per_s']:,} | "
                     f"{r['bare_stream']['items_per_s']:,} | >= {TARGET_ITEMS_PER_S:,} |")
        lines.append(f"| {r['loop']} | {r['rpc_concurrent']['tasks']} concurrent callers, "
                     f"calls/s | {r['rpc_concurrent']['calls_per_s']:,} | | |")
        fan = r["rpc_fan_out"]
        lines.append(f"| {r['loop']} | {fan['streams']} streams in lockstep, CPU us per item: "
                     f"callee / caller | {fan['server_us_per_item']} / "
                     f"{fan['client_us_per_item']} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--items", type=int, default=500_000)
    parser.add_argument("--fan-out", type=int, default=64,
                        help="streams fed in lockstep, one item per step each (d)")
    parser.add_argument("--steps", type=int, default=2000, help="items per fan-out stream")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per loop kind (fresh server process each); medians are reported")
    parser.add_argument("--no-write", action="store_true", help="do not write result files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kinds = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    if "uvloop" in kinds:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            log.warning("uvloop is not installed; measuring the asyncio loop only")
            kinds.remove("uvloop")
    runs = []
    for kind in kinds:
        samples = [run_one(kind, args.calls, args.items, args.fan_out, args.steps)
                   for _ in range(args.repeat)]
        runs.append(_median_run(samples))
    table = _table(runs)
    sys.stdout.write(table + "\n")
    if args.no_write:
        return
    meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "calls": args.calls,
            "items": args.items, "fan_out": args.fan_out, "steps": args.steps, "note": "provisional: 2-core machine shared with other jobs"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "request_plane.json").write_text(
        json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    (RESULTS / "request_plane.md").write_text(
        "# Request plane benchmark\n\n"
        f"`python benchmarks/request_plane.py` at {meta['when']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs, 1-min load average {meta['load_avg_1m']} "
        f"({meta['note']}).\nServer and client are separate processes on 127.0.0.1; "
        f"{args.calls} sequential calls, one stream of {args.items:,} items `{{\"i\": n}}`; "
        f"{args.fan_out} streams of {args.steps:,} items fed in lockstep (one per 1 ms step); "
        f"each figure is the median of {args.repeat} runs. "
        "'bare floor' is asyncio.Protocol + the same msgpack framing with no RPC layer.\n\n"
        + table + "\n")


if __name__ == "__main__":
    main()
