"""Shared helpers for the benchmark scripts.

Pure helpers (no I/O): :func:`percentile`, :func:`summarize`, :class:`SseLineParser`,
:func:`stream_stats`. I/O helpers: :func:`load_average`, :class:`ManagedProcess` (a
server started in its own process group and always stopped by that group), and
:func:`stream_request` / :func:`run_load` (a bounded streaming OpenAI load over aiohttp,
127.0.0.1 only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.common")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


# -- pure helpers -------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / mean / max / n of ``values``."""
    return {
        "n": float(len(values)),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else math.nan,
        "max": max(values) if values else math.nan,
    }


class SseLineParser:
    """Splits a server-sent-event byte stream into ``data:`` payloads.

    Feed it raw bytes as they arrive; each call returns the complete ``data`` payloads
    (bytes, without the ``data: `` prefix) seen so far. Comments and other fields are
    dropped; a multi-line event's data lines are joined with ``\\n`` as the SSE spec says.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out: list[bytes] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            line, self._buf = self._buf[:nl].rstrip(b"\r"), self._buf[nl + 1:]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)


@dataclass
class StreamResult:
    """One streamed request: arrival times (seconds since send) of the text chunks."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    end: float = 0.0
    error: str | None = None
    finish_reason: str | None = None
    done: bool = False
    """The stream ended with ``[DONE]`` (not cut off)."""

    @property
    def truncated(self) -> bool:
        """No error reported, yet the stream ended without a finish reason or ``[DONE]``."""
        return self.error is None and (self.finish_reason is None or not self.done)


def stream_stats(results: Sequence[StreamResult], wall_s: float) -> dict[str, Any]:
    """TTFT / ITL / TPOT distributions (ms) and output tokens/s over ``wall_s``.

    ITL is the gap between successive text chunks as read (chunks that arrive in one
    read count as 0 ms apart); TPOT is per request (last chunk - first chunk) /
    (completion tokens - 1), which does not depend on how reads coalesce.
    """
    ok = [r for r in results if r.error is None and r.chunk_times]
    ttft = [r.chunk_times[0] * 1000.0 for r in ok]
    itl = [(b - a) * 1000.0 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) * 1000.0 / (r.completion_tokens - 1)
            for r in ok if r.completion_tokens > 1]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "ttft_ms": summarize(ttft),
        "itl_ms": summarize(itl),
        "tpot_ms": summarize(tpot),
    }


def chunk_text(payload: dict[str, Any]) -> str | None:
    """The text delta of one completion / chat chunk, or None if it has no choice."""
    choices = payload.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "text" in c:
        return str(c["text"] or "")
    delta = c.get("delta") or {}
    return str(delta.get("content") or "")


# -- environment --------------------------------------------------------------------------

def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": load_average(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_line(command: str, machine: dict[str, Any], *, python: bool = False) -> str:
    """A report's opening: the command, when it ran and on what (``machine_info``), without
    the closing full stop: `` `cmd` at T, [Python V, ]N CPUs, 1-min load average L at
    start``."""
    py = f"Python {machine['python']}, " if python else ""
    return (f"`{command}` at {machine['at']}, {py}{machine['cpus']} CPUs, "
            f"1-min load average {machine['loadavg_1m']:.2f} at start")


# -- processes ----------------------------------------------------------------------------

READY_BANNER = re.compile(r"dynamo serve: graph \S+ ready in ([0-9.]+)s")
"""``dynamo serve``'s ready banner; group 1: the seconds it says it took."""


def serve_command(graph: str, config: str, port: int, model_dir: Path,
                  *args: str) -> list[str]:
    """``dynamo serve graphs.<graph>:Frontend -f configs/<config>.yaml`` on ``port`` and
    ``model_dir``, with ``args`` (``--Component.key=value``) after."""
    return [sys.executable, "-m", "dynagraph.cli.main", "serve", f"graphs.{graph}:Frontend",
            "-f", f"configs/{config}.yaml", f"--Frontend.port={port}",
            f"--Common.model={model_dir}", *args]


def infra_env(infra: Any) -> dict[str, str]:
    """This process's environment for a graph using ``local_infra()``'s etcd and NATS."""
    return {**os.environ, "ETCD_ENDPOINTS": infra["etcd"].url,
            "NATS_SERVER": infra["nats"].url, "PYTHONUNBUFFERED": "1"}


