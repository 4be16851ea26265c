"""Shared by ``dynamo status`` and ``dynamo settings``: which etcd and graph to talk to.

The etcd comes from ``--etcd``, else ``ETCD_ENDPOINTS``, else the state file of the one
``dynamo serve`` running here (`dynagraph.cli.serve_state`). The component classes whose
live settings are shown and validated come from ``--graph``, else that ``dynamo serve``'s
graph, else the project's own components (`DEFAULT_GRAPH`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dynagraph.cli.live_catalog import Catalog
from dynagraph.cli.serve_state import Selection, read_states, select, state_dir
from dynagraph.errors import DynagraphError

DEFAULT_GRAPH = "graphs.disagg_router:Frontend"
"""Holds every built-in component (Frontend, Processor, Router, VllmWorker, PrefillWorker)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", metavar="URL",
                   help="read this etcd (default: ETCD_ENDPOINTS, else the local dynamo serve)")
    p.add_argument("-n", "--namespace", help="only this namespace")
    p.add_argument("--pid", type=int, help="the dynamo serve to read, when several run here")
    p.add_argument("--graph", metavar="MODULE:NAME",
                   help="the graph whose components' live settings apply (default: the "
                        "served graph, else the built-in components)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning"),
                   help=argparse.SUPPRESS)


def find(args: argparse.Namespace) -> Selection:
    """The etcd and namespaces to read (SelectionError: nothing or too much found)."""
    where = state_dir()
    states = read_states(where)
    etcd = args.etcd or os.environ.get("ETCD_ENDPOINTS", "").strip() or None
    return select(states, etcd=etcd, namespace=args.namespace, pid=args.pid, where=str(where))


def catalog(sel: Selection, graph_ref: str | None) -> tuple[Catalog, list[str]]:
    """The live-settings catalog for ``sel`` and any notes about how it was built."""
    from dynagraph.sdk._graph import resolve_target

    notes: list[str] = []
    configs: dict[str, Any] | None = None
    target = graph_ref
    if target is None and sel.state is not None:
        target, configs = sel.state.target, sel.state.configs
        if sel.state.cwd not in sys.path:
            sys.path.insert(0, sel.state.cwd)
    if target is None:
        target = DEFAULT_GRAPH
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        graph = resolve_target(target)
    except (DynagraphError, ImportError) as exc:
        notes.append(f"cannot import {target} ({exc}); using the built-in components")
        graph, target, configs = resolve_target(DEFAULT_GRAPH), DEFAULT_GRAPH, None
    source = target if target != DEFAULT_GRAPH or sel.state else "the built-in components"
    return Catalog.from_classes(graph.nodes, source, configs), notes
