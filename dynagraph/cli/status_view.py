"""``dynamo status`` as data and as text: pure, so tables are tested line for line.

`dynagraph.cli.status` gathers a `Snapshot` (etcd, each instance's request-plane port and
metrics endpoint); `render` draws it, `Snapshot.to_json` is the ``--json`` output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dynagraph.cli.live_catalog import SettingValue, show


@dataclass(frozen=True)
class Load:
    """What a worker's metrics say about its load (None: not exported)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    """Fraction of the KV cache in use, 0..1."""
    kv_used_blocks: float | None = None
    kv_total_blocks: float | None = None


@dataclass(frozen=True)
class Instance:
    """One process of one component, registered (``ready``) or still ``starting``."""

    namespace: str
    component: str
    instance_id: str
    state: str
    """``ready`` (registered) or ``starting`` (its start hooks are still running)."""
    worker_index: int | None = None
    address: str | None = None
    host: str | None = None
    pid: int | None = None
    started_at: float | None = None
    health: str = "-"
    """``ok`` (request plane and metrics answer), ``no answer`` (the request plane
    refuses), ``no metrics`` (metrics endpoint down), ``-`` (not probed)."""
    load: Load | None = None
    url: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """Everything ``dynamo status`` shows, taken at ``taken_at`` (seconds since the epoch)."""

    found: str
    """How the graph was found, in words (`dynagraph.cli.serve_state.Selection.found`)."""
    etcd: str
    namespaces: list[str]
    taken_at: float
    local_host: str
    instances: list[Instance] = field(default_factory=list)
    expected: dict[str, int] = field(default_factory=dict)
    """Instances per component in the served config (workers x instances per process),
    when known (graph order)."""
    settings: list[SettingValue] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def components(self) -> list[str]:
        """Component names: the served graph's order, then any other seen in etcd."""
        seen = list(self.expected)
        for inst in sorted(self.instances, key=lambda i: i.component):
            if inst.component not in seen:
                seen.append(inst.component)
        return seen

    def counts(self) -> dict[str, tuple[int, int, int | None]]:
        """Component -> (ready, starting, expected or None)."""
        out: dict[str, tuple[int, int, int | None]] = {}
        for name in self.components():
            mine = [i for i in self.instances if i.component == name]
            out[name] = (sum(i.state == "ready" for i in mine),
                         sum(i.state == "starting" for i in mine), self.expected.get(name))
        return out

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = [s.to_json() for s in self.settings]
        data["components"] = {n: {"ready": r, "starting": s, "expected": e}
                              for n, (r, s, e) in self.counts().items()}
        return data


WORKER_GAUGES = {
    "dynamo_worker_requests_running": "running",
    "dynamo_worker_requests_waiting": "waiting",
    "dynamo_worker_kv_cache_usage_ratio": "kv_usage",
    "dynamo_worker_kv_used_blocks": "kv_used_blocks",
    "dynamo_worker_kv_total_blocks": "kv_total_blocks",
}
"""The worker gauges (`dynagraph.llm.engines.metrics`) -> `Load` fields."""


def load_from_metrics(text: str, worker: str) -> Load | None:
    """A worker's `Load` from Prometheus text (samples labelled ``worker=<id>`` preferred,
    else the process's only ones); None if it exports none of the worker gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field = WORKER_GAUGES.get(family.name)
        if field is None:
            continue
        samples = [s for s in family.samples if s.labels.get("worker") == worker] \
            or family.samples
        if samples:
            values[field] = float(sum(s.value for s in samples))
    return Load(**values) if values else None


COLUMNS = ("COMPONENT", "READY", "INSTANCE", "ADDRESS", "PID", "UPTIME", "HEALTH",
           "RUNNING", "WAITING", "KV USED")


def render(snap: Snapshot) -> str:
    """The status as text: where it came from, one row per instance, the live settings."""
    lines = [f"dynamo status: {snap.found}"]
    rows: list[Sequence[str]] = []
    counts = snap.counts()
    for name in snap.components():
        ready, starting, expected = counts[name]
        tally = f"{ready}/{expected}" if expected is not None else str(ready)
        if starting:
            tally += f" (+{starting} starting)"
        mine = sorted((i for i in snap.instances if i.component == name),
                      key=lambda i: (i.state != "ready", i.worker_index or 0, i.instance_id))
        if not mine:
            rows.append((name, tally, "-", "-", "-", "-", "none running", "", "", ""))
        for n, inst in enumerate(mine):
            rows.append((name if n == 0 else "", tally if n == 0 else "",
                         *_instance_cells(inst, snap)))
    if rows:
        lines += ["", *_table(COLUMNS, rows)]
    else:
        lines += ["", "no components registered in " + ", ".join(snap.namespaces or ["etcd"])]
    if snap.settings:
        lines += ["", "live settings (dynamo settings get|set|unset COMPONENT KEY [VALUE]):"]
        lines += _table(("COMPONENT", "SETTING", "VALUE", "FROM"),
                        [(s.component, s.name, show(s.value), _origin(s))
                         for s in snap.settings], indent="  ", with_header=False)
    lines += [f"note: {n}" for n in snap.notes]
    return "\n".join(lines)


def _instance_cells(inst: Instance, snap: Snapshot) -> tuple[str, ...]:
    local = inst.host is None or inst.host == snap.local_host
    pid = str(inst.pid) if inst.pid is not None and local else ("-" if local else inst.host or "-")
    uptime = age(snap.taken_at - inst.started_at) if inst.started_at else "-"
    health = "starting" if inst.state == "starting" else inst.health
    load = inst.load
    return (inst.instance_id, inst.address or "-", pid, uptime, health,
            _num(load.running if load else None), _num(load.waiting if load else None),
            _kv(load))


def _origin(s: SettingValue) -> str:
    if s.source == "etcd, ignored":
        return f"config (etcd holds {s.stored!r}, not {s.allowed}: ignored)"
    if s.source == "unset":
        return "not set (the config file's value applies; default shown)"
    return s.source


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:g}"


def _kv(load: Load | None) -> str:
    if load is None or load.kv_usage is None:
        return ""
    text = f"{100 * load.kv_usage:.1f}%"
    if load.kv_used_blocks is not None and load.kv_total_blocks:
        text += f" ({load.kv_used_blocks:g}/{load.kv_total_blocks:g})"
    return text


def age(seconds: float) -> str:
    """``42s``, ``5m02s``, ``3h04m``, ``2d03h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "",
           with_header: bool = True) -> list[str]:
    """Left-aligned columns two spaces apart; trailing blanks stripped."""
    all_rows = ([list(columns)] if with_header else []) + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(columns))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip()
            for r in all_rows]
