"""Make this checkout's declared entry points visible to Python before it is reinstalled.

vLLM finds plugins through installed package metadata (``importlib.metadata``), which
an editable install writes once, at install time: an entry point added to
``pyproject.toml`` since then is invisible until ``pip install -e .`` runs again. For
tests and benchmarks of such a checkout, ``shim_path()`` writes a minimal distribution
(``dynagraph_entry_points-0.dist-info`` with the missing entry points, nothing else)
into a directory to put on ``PYTHONPATH``; it returns None when the installed metadata
already has every declared entry point (a reinstalled checkout needs no shim).

    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim_path(tmp)), ...]))
"""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIST = "dynagraph_entry_points"


def declared(pyproject: Path = REPO / "pyproject.toml") -> dict[str, dict[str, str]]:
    """``[project.entry-points]`` of the checkout: group -> name -> target."""
    data = tomllib.loads(pyproject.read_text())
    groups: dict[str, dict[str, str]] = data.get("project", {}).get("entry-points", {})
    return groups


def missing(groups: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The declared entry points the installed metadata lacks."""
    out: dict[str, dict[str, str]] = {}
    for group, items in groups.items():
        have = {(ep.name, ep.value) for ep in entry_points(group=group)}
        lacking = {n: v for n, v in items.items() if (n, v) not in have}
        if lacking:
            out[group] = lacking
    return out


def shim_path(directory: Path) -> Path | None:
    """Write the shim distribution into ``directory`` (see module doc); None if not
    needed."""
    lacking = missing(declared())
    if not lacking:
        return None
    info = directory / f"{DIST}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0\n")
    lines = []
    for group, items in lacking.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in items.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return directory
