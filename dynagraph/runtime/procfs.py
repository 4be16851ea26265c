"""Whether a process is still there, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os

__all__ = ["group_pids", "pid_alive", "shm_files", "unlink_orphaned_shm"]


def pid_alive(pid: int) -> bool:
    """True while any thread of process ``pid`` is still running.

    A killed multi-threaded process shows its main thread as a zombie while its other
    threads are still exiting, and its files (listening sockets included) stay open until
    the last one is gone: only then is it dead for a peer.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any((fields := _stat(f"/proc/{pid}/task/{tid}/stat")) and fields[0] not in "ZX"
               for tid in threads)


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (their main threads not yet reaped)."""
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and (fields := _stat(f"/proc/{e}/stat")) and int(fields[2]) == pgid]


def _stat(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (state first), or
    None if the process is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def shm_files(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes ``pids`` have mapped."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i != -1:
                        found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def unlink_orphaned_shm(paths: set[str], gone: set[int]) -> list[str]:
    """Unlink each of ``paths`` that no process outside ``gone`` has mapped (the segments
    a SIGKILLed group created: their creators never got to unlink them). Returns them."""
    if not paths:
        return []
    others = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in gone]
    still_used = shm_files(others)
    removed = []
    for path in sorted(paths - still_used):
        try:
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(path)
    return removed