class ManagedProcess:
    """A server in its own session (process group); its output is kept in ``lines``.

    :meth:`stop` sends SIGTERM to the whole group, then SIGKILL after ``timeout``, so
    children it spawned (vLLM's engine core, component processes) go too.
    """

    def __init__(self, args: list[str], env: dict[str, str], *, cwd: Path = REPO,
                 name: str = "server", own_tmpdir: bool = False) -> None:
        self.name = name
        # own_tmpdir: a TMPDIR of its own, removed by stop() (vLLM's server leaves its IPC
        # sockets and a vllm_dist_* file in /tmp when it is stopped)
        self.tmpdir = tempfile.mkdtemp(prefix="bench-tmp-") if own_tmpdir else None
        if self.tmpdir is not None:
            env = {**env, "TMPDIR": self.tmpdir}
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.line_times: list[float] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.line_times.append(time.monotonic())
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def output(self, tail: int = 40) -> str:
        """The last ``tail`` lines, preceded by earlier lines that mention an error."""
        early = [s for s in self.lines[:-tail] if "Error" in s or "ERROR" in s][-20:]
        return "\n".join([*early, *(["..."] if early else []), *self.lines[-tail:]])

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> tuple[str, float]:
        """The first line matching ``predicate`` and when it was read (monotonic)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            n = len(self.lines)
            for i in range(seen, n):
                if predicate(self.lines[i]):
                    return self.lines[i], self.line_times[i]
            seen = n
            if self.proc.poll() is not None and len(self.lines) == seen:
                self._reader.join(timeout=1)
                if len(self.lines) == seen:
                    break
            time.sleep(0.005)
        code = self.proc.poll()
        why = f"exited with code {code}" if code is not None else f"no line after {timeout:.0f}s"
        raise TimeoutError(f"{self.name}: expected line not seen ({why}); "
                           f"last output:\n{self.output()}")

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM, *,
             leader_only: bool = False) -> tuple[int | None, float]:
        """Signal the group (or only its leader, as ``kill PID`` would), wait for the
        leader; SIGKILL the whole group afterwards in any case.

        Returns (exit code, seconds from the signal to the leader's exit).
        """
        t0 = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if leader_only:
                    os.kill(self.pid, sig)
                else:
                    os.killpg(self.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored signal %d for %.0fs: SIGKILL", self.name,
                            self.pid, sig, timeout)
        took = time.monotonic() - t0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # stragglers left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.proc.returncode, took


def process_tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``pid`` and its descendants, keyed by 'name:pid'."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            out[f"{_proc_label(p)}:{p.pid}"] = t.user + t.system
    return out


def _proc_label(p: Any) -> str:
    cmd = [str(a) for a in p.cmdline()]
    if "--component" in cmd:
        return cmd[cmd.index("--component") + 1]
    name = str(p.name())
    return name if name not in ("python", "python3", "python3.11") else os.path.basename(
        next((a for a in cmd[1:] if not a.startswith("-")), name))


def wait_quiet(pids: Sequence[int], *, window: float = 0.5, max_cpu: float = 0.05,
               timeout: float = 10.0) -> float:
    """Wait until the process trees of ``pids`` together use < ``max_cpu`` CPU seconds
    in one ``window`` (vLLM's CPU worker keeps spinning a while after work). Returns the
    seconds waited (``timeout`` if they never went quiet)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        before = [process_tree_cpu(p) for p in pids]
        time.sleep(window)
        used = sum(sum(cpu_delta(b, process_tree_cpu(p)).values()) for b, p in zip(before, pids,
                                                                                   strict=True))
        if used < max_cpu:
            break
    return time.monotonic() - t0


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in after}


# -- load generation ----------------------------------------------------------------------

async def stream_request(session: Any, url: str, body: dict[str, Any],
                         time_limit: float) -> StreamResult:
    """POST one streaming request; record when each non-empty text chunk arrives."""
    import aiohttp

    res = StreamResult(start=time.perf_counter())
    parser = SseLineParser()
    usage_tokens: int | None = None
    chunks = 0
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=time_limit)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                res.end = time.perf_counter() - res.start
                return res
            async for raw in resp.content.iter_any():
                now = time.perf_counter() - res.start
                for data in parser.feed(raw):
                    if data == b"[DONE]":
                        res.done = True
                        continue
                    payload = json.loads(data)
                    if "error" in payload:
                        res.error = str(payload["error"])[:200]
                        continue
                    if payload.get("usage"):
                        usage_tokens = int(payload["usage"]["completion_tokens"])
                    for choice in payload.get("choices") or ():
                        if choice.get("finish_reason"):
                            res.finish_reason = str(choice["finish_reason"])
                    text = chunk_text(payload)
                    if text:
                        res.chunk_times.append(now)
                        chunks += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter() - res.start
    res.completion_tokens = usage_tokens if usage_tokens is not None else chunks
    return res


async def run_load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int, *,
                   request_timeout: float = 120.0, total_timeout: float = 600.0
                   ) -> dict[str, Any]:
    """Send ``bodies`` with at most ``concurrency`` in flight; return :func:`stream_stats`."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)

    async def one(session: Any, body: dict[str, Any]) -> StreamResult:
        async with sem:
            return await stream_request(session, url, body, request_timeout)

    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one(session, b) for b in bodies)), total_timeout)
        wall = time.perf_counter() - t0
    return stream_stats(results, wall)


def completion_ttft(url: str, prompt: str, timeout: float = 300.0) -> tuple[float, int]:
    """Stream a 4-token completion of ``prompt``: (seconds to the first token, prompt tokens)."""
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = 0.0
    tokens = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - test servers
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            # the first token's chunk, even when its text is empty (the detokenizer holds
            # back an incomplete character; the tiny model makes such tokens)
            if not first and msg.get("choices"):
                first = time.perf_counter() - t0
            if msg.get("usage"):
                tokens = int(msg["usage"]["prompt_tokens"])
    return first, tokens


def markdown_table(cols: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
    """A markdown table of ``rows`` (dicts) in the order of ``cols``; absent cells are blank."""
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return table + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]


def publish(name: str, data: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """Write ``data`` (with the machine's description) and its markdown; print both paths."""
    data.setdefault("machine", machine_info())
    text = markdown(data)
    jpath, mpath = write_results(name, data, text)
    print(text)
    print(f"wrote {jpath} and {mpath}")


def write_results(name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    jpath, mpath = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    jpath.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    mpath.write_text(markdown)
    return jpath, mpath
