"""KV transfers as served: `dynamo serve graphs.disagg` on the tiny model, per request.

Where ``benchmarks/disagg.py`` drives two engines from one process to break a request
down, this serves the disagg graph exactly as a user does (components in their own
processes, each engine one vLLM engine-core process, NIXL as configured) and reads each remote prefill's KV
transfer from the decode worker's own metrics (``dynamo_worker_kv_transfer_seconds`` and
``..._bytes_total``, scraped before and after every request), with the TTFT the HTTP
client sees (streamed completion). Prompts are fresh (no prefix-cache hits); the first
request of each size is a warm-up (NIXL handshake and connection wire-up).

``--transports nixl,shm,tier,tier:int8`` serves the graph once per transport. ``shm``
(``kv-transport: shm``, ``dynagraph.llm.kv.transfer.shm_direct``): both engines' KV caches in
shared memory, the decode engine copies the prefill engine's blocks (read from the same
metrics as NIXL's). ``tier`` (``kv-transport: tier``, ``dynagraph.llm.kv.transfer.tier_handoff``):
decode and prefill worker share a KV tier on /dev/shm, and the decode worker's transfer is
what it reads: tier -> pool (``dynamo_worker_kv_tier_read_*``) plus pool -> engine
(``dynamo_worker_kv_pool_load_seconds_total``, ``..._loaded_bytes_total``); the prefill
side's write-through happens before the hand-off and is in the TTFT only; ``tier:CODEC``
stores the blocks compressed (``kv-compression``), so they move compressed (``kv_bytes``
is then the encoded size). ``nixl:CODEC``: NIXL with the KV encoded on the wire
(``kv-transfer-compression``; ``kv_bytes`` the encoded size, the transfer's time includes
the decode; the prefill side's encode is in the TTFT only). Each size's
memcpy of the same bytes (numpy, this process) is measured in the same run, and so is a
raw NIXL READ of them between two idle processes (``benchmarks/nixl_raw.py``; ``--raw-from
file`` reads its stored result instead).

etcd and NATS are started by this process (``--infra local``, the default), outside
``dynamo serve``'s core keeper, so they may run on the engines' core. ``--infra serve``
leaves them to ``dynamo serve`` (its children, as the README's first command starts them,
kept off the engines' core with the rest of the graph). In four interleaved runs
(``benchmarks/results/disagg_served_infra_ab.md``) that changed nothing for ``shm`` and
1k-token NIXL transfers but made 4k-token NIXL transfers 3x slower (not understood).

A transport may carry settings after ``@``, for an A/B of a setting in one run (same hour,
same machine state): a VllmWorker key (``nixl@nixl-settle-us=0``), or a key of another
component named with it (``nixl@PrefillWorker.engine-nice=0``); several are joined by ``@``.

    python benchmarks/disagg_served.py --requests 8 [--transports nixl,shm,tier]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as bench  # noqa: E402
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tests.support.metrics import scrape as metrics_text  # noqa: E402
from tests.support.metrics import total  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

SENTENCE = "Prefix caches pay off when prompts share a beginning. "
SIZES = {"1k": 46, "4k": 180}  # sentences: ~1k and ~3.9k tokens of the tiny model
SERIES = ("dynamo_worker_kv_transfer_seconds_sum", "dynamo_worker_kv_transfer_bytes_total",
          "dynamo_worker_kv_transfers_total")
SHM_SERIES = ("dynamo_worker_kv_tier_read_seconds_total", "dynamo_worker_kv_pool_load_seconds_total",
              "dynamo_worker_kv_pool_loaded_bytes_total", "dynamo_worker_kv_tier_hit_tokens_total")


PREFILL_LINE = re.compile(r"prefill \S+: handed-off \(queue wait ([\d.]+)s, prefill ([\d.]+)s, "
                          r"hand-off ([\d.]+)s\)")
"""A prefill worker's log line per job (``dynagraph.llm.disagg.prefill``); with ``shm`` its
prefill includes the wait for the prompt's blocks to reach the tier."""


def scrape(address: str) -> dict[str, float]:
    """The KV-transfer series of one worker, summed over their label sets."""
    text = metrics_text(address)
    return {name: total(text, name) for name in (*SERIES, *SHM_SERIES)}


def as_transfer(transport: str, moved: dict[str, float]) -> tuple[float, float, float]:
    """(transfers, seconds, bytes) of one request's KV hand-off, read on the decode side."""
    if transport.startswith("tier"):
        seconds = moved[SHM_SERIES[0]] + moved[SHM_SERIES[1]]
        return float(moved[SHM_SERIES[3]] > 0), seconds, moved[SHM_SERIES[2]]
    return moved[SERIES[2]], moved[SERIES[0]], moved[SERIES[1]]


