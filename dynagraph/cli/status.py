"""``dynamo status``: what runs in a namespace, where, how loaded, with which live settings.

    dynamo status [-n NAMESPACE] [--pid PID] [--etcd URL] [--watch [SECONDS]] [--json]

Reads etcd (the instance records, the ``starting`` records of processes still in their
start hooks, the live settings), then probes each registered instance: a TCP connect to
its request-plane port and a GET of its metrics endpoint, whose ``dynamo_worker_*``
gauges give a worker's running and waiting requests and KV-cache use. Which etcd and
graph: see `dynagraph.cli._find`. Rendering is `dynagraph.cli.status_view`.

Exit codes: 0 shown, 1 nothing found or etcd unreachable, 2 several graphs match.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

from dynagraph.cli import _find
from dynagraph.cli.live_catalog import Catalog
from dynagraph.cli.serve_state import Selection, SelectionError
from dynagraph.cli.status_view import Instance, Load, Snapshot, load_from_metrics, render
from dynagraph.errors import DynagraphError

PROBE_TIMEOUT = 3.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status", help="show a running graph: components, instances, load, live settings",
        description="Show the components of a running graph, their instances (id, address, "
        "pid, uptime, health) and load, and the live settings in etcd. Finds a local "
        "dynamo serve by its state file, or reads ETCD_ENDPOINTS / --etcd.")
    _find.add_arguments(p)
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print JSON (one object per refresh)")


def status_command(args: argparse.Namespace) -> int:
    try:
        sel = _find.find(args)
    except SelectionError as exc:
        print(f"dynamo status: {exc}", file=sys.stderr)
        return 2 if "choose one" in str(exc) else 1
    cat, notes = _find.catalog(sel, args.graph)
    try:
        return asyncio.run(_run(sel, cat, notes, args))
    except KeyboardInterrupt:
        return 0


async def _run(sel: Selection, cat: Catalog, notes: list[str], args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    while True:
        try:
            if args.watch:  # a graph may have started or stopped meanwhile
                sel = _find.find(args)
            snap = await gather(sel, cat, notes)
            text = json.dumps(snap.to_json(), indent=None if args.watch else 2) if args.json \
                else render(snap)
        except (DynagraphError, SelectionError) as exc:
            if not args.watch:
                print(f"dynamo status: {exc}", file=sys.stderr)
                return 1
            text = f"dynamo status: {exc} (retrying)"
        if args.watch and tty and not args.json:
            text = "\x1b[H\x1b[2J" + text  # redraw in place
        print(text, flush=True)
        if not args.watch:
            return 0
        if not tty and not args.json:
            print(flush=True)
        await asyncio.sleep(args.watch)


async def gather(sel: Selection, cat: Catalog, notes: list[str] | None = None) -> Snapshot:
    """Read etcd and probe every registered instance (concurrently, `PROBE_TIMEOUT` each)."""
    from dynagraph.runtime.discovery import EtcdDiscovery

    disc = EtcdDiscovery(sel.etcd, op_timeout=3.0)
    await disc.start()
    try:
        namespaces = sel.namespaces or await _namespaces(disc)
        records: list[tuple[str, str, str, dict[str, Any]]] = []
        stored: dict[str, Any] = {}
        for ns in namespaces:
            for state, prefix in (("ready", "instances"), ("starting", "starting")):
                for key, value in (await disc.get_prefix(f"/{ns}/{prefix}/")).items():
                    parts = key.split("/")
                    if len(parts) == 5 and isinstance(value, dict):
                        records.append((ns, parts[3], state, {**value, "_id": parts[4]}))
            stored.update(await disc.get_prefix(f"/{ns}/settings/"))
    finally:
        await disc.close()
    ready_ids = {(r[0], r[1], r[3]["_id"]) for r in records if r[2] == "ready"}
    records = [r for r in records if r[2] == "ready" or (r[0], r[1], r[3]["_id"]) not in ready_ids]
    import httpx

    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT) as http:
        instances = await asyncio.gather(*(_instance(http, *r) for r in records))
    expected = {} if sel.state is None else {
        n: w for n, w in sel.state.components.items()
        if sel.state.component_namespaces.get(n) in (None, *namespaces)}
    shown = set(expected) | {i.component for i in instances}
    settings = [s for s in cat.values(stored) if s.namespace in namespaces
                and (s.component in shown or s.source.startswith("etcd"))]
    return Snapshot(found=sel.found, etcd=sel.etcd, namespaces=list(namespaces),
                    taken_at=time.time(), local_host=socket.gethostname(),
                    instances=list(instances), expected=expected, settings=settings,
                    notes=list(notes or []))


async def _namespaces(disc: Any) -> list[str]:
    """Every namespace with a component record in etcd."""
    found = set()
    for key in await disc.get_prefix("/"):
        parts = key.split("/")
        if len(parts) >= 4 and parts[2] in ("instances", "starting"):
            found.add(parts[1])
    return sorted(found)


async def _instance(http: Any, ns: str, component: str, state: str, rec: dict[str, Any]
                    ) -> Instance:
    health, load = "-", None
    address = rec.get("address")
    if state == "ready":
        health, load = await probe(http, address, rec.get("metrics"), rec["_id"])
    return Instance(
        namespace=ns, component=component, instance_id=rec["_id"], state=state,
        worker_index=_int(rec.get("worker_index")), address=address, host=rec.get("host"),
        pid=_int(rec.get("pid")), started_at=_float(rec.get("started_at")), health=health,
        load=load, url=rec.get("url"))


async def probe(http: Any, address: str | None, metrics: str | None, worker: str
                ) -> tuple[str, Load | None]:
    """(health, load) of one instance: its request-plane port must accept a connection
    and its metrics endpoint answer (``http``: an ``httpx.AsyncClient``); load comes from
    the ``dynamo_worker_*`` gauges."""
    rpc_ok, text = await asyncio.gather(_connects(address), _get_metrics(http, metrics))
    if not rpc_ok:
        return "no answer", None
    if metrics and text is None:
        return "no metrics", None
    return "ok", load_from_metrics(text or "", worker)


async def _connects(address: str | None) -> bool:
    if not address or ":" not in address:
        return False
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                           PROBE_TIMEOUT)
    except (TimeoutError, OSError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), PROBE_TIMEOUT)
    return True


async def _get_metrics(http: Any, address: str | None) -> str | None:
    if not address:
        return None
    import httpx

    try:
        resp = await http.get(f"http://{address}/metrics")
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
