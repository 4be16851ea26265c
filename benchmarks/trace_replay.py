"""Replay a Mooncake-format trace open loop against an OpenAI-compatible server.

    python benchmarks/trace_replay.py --url http://127.0.0.1:8000 --model tiny-llama
        (--trace FILE | --synthetic [--synth-seed 0 --synth-duration-s 60 ...])
        [--speed 1.0] [--start-s S] [--end-s S] [--max-requests N] [--block-tokens 512]
        [--tokenizer models/tiny-llama | --token-range LO:HI] [--prompt-seed 0]
        [--ttft-slo-ms 500] [--itl-slo-ms 50] [--window-s 5] [--max-connections 256]
        --out benchmarks/results/NAME

Each record is sent at ``timestamp / speed`` from the start (``--start-s``/``--end-s``
cut a window of the trace, in trace time), whether or not earlier requests finished, as a
streamed ``/v1/completions`` request with a token-id prompt synthesised from its
``hash_ids`` (equal ids, equal token blocks; see benchmarks/traces/prompts.py),
``max_tokens = output_length`` and ``ignore_eos``. Token ids come from ``--token-range``
or the ordinary (non-special) ids of ``--tokenizer`` (default: models/tiny-llama).

Writes ``NAME.json`` (options, trace statistics, whole-run summary, per-window figures,
per-request results), ``NAME.md`` (the command and the headline numbers) and
``NAME_latency_cdf.png``, ``NAME_ttft_timeline.png``, ``NAME_goodput.png``.
Exit code 0 when every request succeeded, 1 when some failed (all are still reported),
2 for bad arguments or an unreadable trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REPO, machine_info  # noqa: E402
from benchmarks.traces.plots import plot_all  # noqa: E402
from benchmarks.traces.prompts import PromptSynthesizer, safe_token_range  # noqa: E402
from benchmarks.traces.replay import ReplayOptions, replay, wait_ready  # noqa: E402
from benchmarks.traces.report import (  # noqa: E402
    Slo,
    clean,
    client_stats,
    markdown,
    summarize_run,
    windows,
)
from benchmarks.traces.synth import (  # noqa: E402
    add_synth_args,
    generate_trace,
    synth_config_from_args,
)
from benchmarks.traces.trace import (  # noqa: E402
    TraceError,
    TraceRecord,
    load_trace,
    scale,
    trace_stats,
)

log = logging.getLogger("bench.trace_replay")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server serves")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace")
    src.add_argument("--synthetic", action="store_true",
                     help="generate the trace (--synth-* options)")
    p.add_argument("--speed", type=float, default=1.0, help="time compression (2 = twice as fast)")
    p.add_argument("--start-s", type=float, help="replay from this trace time")
    p.add_argument("--end-s", type=float, help="replay up to this trace time")
    p.add_argument("--max-requests", type=int, help="replay at most this many records")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id")
    p.add_argument("--tokenizer", type=Path, help="model dir whose tokenizer.json sets the ids")
    p.add_argument("--token-range", help="LO:HI, token ids to draw prompts from")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the hash id -> tokens map")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--window-s", type=float, default=5.0, help="time-series window")
    p.add_argument("--max-connections", type=int, default=256)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--wait-ready-s", type=float, default=30.0,
                   help="wait this long for GET /v1/models to answer 200 first")
    p.add_argument("--out", required=True, type=Path, help="results prefix (NAME.json, ...)")
    p.add_argument("--title", help="plot and page title (default: the --out name)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--note", action="append", default=[],
                   help="a paragraph for the .md page (repeatable)")
    add_synth_args(p, prefix="synth-", exclude=frozenset({"block_tokens"}))
    return p.parse_args(argv)


def token_range(args: argparse.Namespace) -> tuple[int, int]:
    if args.token_range:
        lo, _, hi = args.token_range.partition(":")
        return int(lo), int(hi)
    tokenizer = args.tokenizer or REPO / "models" / "tiny-llama"
    return safe_token_range(tokenizer)


def load_records(args: argparse.Namespace) -> tuple[list[TraceRecord], dict[str, Any]]:
    if args.synthetic:
        cfg = synth_config_from_args(args, block_tokens=args.block_tokens)
        return generate_trace(cfg), {"synthetic": cfg.model_dump(by_alias=True)}
    return (load_trace(args.trace, block_tokens=args.block_tokens),
            {"file": str(args.trace)})


def dump_results(data: dict[str, Any]) -> str:
    """Indented JSON, except that each window and each request is one line."""
    rows = ("windows", "requests")
    head = json.dumps({k: v for k, v in data.items() if k not in rows}, indent=1)
    tail = ",\n".join(
        f' "{key}": [\n' + ",\n".join("  " + json.dumps(item) for item in data[key]) + "\n ]"
        for key in rows if key in data)
    return head[:-2] + ",\n" + tail + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    command = "python benchmarks/trace_replay.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    try:
        records, source = load_records(args)
        lo, hi = token_range(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"trace_replay: {exc}", file=sys.stderr)
        return 2
    to_ms = 1000.0
    chosen = scale(records, speed=args.speed,
                   start_ms=None if args.start_s is None else args.start_s * to_ms,
                   end_ms=None if args.end_s is None else args.end_s * to_ms,
                   max_requests=args.max_requests)
    if not chosen:
        print("trace_replay: no records in the chosen window", file=sys.stderr)
        return 2
    stats = trace_stats(chosen, block_tokens=args.block_tokens).as_dict()
    log.info("replaying %d requests over %.1f s (speed %g): %s", len(chosen),
             stats["duration_s"], args.speed, json.dumps(stats))
    prompts = PromptSynthesizer(lo=lo, hi=hi, block_tokens=args.block_tokens,
                                seed=args.prompt_seed)
    options = ReplayOptions(url=args.url, model=args.model,
                            max_connections=args.max_connections,
                            request_timeout_s=args.request_timeout_s)
    slo = Slo(ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms)

    async def run() -> Any:
        await wait_ready(args.url, args.wait_ready_s)
        return await replay(chosen, prompts, options, progress_every_s=5.0)

    cpu0 = time.process_time()
    try:
        result = asyncio.run(run())
    except TimeoutError as exc:
        print(f"trace_replay: {exc}", file=sys.stderr)
        return 2
    summary = summarize_run(result.results, slo)
    client = client_stats(result.loop_lag_s, time.process_time() - cpu0, result.wall_s)
    wins = windows(result.results, slo, args.window_s)
    name = args.out.name
    title = args.title or name
    data = clean({
        "command": command, "machine": machine_info(), "run_id": result.run_id,
        "options": {"url": args.url, "model": args.model, "speed": args.speed,
                    "start_s": args.start_s, "end_s": args.end_s,
                    "max_requests": args.max_requests, "block_tokens": args.block_tokens,
                    "token_range": [lo, hi], "prompt_seed": args.prompt_seed,
                    "max_connections": args.max_connections, "window_s": args.window_s},
        "trace": {"source": source, "replayed": stats},
        "wall_s": result.wall_s,
        "summary": summary,
        "client": client,
        "windows": wins,
        "requests": [r.as_dict() for r in result.results],
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jpath = args.out.with_name(name + ".json")
    jpath.write_text(dump_results(data))
    pngs = [] if args.no_plots else plot_all(result.results, wins, slo, args.out, title)
    notes = [f"Trace: `{json.dumps(source)}`", "",
             f"Replayed: `{json.dumps(clean(stats))}`", "",
             f"Machine: `{json.dumps(data['machine'])}`", *args.note]
    args.out.with_name(name + ".md").write_text(
        markdown(title, clean(summary), command=command, notes=notes, client=clean(client),
                 images=[p.name for p in pngs]))
    print(json.dumps({"json": str(jpath), "plots": [str(p) for p in pngs],
                      "summary": clean(summary)}, indent=2))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
