"""Benchmark: the router's PrefixIndex against NVIDIA Dynamo's Rust RadixTree.

Workload (defaults): 64 workers, each holding exactly 100,000 blocks:
  * one 128-block prefix that every worker holds (the "all share a long prefix" case),
  * 250 of 1,000 shared 16-block prefixes (random per worker),
  * unique conversations: a shared prefix + 4 chained turns of 8 blocks, one
    BlockStored event per turn (parent = the previous turn's last block).

Ours is built twice. As the Router builds it: from what the workers' relays send
(``dynagraph.llm.kv.events.relay``: per worker, one ``RelayBatch`` per vLLM batch of 4 events,
the blocks it newly holds, without parents), applied with ``RelayBatch.apply_to``.
And from vLLM's events themselves, parents included: what a relay that passed the
parents on would give (the index keeps chains together only when it knows them).

Measured for each index:
  * ingest, blocks/s: ours as the Router applies relay batches; ours from vLLM's events,
    twice: ``apply_stored`` on decoded lists, and end to end from vLLM-shaped msgpack
    payloads (4 events a batch, 32 token ids per block, as vLLM sends) through
    ``decode_payload`` (which skips the token ids) + ``apply_events``. Dynamo:
    ``RadixTree.apply_event`` on its JSON events (which carry no token ids), JSON
    parsing included.
  * find_matches p50/p99 (us, call + reading the result) for (a) typical queries
    (a worker's conversation + 4 new blocks) and (b) the 128-block prefix every
    worker holds + 8 new blocks. As in the Router, which hashes each request just
    before it routes it: the query is a list of fresh int objects, made just before
    the timed call; and the cyclic GC runs with its default thresholds (the collections
    during the timed queries are counted).
  * bytes per (worker, block): ours as the Router builds it, by tracemalloc (everything
    the index retains, int keys included); Dynamo by the growth of the process RSS (it
    allocates in Rust).

Run: ``python benchmarks/router_index.py [--rounds 3 --workers 64 --blocks-per-worker
100000]``: each round is a fresh process (the results give every round and the spread).
``ai-dynamo-runtime`` is a benchmark-only dependency; without it only ours is run.
Writes benchmarks/results/router_index.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from dynagraph.llm.kv.events.relay import BlockSet
from dynagraph.llm.router.events import (
    BlocksStored,
    KvEvent,
    RelayBatch,
    apply_events,
    decode_payload,
)
from dynagraph.llm.router.index import PrefixIndex

log = logging.getLogger("bench.router_index")

RESULTS = Path(__file__).parent / "results"
LONG_PREFIX = 128
PREFIX_BLOCKS = 16
TURNS = 4
TURN_BLOCKS = 8
BLOCK_SIZE = 32
EVENTS_PER_BATCH = 4


@dataclass(frozen=True)
class Config:
    """The synthetic fleet: every worker holds the ``LONG_PREFIX`` chain, some of the
    shared ``PREFIX_BLOCKS``-block prefixes, and unique conversations up to its size."""

    workers: int = 64
    blocks_per_worker: int = 100_000
    """Cached blocks each worker reports (the index holds workers x this entries)."""
    shared_prefixes: int = 1_000
    prefixes_per_worker: int = 250
    """How many of the shared prefixes each worker holds (drawn at random)."""
    queries: int = 2_000
    seed: int = 0


@dataclass
class Workload:
    worker_ids: list[int]
    long_prefix: list[int]
    prefixes: list[list[int]]
    sampled: list[tuple[int, list[int]]] = field(default_factory=list)  # (worker, chain)


Event = tuple[int, int | None, list[int]]  # (worker id, parent hash, block hashes)


def make_workload(cfg: Config) -> Workload:
    rng = random.Random(f"{cfg.seed}/workload")
    return Workload(
        worker_ids=[rng.getrandbits(63) for _ in range(cfg.workers)],
        long_prefix=[rng.getrandbits(64) for _ in range(LONG_PREFIX)],
        prefixes=[
            [rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)] for _ in range(cfg.shared_prefixes)
        ],
    )


def worker_events(cfg: Config, wl: Workload, wi: int, sample: bool) -> Iterator[Event]:
    """One worker's BlockStored events, deterministic per (seed, worker)."""
    rng = random.Random(f"{cfg.seed}/worker/{wi}")
    wid = wl.worker_ids[wi]
    yield wid, None, wl.long_prefix
    mine = rng.sample(range(len(wl.prefixes)), cfg.prefixes_per_worker)
    for p in mine:
        yield wid, None, wl.prefixes[p]
    conv_blocks = TURNS * TURN_BLOCKS
    left = cfg.blocks_per_worker - LONG_PREFIX - PREFIX_BLOCKS * len(mine)
    conversations = left // conv_blocks
    sample_every = max(1, conversations * cfg.workers // cfg.queries)
    for c in range(conversations):
        prefix = wl.prefixes[rng.choice(mine)]
        parent = prefix[-1]
        chain = list(prefix)
        for _ in range(TURNS):
            blocks = [rng.getrandbits(64) for _ in range(TURN_BLOCKS)]
            yield wid, parent, blocks
            chain.extend(blocks)
            parent = blocks[-1]
        if sample and c % sample_every == 0:
            wl.sampled.append((wid, chain))
    tail = left - conversations * conv_blocks
    if tail:
        yield wid, None, [rng.getrandbits(64) for _ in range(tail)]


def all_events(cfg: Config, wl: Workload, sample: bool = False) -> Iterator[Event]:
    for wi in range(cfg.workers):
        yield from worker_events(cfg, wl, wi, sample)


def relay_batches(cfg: Config, wl: Workload) -> Iterator[tuple[int, RelayBatch]]:
    """What the workers' relays send the Router: per worker, one batch per
    ``EVENTS_PER_BATCH`` of its events (a vLLM batch), the blocks newly held."""
    for wi in range(cfg.workers):
        held = BlockSet()
        pending: list[KvEvent] = []
        seq = 0
        for wid, parent, blocks in worker_events(cfg, wl, wi, sample=False):
            pending.append(BlocksStored(block_hashes=blocks, parent_hash=parent))
            if len(pending) == EVENTS_PER_BATCH:
                delta = held.apply(pending)
                yield wid, RelayBatch(seq=seq, stored=delta.stored, removed=delta.removed)
                pending = []
                seq += 1
        if pending:
            delta = held.apply(pending)
            yield wl.worker_ids[wi], RelayBatch(seq=seq, stored=delta.stored)


def dynamo_json(event_id: int, parent: int | None, blocks: list[int]) -> bytes:
    return json.dumps(
        {
            "event_id": event_id,
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": h, "tokens_hash": h} for h in blocks],
                }
            },
        }
    ).encode()