def memcpy_gib_per_s(nbytes: int, repeats: int = 20, cold: bool = False) -> float:
    """numpy's copy of ``nbytes``: the same two buffers again and again (``cold=False``:
    at 2 MiB they stay in the CPU's caches), or a fresh pair each time from 256 MiB of
    touched memory (``cold``: the bytes come from memory, as a KV transfer's do)."""
    import numpy as np

    n = max(nbytes, 1)
    pairs = 1 if not cold else max(1, (256 << 20) // (2 * n))
    src = np.ones(n * pairs, dtype=np.uint8)
    dst = np.zeros_like(src)
    times = []
    for i in range(repeats):
        k = (i % pairs) * n
        began = time.perf_counter()
        np.copyto(dst[k:k + n], src[k:k + n])
        times.append(time.perf_counter() - began)
    return nbytes / statistics.median(times) / 2**30


COMPONENTS = ("Common", "Frontend", "Processor", "VllmWorker", "PrefillWorker")


def setting_override(setting: str) -> str:
    """``key=value`` as the VllmWorker's override; ``Component.key=value`` as that
    component's (pure)."""
    head = setting.split(".", 1)[0]
    return setting if head in COMPONENTS else f"VllmWorker.{setting}"


def split_transport(transport: str) -> tuple[str, list[str]]:
    """``nixl@key=value@Component.key=value``: the transport and its settings as
    ``dynamo serve`` overrides (pure)."""
    spec, *settings = transport.split("@")
    return spec, [f"--{setting_override(kv)}" for kv in settings]


@contextlib.contextmanager
def graph_infra(infra: str) -> Iterator[dict[str, str]]:
    """The graph's environment: ``serve`` leaves etcd and NATS to ``dynamo serve`` (it
    starts them as its children when none is configured, as the README's first command
    does, and its core keeper keeps them off the engines' cores with the rest of the
    graph); ``local`` starts them here, outside the keeper's reach."""
    if infra == "local":
        with local_infra(etcd=True, nats=True) as services:
            yield bench.infra_env(services)
        return
    yield {**{k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")},
           "PYTHONUNBUFFERED": "1"}


def run(requests: int, transport: str = "nixl", infra: str = "local") -> list[dict[str, Any]]:
    model_dir = ensure_model(bench.REPO / "models" / "tiny-llama")
    port = free_port()
    rows: list[dict[str, Any]] = []
    with graph_infra(infra) as env:
        cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", "graphs.disagg:Frontend",
               "-f", "configs/disagg.yaml", f"--Frontend.port={port}", f"--Common.model={model_dir}"]
        spec, overrides = split_transport(transport)
        cmd += overrides
        tier = None
        if spec.startswith("tier"):  # tier or tier:CODEC (the blocks move compressed)
            tier = tempfile.mkdtemp(prefix="disagg-served-kv-", dir="/dev/shm")
            codec = spec.partition(":")[2] or "none"
            cmd += [f"--{c}.{k}" for c in ("VllmWorker", "PrefillWorker") for k in (
                "kv-offload-gib=0.2", f"kv-offload-dir={tier}", "kv-transport=tier",
                f"kv-compression={codec}")]
        else:  # nixl, nixl:CODEC or shm (the shipped config says auto)
            kind, _, codec = spec.partition(":")
            cmd += [f"--{c}.{k}" for c in ("VllmWorker", "PrefillWorker") for k in (
                f"kv-transport={kind}", f"kv-transfer-compression={codec or 'none'}")]
        server = bench.ManagedProcess(cmd, env, name=f"disagg-{transport}")
        try:
            banner, _ = server.wait_line(lambda s: "VllmWorker[0] pid=" in s, 300)
            m = re.search(r"metrics=(\S+)", banner)
            if m is None:
                raise RuntimeError(f"no metrics address in {banner!r}")
            url = f"http://127.0.0.1:{port}"
            for label, sentences in SIZES.items():
                for i in range(requests + 1):
                    before = scrape(m.group(1))
                    prompt = f"Served check {label} {i} {time.time()}. " + SENTENCE * sentences
                    first, tokens = bench.completion_ttft(url, prompt)
                    after = before
                    deadline = time.monotonic() + 5
                    count = SHM_SERIES[3] if transport.startswith("tier") else SERIES[2]
                    while after[count] == before[count] and time.monotonic() < deadline:
                        time.sleep(0.02)  # the engine reports a transfer after its step
                        after = scrape(m.group(1))
                    moved = {k: after[k] - before[k] for k in after}
                    transfers, seconds, nbytes = as_transfer(transport, moved)
                    rows.append({"transport": transport, "prompt": label, "tokens": tokens,
                                 "tier_read_ms": moved[SHM_SERIES[0]] * 1e3,
                                 "pool_load_ms": moved[SHM_SERIES[1]] * 1e3,
                                 "warmup": i == 0, "transfers": transfers, "kv_bytes": nbytes,
                                 "kv_transfer_ms": seconds * 1e3, "ttft_ms": first * 1e3,
                                 "gib_per_s": nbytes / seconds / 2**30 if seconds > 0 else 0.0})
            # the prefill worker's own account of each job (its log line), in request order
            jobs = PREFILL_LINE.findall("\n".join(server.lines))
            if len(jobs) == len(rows):
                for r, (_, prefill, hand_off) in zip(rows, jobs, strict=True):
                    r["prefill_ms"], r["hand_off_ms"] = float(prefill) * 1e3, float(hand_off) * 1e3
        finally:
            server.stop()
            if tier is not None:
                shutil.rmtree(tier, ignore_errors=True)
    return rows


def summarize(rows: list[dict[str, Any]], raw: dict[str, float],
              transport: str = "nixl") -> list[dict[str, Any]]:
    out = []
    for label in SIZES:
        rs = [r for r in rows if r["prompt"] == label and not r["warmup"] and r["transfers"] > 0
              and r.get("transport", "nixl") == transport]
        if not rs:
            out.append({"transport": transport, "prompt": label, "requests": 0})
            continue
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("tokens", "kv_bytes", "kv_transfer_ms", "gib_per_s", "ttft_ms",
                         "tier_read_ms", "pool_load_ms", "prefill_ms", "hand_off_ms")
               if all(k in r for r in rs)}
        memcpy = memcpy_gib_per_s(int(med["kv_bytes"]))
        cold = memcpy_gib_per_s(int(med["kv_bytes"]), cold=True)
        out.append({"transport": transport, "prompt": label, "requests": len(rs),
                    **{k: round(v, 3) for k, v in med.items()},
                    "kv_transfer_ms_min": round(min(r["kv_transfer_ms"] for r in rs), 3),
                    "raw_nixl_gib_per_s": raw.get(label),
                    "ratio_to_raw": round(med["gib_per_s"] / raw[label], 3) if raw.get(label) else None,
                    "memcpy_gib_per_s": round(memcpy, 2),
                    "ratio_to_memcpy": round(med["gib_per_s"] / memcpy, 3),
                    "cold_memcpy_gib_per_s": round(cold, 2),
                    "ratio_to_cold_memcpy": round(med["gib_per_s"] / cold, 3)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--transports", default="nixl",
                    help="comma-separated: nixl, nixl:CODEC (e.g. nixl:int8), shm, tier, "
                         "tier:CODEC")
    ap.add_argument("--name", default="disagg_served")
    ap.add_argument("--infra", choices=["serve", "local"], default="local",
                    help="etcd and NATS started by dynamo serve (kept off the engines' cores "
                         "with the graph) or by this script (outside the keeper's reach)")
    ap.add_argument("--raw-from", choices=["run", "file"], default="run",
                    help="raw NIXL reference: measured in this run (benchmarks/nixl_raw.py's "
                         "kv-blocks layout) or read from benchmarks/results/nixl_raw.json")
    args = ap.parse_args()
    transports = args.transports.split(",")
    rows = [r for t in transports for r in run(args.requests, t, args.infra)]
    if args.raw_from == "run":  # raw NIXL READs (cold buffers) between two idle processes
        from benchmarks import nixl_raw

        raw_rows = nixl_raw.run(reps=50, progress_thread=False, windows=16)
    else:
        raw_path = bench.REPO / "benchmarks" / "results" / "nixl_raw.json"
        raw_rows = json.loads(raw_path.read_text())["rows"] if raw_path.exists() else []
    raw = {r["prompt"]: r["gib_per_s"] for r in raw_rows if r["layout"] == "kv-blocks"}
    summary = [s for t in transports for s in summarize(rows, raw, t)]
    cols = ["transport", "prompt", "requests", "tokens", "kv_bytes", "kv_transfer_ms",
            "kv_transfer_ms_min", "gib_per_s", "raw_nixl_gib_per_s", "ratio_to_raw",
            "memcpy_gib_per_s", "ratio_to_memcpy", "cold_memcpy_gib_per_s",
            "ratio_to_cold_memcpy", "tier_read_ms", "pool_load_ms", "prefill_ms",
            "hand_off_ms", "ttft_ms"]
    table = bench.markdown_table(cols, summary)
    text = ("# KV transfers as served (graphs.disagg), medians\n\n"
            f"`python benchmarks/disagg_served.py --requests {args.requests} --transports "
            f"{args.transports}`"
            + (" --raw-from file" if args.raw_from == "file" else "")
            + (" --infra serve" if args.infra == "serve" else "") + ": `dynamo serve "
            "graphs.disagg` with configs/disagg.yaml on the tiny model; transfer time and bytes "
            "from the decode worker's `dynamo_worker_kv_transfer_*` metrics per request; TTFT "
            "as the HTTP client sees it (streamed, 4 tokens). Raw NIXL: "
            "`benchmarks/nixl_raw.py`, kv-blocks layout, "
            + ("in this run" if args.raw_from == "run" else "from its stored result") + ". "
            "shm: the decode engine's copy from the "
            "prefill engine's shared KV cache; tier: the decode worker's tier read "
            "plus pool load (see the script's doc); memcpy: numpy, same bytes, same run, the "
            "same buffers each time (cache-resident at 1k) and cold (fresh buffers each time). "
            "Provisional: shared 2-core VM.\n\n"
            + "\n".join(table) + "\n")
    data = {"summary": summary, "rows": rows, "machine": bench.machine_info()}
    bench.write_results(args.name, data, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
