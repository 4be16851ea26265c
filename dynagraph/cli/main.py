"""The ``dynamo`` command.

    dynamo serve graphs.agg:Frontend -f configs/agg.yaml [--dry-run] [--Comp.key=value ...]
                 [--host ADDR] [--service-name NAME ...]   (part of a graph on this host)
    dynamo deploy k8s graphs.agg:Frontend -f configs/agg.yaml [-o DIR]   (dynagraph.cli.deploy)
    dynamo status [--watch] [--json]                                      (dynagraph.cli.status)
    dynamo settings get|set|unset COMPONENT KEY [VALUE]                   (dynagraph.cli.settings)
    dynamo simulate GRAPH -f CONFIG --trace FILE --out DIR [...]          (dynagraph.cli.simulate)

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
from typing import NoReturn

from dynagraph.cli import deploy, settings, simulate, status
from dynagraph.cli._logging import LEVELS, exit_now, setup_logging
from dynagraph.errors import ConfigError, DynagraphError, GraphError, InfraError
from dynagraph.sdk._runtime import DRAIN_GRACE_S

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
    s.add_argument("--drain-grace", type=float, default=DRAIN_GRACE_S, metavar="S",
                   help="seconds a stopping or scaled-down worker lets its requests in flight "
                   "finish")
    s.add_argument("--restart", choices=["on-failure", "never"], default="on-failure",
                   help="what to do when a component process exits by itself")
    s.add_argument("--max-restarts", type=int, default=5)
    s.add_argument("--host", default=os.environ.get("DYNAMO_HOST", "").strip() or "127.0.0.1",
                   metavar="ADDR",
                   help="this host's IPv4 address: the components bind it and publish it "
                   "(request plane, metrics, NIXL side channel); default $DYNAMO_HOST or "
                   "127.0.0.1. Not loopback: nothing loopback may be published")
    s.add_argument("--service-name", action="append", default=[], metavar="NAME",
                   help="start only this component of the graph (repeatable); the others "
                   "run on other hosts sharing ETCD_ENDPOINTS and NATS_SERVER")
    s.add_argument("--log-level", choices=LEVELS,
                   default=os.environ.get("DYN_LOG_LEVEL", "info").lower(),
                   help="our components' level; below debug, vLLM's start-up steps are shown "
                   "as progress lines and its other INFO lines are hidden")
    s.add_argument("--engine-cores", choices=["keep-off", "share"], default="keep-off",
                   help="keep-off: the graph's processes keep off the cores vLLM bound its "
                   "model runners to (the rest get the other cores); share: the kernel "
                   "places them")
    deploy.add_parser(sub)
    status.add_parser(sub)
    settings.add_parser(sub)
    simulate.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known, extra = _parser().parse_known_args(argv)
    setup_logging(getattr(known, "log_level", None))
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if bad:
        print(f"dynamo: error: unrecognized arguments: {' '.join(bad)}", file=sys.stderr)
        return 2
    overrides = _join_values(extra)
    if known.command == "deploy":
        return deploy.deploy_command(known, overrides)
    if known.command == "simulate":
        return simulate.simulate_command(known, overrides)
    if known.command in ("status", "settings"):
        if extra:
            print(f"dynamo {known.command}: error: unrecognized arguments: {' '.join(extra)}",
                  file=sys.stderr)
            return 2
        run = status.status_command if known.command == "status" else settings.settings_command
        return run(known)
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
    from dynagraph.cli import serve_part
    from dynagraph.runtime.addresses import validate_host

    try:
        graph = resolve_target(args.target)
        configs = resolve_config(graph, args.config, overrides)
        here = serve_part.select(graph, configs, args.service_name)
        validate_host(args.host, bindable=not args.dry_run)
        serve_part.check_hosts(here, args.host)
    except (ConfigError, GraphError) as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"graph {args.target}:")
        print("  " + graph.describe().replace("\n", "\n  "))
        if len(here) < len(configs):
            print(f"on this host ({args.host}): {', '.join(here)}")
        print("configs:")
        print(json.dumps({n: {"ServiceArgs": c.service_args.model_dump(), **c.values}
                          for n, c in configs.items()}, indent=2))
        return 0
    missing = serve_part.missing_shared_infra()
    if serve_part.is_partial(graph, args.service_name) and missing:
        print(f"dynamo serve: {serve_part.shared_infra_message(missing)}", file=sys.stderr)
        return 2
    from dynagraph.cli.serve import Supervisor
    from dynagraph.cli.serve_options import ServeOptions

    opts = ServeOptions(ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout,
                        restart=args.restart, max_restarts=args.max_restarts,
                        log_level=args.log_level, drain_grace=args.drain_grace,
                        host=args.host, service_names=tuple(args.service_name),
                        engine_cores=args.engine_cores)
    try:
        return asyncio.run(Supervisor(args.target, graph, configs, opts).run())
    except InfraError as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 1
    except DynagraphError as exc:
        print(f"dynamo serve: {exc}", file=sys.stderr)
        return 1


def entry() -> NoReturn:
    """The ``dynamo`` console script: ``main()``, then ``exit_now`` (a stopped graph's
    process need not spend 0.4-1.7 s collecting its imports' garbage on the way out)."""
    exit_now(main())


if __name__ == "__main__":
    entry()