def vllm_payloads(events: list[Event], rng: random.Random) -> list[tuple[int, bytes]]:
    """vLLM-shaped KVEventBatch payloads, ``EVENTS_PER_BATCH`` events of one worker each."""
    enc = msgspec.msgpack.Encoder()
    out: list[tuple[int, bytes]] = []
    i = 0
    while i < len(events):
        wid = events[i][0]
        batch: list[dict[str, Any]] = []
        while i < len(events) and len(batch) < EVENTS_PER_BATCH and events[i][0] == wid:
            _, parent, blocks = events[i]
            tokens = BLOCK_SIZE * len(blocks)  # ids < 32k: 3 msgpack bytes each, like real ones
            batch.append(
                {
                    "type": "BlockStored",
                    "block_hashes": blocks,
                    "parent_block_hash": parent,
                    "token_ids": list(range(base := rng.randrange(30_000), base + tokens)),
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                }
            )
            i += 1
        out.append((wid, enc.encode([time.time(), batch, 0])))
    return out


def make_queries(cfg: Config, wl: Workload) -> dict[str, list[array[int]]]:
    """Each query's hashes, to be made into a list of fresh ints just before its call
    (the index's own key objects would let a dict lookup skip comparing them)."""
    rng = random.Random(f"{cfg.seed}/queries")
    typical = [
        array("Q", chain + [rng.getrandbits(64) for _ in range(4)])
        for _, chain in rng.sample(wl.sampled, min(cfg.queries, len(wl.sampled)))
    ]
    shared = [
        array("Q", wl.long_prefix + [rng.getrandbits(64) for _ in range(8)])
        for _ in range(cfg.queries)
    ]
    return {"typical": typical, "all_share_128": shared}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    samples.sort()
    return (
        samples[len(samples) // 2],
        samples[int(len(samples) * 0.99)],
        statistics.fmean(samples),
    )


def latencies_us(
    impls: dict[str, Callable[[list[int]], Any]],
    queries: dict[str, list[array[int]]],
    passes: int = 3,
    gc_runs: list[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """find_matches p50/p99 per (implementation, query set).

    Passes interleave the implementations so that a burst from another job on the
    shared machine hits both alike; the pass with the median p99 is reported and
    every pass's p99 is kept. ``gc_runs`` (per generation) counts the cyclic GC's
    collections during the timed queries.
    """
    per_pass: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    cpu_pass: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for fn in impls.values():
        for qs in queries.values():
            for q in qs[:200]:
                fn(q.tolist())
    gc.collect()
    counts = gc_runs if gc_runs is not None else [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    gc.callbacks.append(count)
    try:
        timed(impls, queries, passes, per_pass, cpu_pass)
    finally:
        gc.callbacks.remove(count)
    out: dict[str, dict[str, Any]] = {impl: {} for impl in impls}
    for key, rs in per_pass.items():
        impl, qname = key
        p50, p99, mean = sorted(rs, key=lambda r: r[1])[len(rs) // 2]
        c50, c99, _ = sorted(cpu_pass[key], key=lambda r: r[1])[len(rs) // 2]
        out[impl][qname] = {
            "p50_us": round(p50, 2),
            "p99_us": round(p99, 2),
            "mean_us": round(mean, 2),
            "p99_us_passes": [round(r[1], 2) for r in rs],
            "cpu_p50_us": round(c50, 2),
            "cpu_p99_us": round(c99, 2),
        }
    return out


def timed(
    impls: dict[str, Callable[[list[int]], Any]],
    queries: dict[str, list[array[int]]],
    passes: int,
    per_pass: dict[tuple[str, str], list[tuple[float, float, float]]],
    cpu_pass: dict[tuple[str, str], list[tuple[float, float, float]]],
) -> None:
    clock, cpu = time.perf_counter_ns, time.process_time_ns
    for _ in range(passes):
        for impl, fn in impls.items():
            for qname, qs in queries.items():
                wall: list[float] = []
                busy: list[float] = []
                for qa in qs:
                    q = qa.tolist()  # fresh, as the Router's hasher makes them
                    c0 = cpu()
                    t0 = clock()
                    fn(q)
                    t1 = clock()
                    busy.append((cpu() - c0) / 1000)
                    wall.append((t1 - t0) / 1000)
                per_pass.setdefault((impl, qname), []).append(_percentiles(wall))
                cpu_pass.setdefault((impl, qname), []).append(_percentiles(busy))


def build_router(cfg: Config, wl: Workload, res: dict[str, Any]) -> PrefixIndex:
    """Ours as the Router builds it, from the relays' batches (made beforehand)."""
    batches = list(relay_batches(cfg, wl))
    entries = sum(len(b.stored) for _, b in batches)
    gc.disable()
    try:
        idx = PrefixIndex()
        c0, t0 = time.process_time(), time.perf_counter()
        for wid, batch in batches:
            batch.apply_to(idx, wid)
        res["ingest_relay_blocks_per_s"] = round(entries / (time.perf_counter() - t0))
        res["ingest_relay_blocks_per_cpu_s"] = round(entries / (time.process_time() - c0))
    finally:
        gc.enable()
    stats = idx.stats()
    assert stats.entries == entries, (stats, entries)
    res["unique_blocks"] = stats.unique_blocks
    res["entries"] = stats.entries
    return idx


def build_from_events(events: list[Event], res: dict[str, Any]) -> PrefixIndex:
    """Ours from vLLM's events, parents included."""
    entries = sum(len(b) for _, _, b in events)
    gc.disable()
    try:
        idx = PrefixIndex()
        c0, t0 = time.process_time(), time.perf_counter()
        for wid, parent, blocks in events:
            idx.apply_stored(wid, parent, blocks)
        res["ingest_blocks_per_s"] = round(entries / (time.perf_counter() - t0))
        res["ingest_blocks_per_cpu_s"] = round(entries / (time.process_time() - c0))
    finally:
        gc.enable()
    assert idx.stats().entries == entries
    return idx


def ingest_from_wire(cfg: Config, events: list[Event], res: dict[str, Any]) -> None:
    entries = sum(len(b) for _, _, b in events)
    payloads = vllm_payloads(events, random.Random(f"{cfg.seed}/tokens"))
    gc.disable()
    try:
        idx = PrefixIndex()
        c0, t0 = time.process_time(), time.perf_counter()
        for wid, payload in payloads:
            apply_events(idx, wid, decode_payload(payload)[2])
        res["ingest_from_msgpack_blocks_per_s"] = round(entries / (time.perf_counter() - t0))
        res["ingest_from_msgpack_blocks_per_cpu_s"] = round(entries / (time.process_time() - c0))
    finally:
        gc.enable()
    assert idx.stats().entries == entries


def router_memory(cfg: Config, wl: Workload, res: dict[str, Any]) -> None:
    """Everything the Router's index retains, by tracemalloc."""
    tracemalloc.start()
    idx = PrefixIndex()
    for wid, batch in relay_batches(cfg, wl):  # fresh ints: the index owns its keys
        batch.apply_to(idx, wid)
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    res["bytes_total"] = current
    res["bytes_per_entry"] = round(current / idx.stats().entries, 1)
    res["bytes_per_unique_block"] = round(current / idx.stats().unique_blocks, 1)


def build_dynamo(events: list[Event], res: dict[str, Any]) -> Any:
    from dynamo._core import RadixTree  # benchmark-only dependency: ai-dynamo-runtime

    entries = sum(len(b) for _, _, b in events)
    payloads = [(wid, dynamo_json(i, p, b)) for i, (wid, p, b) in enumerate(events)]
    gc.collect()
    rss0 = rss_bytes()
    tree = RadixTree()
    c0, t0 = time.process_time(), time.perf_counter()
    for wid, payload in payloads:
        tree.apply_event(wid, payload)
    res["ingest_blocks_per_s"] = round(entries / (time.perf_counter() - t0))
    res["ingest_blocks_per_cpu_s"] = round(entries / (time.process_time() - c0))
    res["rss_growth_bytes"] = rss_bytes() - rss0
    res["bytes_per_entry"] = round(res["rss_growth_bytes"] / entries, 1)
    return tree


def write_results(cfg: Config, results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "router_index.json").write_text(json.dumps(results, indent=2) + "\n")
    rounds: list[dict[str, Any]] = results["rounds"]
    loads = ", ".join(f"{r['loadavg_before'][0]:.1f}/{r['loadavg_after'][0]:.1f}" for r in rounds)
    gc_runs = [sum(r["gc_collections_during_queries"]) for r in rounds]
    lines = [
        "# Router prefix index vs Dynamo RadixTree",
        "",
        f"{results['when']}, {results['machine']}. Command: `{results['command']}`: "
        f"{len(rounds)} rounds, each a fresh process, separated by ` / ` below. "
        "**Provisional**: shared 2-core machine, other jobs were running (load average "
        f"before/after each round: {loads}).",
        "",
        f"Workload: {cfg.workers} workers x {cfg.blocks_per_worker:,} blocks "
        f"({results['entries']:,} (worker, block) entries); {cfg.shared_prefixes} shared "
        f"{PREFIX_BLOCKS}-block prefixes ({cfg.prefixes_per_worker} per worker), a "
        f"{LONG_PREFIX}-block prefix on every worker, unique {TURNS}x{TURN_BLOCKS}-block turns. "
        f"{cfg.queries:,} queries per case and pass, 3 passes a round (the pass with the "
        "median p99 is shown).",
        "",
        "Ours is built twice: as the Router builds it, from the batches the workers' relays",
        f"send (one per vLLM batch of {EVENTS_PER_BATCH} events: the blocks newly held, without "
        "parents), and from",
        "vLLM's events with their parents (what a relay passing the parents on would give).",
        "",
        "Each timing: wall clock (CPU time of this process in brackets: it leaves out the time",
        "other jobs held the cores, and adds about 1 us per query: reading it is a system call).",
        "As in the Router, which hashes a request just before routing it, each query is a list",
        "of fresh int objects made just before its call, and the cyclic GC runs with its default",
        "thresholds: it collected "
        + " / ".join(str(n) for n in gc_runs)
        + " times during the timed queries.",
        "",
        "| metric | ours, as the Router builds it | ours, from vLLM's events | "
        "Dynamo RadixTree (Rust) | target |",
        "| --- | --- | --- | --- | --- |",
    ]

    def g(d: dict[str, Any], *path: str) -> str:
        for p in path:
            if not isinstance(d, dict) or p not in d:
                return "n/a"
            d = d[p]
        return f"{d:,}" if isinstance(d, int) else str(d)

    def per_round(impl: str, wall: tuple[str, ...], busy: tuple[str, ...] = ()) -> str:
        if not any(impl in r for r in rounds):
            return ""
        cells = []
        for r in rounds:
            d = r.get(impl, {})
            cells.append(g(d, *wall) + (f" ({g(d, *busy)})" if busy else ""))
        return " / ".join(cells)

    rows = [
        (
            "ingest, blocks/s (relay batches / decoded events / JSON events)",
            per_round("ours", ("ingest_relay_blocks_per_s",), ("ingest_relay_blocks_per_cpu_s",)),
            per_round("ours_parents", ("ingest_blocks_per_s",), ("ingest_blocks_per_cpu_s",)),
            per_round("dynamo", ("ingest_blocks_per_s",), ("ingest_blocks_per_cpu_s",)),
            ">= 1M",
        ),
        (
            "ingest from vLLM's msgpack, blocks/s",
            "",
            per_round(
                "ours_parents",
                ("ingest_from_msgpack_blocks_per_s",),
                ("ingest_from_msgpack_blocks_per_cpu_s",),
            ),
            "",
            ">= 1M",
        ),
    ]
    for q, label in (("typical", "typical"), ("all_share_128", f"all-{cfg.workers}-share-128")):
        for pct in ("p50", "p99"):
            ours, parents, dyn = (
                per_round(i, (q, f"{pct}_us"), (q, f"cpu_{pct}_us")) for i in IMPLS
            )
            target = "<= 50" if pct == "p99" else ""
            rows.append((f"find_matches {label} {pct} us", ours, parents, dyn, target))
    rows.append(
        (
            "bytes per (worker, block)",
            per_round("ours", ("bytes_per_entry",)) + " (tracemalloc)",
            "",
            (per_round("dynamo", ("bytes_per_entry",)) + " (RSS growth)")
            if any("dynamo" in r for r in rounds)
            else "",
            "<= 150",
        )
    )
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    lines += ["", "Spread over the rounds (min-max, wall; CPU in brackets), us:", ""]
    for impl, label in (("ours", "as the Router builds it"), ("ours_parents", "from events")):
        lines.append(
            f"- ours {label}: "
            + "; ".join(
                f"{q} p50 {s['p50_us'][0]}-{s['p50_us'][1]} ({s['cpu_p50_us'][0]}-"
                f"{s['cpu_p50_us'][1]}), p99 {s['p99_us'][0]}-{s['p99_us'][1]} "
                f"({s['cpu_p99_us'][0]}-{s['cpu_p99_us'][1]})"
                for q, s in results["spread"][impl].items()
            )
        )
    errors = {r["dynamo_error"] for r in rounds if r.get("dynamo_error")}
    if errors:
        lines += ["", f"Dynamo not measured: {'; '.join(sorted(errors))}"]
    (RESULTS / "router_index.md").write_text("\n".join(lines) + "\n")


IMPLS = ("ours", "ours_parents", "dynamo")


def run_once(cfg: Config, with_dynamo: bool) -> dict[str, Any]:
    """One round: build both indexes, time the queries, measure our memory."""
    wl = make_workload(cfg)
    t0 = time.perf_counter()
    events = list(all_events(cfg, wl, sample=True))
    queries = make_queries(cfg, wl)
    log.info("workload: %d events in %.1fs", len(events), time.perf_counter() - t0)
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "entries": sum(len(b) for _, _, b in events),
        "events": len(events),
    }
    # Dynamo first: its memory is read from RSS growth, which heap space that our runs
    # freed earlier would hide.
    results["loadavg_before"] = os.getloadavg()
    impls: dict[str, Callable[[list[int]], Any]] = {}
    tree = None
    if with_dynamo:
        try:
            results["dynamo"] = {}
            tree = build_dynamo(events, results["dynamo"])
            find = tree.find_matches
            impls["dynamo"] = lambda q: find(q).scores
        except ImportError as exc:
            results.pop("dynamo")
            results["dynamo_error"] = f"ai-dynamo-runtime not importable: {exc}"
            log.warning("%s", results["dynamo_error"])
    results["ours"], results["ours_parents"] = {}, {}
    router = build_router(cfg, wl, results["ours"])
    from_events = build_from_events(events, results["ours_parents"])
    impls["ours"] = router.find_matches
    impls["ours_parents"] = from_events.find_matches
    sample = queries["all_share_128"][0].tolist()
    for idx in (router, from_events):
        assert idx.find_matches(sample) == {w: LONG_PREFIX for w in wl.worker_ids}
    if tree is not None:
        scores = tree.find_matches(sample).scores
        assert scores == {(w, 0): LONG_PREFIX for w in wl.worker_ids}, scores
    gc_runs = [0, 0, 0]
    for impl, lat in latencies_us(impls, queries, gc_runs=gc_runs).items():
        results[impl].update(lat)
    results["gc_collections_during_queries"] = gc_runs
    del impls, idx, router, from_events, tree
    gc.collect()
    ingest_from_wire(cfg, events, results["ours_parents"])
    router_memory(cfg, wl, results["ours"])
    results["loadavg_after"] = os.getloadavg()
    for impl in ("dynamo", "ours", "ours_parents"):
        if impl in results:
            log.info("%s: %s", impl, json.dumps(results[impl]))
    return results


def spread(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Min and max over the rounds of our find_matches percentiles, per build and query set."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for impl in ("ours", "ours_parents"):
        out[impl] = {}
        for q in ("typical", "all_share_128"):
            out[impl][q] = {}
            for key in ("p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us"):
                values = [r[impl][q][key] for r in rounds]
                out[impl][q][key] = [min(values), max(values)]
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each a fresh process")
    ap.add_argument("--workers", type=int, default=Config.workers)
    ap.add_argument("--blocks-per-worker", type=int, default=Config.blocks_per_worker)
    ap.add_argument("--queries", type=int, default=Config.queries)
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--no-dynamo", action="store_true", help="measure only our index")
    ap.add_argument("--no-write", action="store_true", help="print, do not write results")
    ap.add_argument("--round-out", help=argparse.SUPPRESS)  # a round's JSON, for main
    a = ap.parse_args(argv)
    cfg = Config(
        workers=a.workers, blocks_per_worker=a.blocks_per_worker, queries=a.queries, seed=a.seed
    )
    floor = LONG_PREFIX + PREFIX_BLOCKS * cfg.prefixes_per_worker + TURNS * TURN_BLOCKS
    if cfg.blocks_per_worker < floor:
        ap.error(f"--blocks-per-worker must be at least {floor} for this workload")
    if a.round_out:
        Path(a.round_out).write_text(json.dumps(run_once(cfg, not a.no_dynamo)))
        return 0
    args = [
        f"--workers={a.workers}",
        f"--blocks-per-worker={a.blocks_per_worker}",
        f"--queries={a.queries}",
        f"--seed={a.seed}",
    ] + (["--no-dynamo"] if a.no_dynamo else [])
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            out = Path(tmp) / f"round{r}.json"
            log.info("round %d of %d", r + 1, a.rounds)
            subprocess.run([sys.executable, __file__, *args, f"--round-out={out}"], check=True)
            rounds.append(json.loads(out.read_text()))
    results: dict[str, Any] = {
        "when": rounds[0]["when"],
        "machine": f"{os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}",
        "provisional": True,
        "command": "python benchmarks/router_index.py"
        + (f" --rounds {a.rounds}" if a.rounds != 3 else ""),
        "config": asdict(cfg),
        "entries": rounds[0]["entries"],
        "events": rounds[0]["events"],
        "rounds": rounds,
        "spread": spread(rounds),
    }
    log.info("spread over %d rounds: %s", a.rounds, json.dumps(results["spread"]))
    if not a.no_write:
        write_results(cfg, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
