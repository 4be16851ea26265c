"""The ``dynamo`` command.

    dynamo serve graphs.agg:Frontend -f configs/agg.yaml [--dry-run] [--Comp.key=value ...]

Exit codes: 0 stopped cleanly, 2 bad command line / config / graph (nothing started),
1 the graph failed to come up, otherwise the exit code of the child that stopped it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from dynagraph.cli._logging import setup_logging
from dynagraph.errors import ConfigError, DynagraphError, GraphError, InfraError

log = logging.getLogger("dynagraph.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo", description="Serve a dynagraph component graph.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run a graph",
        description="Run MODULE:Component as one process per component worker. "
        "Extra arguments --Component.key=value override the config file.",
    )
    s.add_argument("target", help="graph or entry component, e.g. graphs.agg:Frontend")
    s.add_argument("-f", "--config", help="YAML config file")
    s.add_argument("--dry-run", action="store_true", help="print the graph and configs, run nothing")
    s.add_argument("--ready-timeout", type=float, default=180.0, metavar="S")
    s.add_argument("--stop-timeout", type=float, default=8.0, metavar="S")
    s.add_argument("--restart", choices=["on-failure", "never"], default="on-failure",
                   help="what to do when a component process exits by itself")
    s.add_argument("--max-restarts", type=int, default=5)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known, extra = _parser().parse_known_args(argv)
    setup_logging()
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if bad:
        print(f"dynamo: error: unrecognized arguments: {' '.join(bad)}", file=sys.stderr)
        return 2
    overrides = _join_values(extra)
    return serve_command(known, overrides)


def _join_values(extra: list[str]) -> list[str]:
    """Accept both ``--A.b=1`` and ``--A.b 1``."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if "=" not in arg and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            out.append(f"{arg}={extra[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def serve_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from dynagraph.sdk._config import resolve_config
    from dynagraph.sdk._graph import resolve_target

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        graph = resolve_target(args.target)
        configs = resolve_config(graph, args.config, overrides)
    except (ConfigError, GraphError) as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"graph {args.target}:")
        print("  " + graph.describe().replace("\n", "\n  "))
        print("configs:")
        print(json.dumps({n: {"ServiceArgs": c.service_args.model_dump(), **c.values}
                          for n, c in configs.items()}, indent=2))
        return 0
    from dynagraph.cli.serve import ServeOptions, Supervisor

    opts = ServeOptions(ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout,
                        restart=args.restart, max_restarts=args.max_restarts)
    try:
        return asyncio.run(Supervisor(args.target, graph, configs, opts).run())
    except InfraError as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 1
    except DynagraphError as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
