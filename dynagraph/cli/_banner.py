"""The per-component lines of ``dynamo serve``'s ready banner.

A component with a few instances gets one line per instance (worker index, pid,
request-plane and metrics addresses); one with many (``engines-per-process``: 256 mocker
engines) gets one summary line plus one line per process, so the banner stays readable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DETAIL_MAX = 8
"""Up to this many instances a component is listed instance by instance."""


def component_lines(name: str, records: Sequence[dict[str, Any]],
                    detail_max: int = DETAIL_MAX) -> list[str]:
    """Banner lines for ``name``'s instance records (``/{ns}/instances/{name}/...``)."""
    recs = sorted(records, key=_index)
    if len(recs) <= detail_max:
        return [_instance_line(name, r) for r in recs]
    by_pid: dict[Any, list[dict[str, Any]]] = {}
    for r in recs:
        by_pid.setdefault(r.get("pid"), []).append(r)
    lines = [f"  {name}: {len(recs)} instances in {len(by_pid)} processes"]
    for pid, group in by_pid.items():
        idx = [_index(r) for r in group]
        lines.append(f"    pid={pid} instances={len(group)} worker_index={min(idx)}-{max(idx)} "
                     f"metrics={group[0].get('metrics')}")
    return lines


def _index(record: dict[str, Any]) -> int:
    idx = record.get("worker_index")
    return idx if isinstance(idx, int) else -1


def _instance_line(name: str, rec: dict[str, Any]) -> str:
    url = rec.get("url")
    extra = f" url={url}" if url else ""
    return (f"  {name}[{rec.get('worker_index')}] pid={rec.get('pid')} "
            f"rpc={rec.get('address')} metrics={rec.get('metrics')}{extra}")
