"""Checks of Grafana dashboard JSON (``deploy/grafana/dashboards``), free of I/O.

``structure_problems`` finds what would break a dashboard in Grafana: duplicate or
missing panel ids, panels out of the 24-column grid or overlapping, an unknown
datasource uid, a ``$variable`` no template defines, a target without an
expression. ``panel_queries`` lists every PromQL expression; ``concrete`` replaces
the Grafana variables so Prometheus can run it; ``metric_names`` extracts the
metric names it reads; ``rules_yaml`` wraps expressions as recording rules, the
form ``promtool check rules`` parses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRID_COLUMNS = 24
BUILTIN_VARIABLES = frozenset({
    "__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms",
    "__from", "__to", "__dashboard", "__name", "__org", "__user", "__all",
})  # fmt: skip
TEST_VALUES: Mapping[str, str] = {
    "__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000", "__range": "5m",
    "__range_s": "300", "__range_ms": "300000",
}  # fmt: skip
"""Values a test substitutes for Grafana's built-in variables; user variables become ``.*``."""

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                       "and", "or", "unless", "offset", "inf", "nan", "atan2"})


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    title: str
    ref_id: str
    expr: str


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and panels nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", []) or []


def variables(dashboard: Mapping[str, Any]) -> set[str]:
    return {v["name"] for v in dashboard.get("templating", {}).get("list", []) if "name" in v}


def used_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _VAR.finditer(text)}


def panel_queries(dashboard: Mapping[str, Any], name: str = "") -> list[PanelQuery]:
    out = []
    for p in iter_panels(dashboard):
        for t in p.get("targets", []) or []:
            out.append(PanelQuery(name, int(p.get("id", -1)), str(p.get("title", "")),
                                  str(t.get("refId", "")), str(t.get("expr", ""))))
    return out


def _uids(obj: Any) -> Iterator[str]:
    """Every datasource uid referenced anywhere in ``obj``."""
    if isinstance(obj, dict):
        ds = obj.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield str(ds["uid"])
        elif isinstance(ds, str):
            yield ds
        for v in obj.values():
            yield from _uids(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _uids(v)


def structure_problems(dashboard: Mapping[str, Any], datasource_uids: set[str]) -> list[str]:
    """Everything wrong with the dashboard's structure (empty list: fine)."""
    problems: list[str] = []
    for key in ("uid", "title", "panels"):
        if not dashboard.get(key):
            problems.append(f"dashboard has no {key!r}")
    defined = variables(dashboard)
    ids: dict[int, str] = {}
    titles: set[str] = set()
    boxes: list[tuple[str, int, int, int, int]] = []
    for p in iter_panels(dashboard):
        title = str(p.get("title", ""))
        pid = p.get("id")
        if not isinstance(pid, int):
            problems.append(f"panel {title!r} has no integer id")
        elif pid in ids:
            problems.append(f"panel id {pid} used by {ids[pid]!r} and {title!r}")
        else:
            ids[pid] = title
        if not title:
            problems.append(f"panel {pid} has no title")
        elif title in titles:
            problems.append(f"panel title {title!r} is used twice")
        titles.add(title)
        g = p.get("gridPos") or {}
        x, y, w, h = (g.get(k) for k in ("x", "y", "w", "h"))
        if not all(isinstance(v, int) for v in (x, y, w, h)):
            problems.append(f"panel {title!r}: gridPos needs integer x, y, w, h")
            continue
        assert isinstance(x, int) and isinstance(y, int) and isinstance(w, int) and isinstance(h, int)
        if x < 0 or y < 0 or w < 1 or h < 1 or x + w > GRID_COLUMNS:
            problems.append(f"panel {title!r}: gridPos {g} outside the {GRID_COLUMNS}-column grid")
        for other, ox, oy, ow, oh in boxes:
            if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                problems.append(f"panels {other!r} and {title!r} overlap")
        boxes.append((title, x, y, w, h))
        if p.get("type") != "row":
            targets = p.get("targets") or []
            if not targets:
                problems.append(f"panel {title!r} has no targets")
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs) or not all(refs):
                problems.append(f"panel {title!r}: refIds must be set and unique: {refs}")
            for t in targets:
                if not str(t.get("expr", "")).strip():
                    problems.append(f"panel {title!r} target {t.get('refId')}: empty expr")
    text = json.dumps(dashboard.get("panels", []))
    text += json.dumps(dashboard.get("templating", {}))
    for var in sorted(used_variables(text) - defined - BUILTIN_VARIABLES):
        problems.append(f"variable ${var} is used but not defined in templating")
    for uid in sorted(set(_uids(dict(dashboard))) - datasource_uids):
        problems.append(f"unknown datasource uid {uid!r} (known: {sorted(datasource_uids)})")
    return problems


def concrete(expr: str, values: Mapping[str, str] | None = None) -> str:
    """``expr`` with Grafana variables replaced: built-ins from ``TEST_VALUES``, others ``.*``."""
    vals = {**TEST_VALUES, **(values or {})}

    def sub(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        return vals.get(name, ".*")

    return _VAR.sub(sub, expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (strings, label matchers, ranges and grouping removed)."""
    text = _STRING.sub('""', expr)
    prev = None
    while prev != text:
        prev = text
        text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m.group(1) for m in _IDENT.finditer(text)
            if m.group(1).lower() not in _KEYWORDS and not m.group(1).startswith("__")}


def rules_yaml(exprs: list[str]) -> str:
    """A Prometheus rules file recording each expression (for ``promtool check rules``)."""
    lines = ["groups:", "  - name: dashboard_expressions", "    rules:"]
    for i, e in enumerate(exprs):
        lines.append(f"      - record: dashboard:expr_{i}")
        lines.append(f"        expr: {json.dumps(e)}")
    return "\n".join(lines) + "\n"


def load_dashboards(directory: Path) -> dict[str, dict[str, Any]]:
    """``{file name: dashboard}`` for every ``*.json`` in ``directory``."""
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def panel_graphs(dashboard: Mapping[str, Any], requirements: Mapping[str, Any]) -> dict[str, str]:
    """``{panel title: graph}`` for every non-row panel, from a requirements.yaml entry."""
    default = str(requirements["graph"])
    overrides = requirements.get("panels") or {}
    return {str(p["title"]): str(overrides.get(p["title"], default))
            for p in iter_panels(dashboard) if p.get("type") != "row"}
