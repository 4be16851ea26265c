"""A process's memory as ``/proc`` reports it."""

from __future__ import annotations


def anon_huge_kib(pid: int) -> int:
    """KiB of process ``pid``'s anonymous memory in transparent huge pages."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
