"""``dynamo settings``: read and change the live settings of a running graph.

    dynamo settings get [COMPONENT [KEY]] [--json]
    dynamo settings set COMPONENT KEY VALUE
    dynamo settings unset COMPONENT KEY

A live setting is a field of a component's config that the component follows in etcd
at ``/{namespace}/settings/{Component}/{key}`` (today: Router ``mode``,
``overlap-weight``, ``temperature``; VllmWorker ``max-local-prefill-length``,
``max-prefill-queue-size``; PrefillWorker ``hold-before-reply-s``). Which settings a
component has, and which values each accepts, come from the component class itself
(``LIVE_SETTINGS``), so a value is checked exactly as the running component will check
it before anything is written; a bad one is refused with exit code 2. ``unset``
deletes the key: the config file's value applies again. Which etcd and graph: see
`dynagraph.cli._find`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from dynagraph.cli import _find
from dynagraph.cli.live_catalog import Catalog, LiveComponent, SettingValue, show
from dynagraph.cli.serve_state import SelectionError
from dynagraph.errors import DynagraphError

PROG = "dynamo settings"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "settings", help="get, set or unset a live setting of a running graph",
        description="Read or change the live settings (etcd) of a running graph's "
        "components; values are validated against the component's typed settings first.")
    verbs = p.add_subparsers(dest="verb", required=True)
    g = verbs.add_parser("get", help="show live settings (all, one component's, or one)")
    g.add_argument("component", nargs="?")
    g.add_argument("key", nargs="?")
    g.add_argument("--json", action="store_true")
    s = verbs.add_parser("set", help="validate VALUE and write it to etcd")
    s.add_argument("component")
    s.add_argument("key")
    s.add_argument("value")
    u = verbs.add_parser("unset", help="delete the setting: the config file's value applies")
    u.add_argument("component")
    u.add_argument("key")
    for parser in (g, s, u):
        _find.add_arguments(parser)


def settings_command(args: argparse.Namespace) -> int:
    try:
        sel = _find.find(args)
    except SelectionError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2 if "choose one" in str(exc) else 1
    from dynagraph.runtime.live_settings import SettingError

    cat, notes = _find.catalog(sel, args.graph)
    for note in notes:
        print(f"{PROG}: note: {note}", file=sys.stderr)
    try:
        plan = plan_command(cat, args.verb, args.component, args.key,
                            getattr(args, "value", None))
    except SettingError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_execute(sel.etcd, cat, plan, json_out=getattr(args, "json", False)))
    except DynagraphError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


class Plan:
    """A checked command: which components' settings to read, and what to write."""

    def __init__(self, verb: str, targets: list[tuple[LiveComponent, str]],
                 value: Any = None) -> None:
        self.verb = verb
        self.targets = targets
        self.value = value
        """For ``set``: the JSON value to store."""


def plan_command(cat: Catalog, verb: str, component: str | None, key: str | None,
                 raw: str | None) -> Plan:
    """Validate a command against the catalog (pure). SettingError names the component,
    the key and what is allowed."""
    from dynagraph.runtime.live_settings import SettingError

    if component is None:
        return Plan(verb, [(c, n) for c in cat.components.values() for n in c.spec.names])
    comp = cat.get(component)
    if key is None:
        return Plan(verb, [(comp, n) for n in comp.spec.names])
    try:
        name = comp.spec.check_name(key)
    except SettingError:
        raise SettingError(f"{comp.name} has no live setting {key!r}; its live settings: "
                           f"{', '.join(comp.spec.names)}") from None
    if verb != "set":
        return Plan(verb, [(comp, name)])
    try:
        value = comp.spec.to_json(name, comp.spec.parse(name, raw))
    except SettingError as exc:
        raise SettingError(f"{comp.name} {name}: {exc}") from None
    return Plan(verb, [(comp, name)], value)


async def _execute(etcd: str, cat: Catalog, plan: Plan, *, json_out: bool) -> int:
    from dynagraph.runtime.discovery import EtcdDiscovery

    disc = EtcdDiscovery(etcd, op_timeout=3.0)
    await disc.start()
    try:
        stored: dict[str, Any] = {}
        for prefix in {c.prefix for c, _ in plan.targets}:
            stored.update(await disc.get_prefix(prefix))
        before = [cat.value(c, n, stored.get(c.key(n))) for c, n in plan.targets]
        if plan.verb == "get":
            print(json.dumps([v.to_json() for v in before], indent=2) if json_out
                  else "\n".join(render_values(before)))
            return 0
        comp, name = plan.targets[0]
        if plan.verb == "set":
            await disc.put(comp.key(name), plan.value)
        else:
            await disc.delete(comp.key(name))
        after = cat.value(comp, name, plan.value if plan.verb == "set" else None)
        print(describe_change(before[0], after, comp.key(name)))
        return 0
    finally:
        await disc.close()


def render_values(values: list[SettingValue]) -> list[str]:
    """``Router mode = kv (config)`` lines, aligned, with what each accepts."""
    if not values:
        return ["no live settings"]
    rows = [(f"{v.component} {v.name}", show(v.value), _from(v), v.allowed) for v in values]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"{a:<{w[0]}} = {b:<{w[1]}}  {c:<{w[2]}}  ({d})".rstrip() for a, b, c, d in rows]


def describe_change(before: SettingValue, after: SettingValue, key: str) -> str:
    """One line saying what changed, e.g. ``Router mode: kv (config) -> round-robin (etcd
    /dynamo/settings/Router/mode)``."""
    return (f"{after.component} {after.name}: {show(before.value)} ({_from(before)}) -> "
            f"{show(after.value)} ({_from(after)}{' ' + key if after.source == 'etcd' else ''})")


def _from(v: SettingValue) -> str:
    if v.source == "etcd, ignored":
        return f"config; etcd holds {v.stored!r}, ignored"
    if v.source == "unset":
        return "not set; the config file's value applies, default shown"
    return v.source
