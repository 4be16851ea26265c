"""Reading a process's Prometheus text exposition in tests."""

from __future__ import annotations

import re
import urllib.request


def scrape(address: str) -> str:
    """The ``/metrics`` text of ``host:port``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:  # noqa: S310
        text: str = resp.read().decode()
    return text


def value(text: str, series: str) -> float:
    """The value of exactly ``series`` (name with its label set, as exposed)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in the exposition")


def total(text: str, name: str, labels: str = "") -> float:
    """Sum of every sample of ``name`` whose label set contains the text ``labels``."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$")
    out = 0.0
    for line in text.splitlines():
        m = pattern.match(line)
        if m and labels in (m.group(1) or ""):
            out += float(m.group(2))
    return out
