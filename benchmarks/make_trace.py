"""Write a synthetic Mooncake-format trace (shared-prefix conversations, bursty arrivals).

    python benchmarks/make_trace.py --out benchmarks/traces/data/NAME.jsonl [--seed 0]
        [--duration-s 60] [--arrival onoff|gamma|poisson] [--rate 1] [--burst-rate 5] ...
    python benchmarks/make_trace.py --describe FILE [--block-tokens 512]

Every option of ``benchmarks.traces.synth.SynthConfig`` is a flag (``--help`` lists
them with their defaults). Prints the trace's statistics (requests, rates, lengths, the
prefix-cache hit rate of an unbounded cache) as JSON. Same options, same file.
``--describe`` prints the statistics of an existing trace instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.traces.synth import (  # noqa: E402
    add_synth_args,
    generate_trace,
    synth_config_from_args,
)
from benchmarks.traces.trace import (  # noqa: E402
    DEFAULT_BLOCK_TOKENS,
    TraceError,
    load_trace,
    save_trace,
    trace_stats,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="the JSONL file to write")
    mode.add_argument("--describe", type=Path, help="print the statistics of this trace")
    add_synth_args(parser)
    args = parser.parse_args(argv)
    if args.describe:
        block = int(args.synth_block_tokens or DEFAULT_BLOCK_TOKENS)
        try:
            described = load_trace(args.describe, block_tokens=block)
        except (TraceError, OSError) as exc:
            print(f"make_trace: {exc}", file=sys.stderr)
            return 2
        print(json.dumps({"file": str(args.describe),
                          "stats": trace_stats(described, block_tokens=block).as_dict()},
                         indent=2))
        return 0
    cfg = synth_config_from_args(args)
    records = generate_trace(cfg)
    if not records:
        parser.error("the configuration produced no requests (raise --duration-s or --rate)")
    path = save_trace(args.out, records)
    print(json.dumps({"file": str(path), "config": cfg.model_dump(by_alias=True),
                      "stats": trace_stats(records, block_tokens=cfg.block_tokens).as_dict()},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
