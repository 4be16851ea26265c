"""Whether a process is still there, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os

__all__ = ["group_pids", "is_resource_tracker", "pid_alive", "process_name", "shm_files",
           "unlink_orphaned_shm"]


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


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm`` (``?`` if the process is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "?"


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


DELETED = " (deleted)"
"""How ``/proc/<pid>/maps`` marks a file whose mapped name is no longer linked."""


def shm_files(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes ``pids`` have mapped, by the names they have now.

    A POSIX named semaphore (multiprocessing's ``/dev/shm/sem.mp-*``, vLLM's engine core
    makes some) is mapped under the temporary name glibc created it with before it gave
    the file its own: the map says ``/dev/shm/sem.XXXXXX (deleted)``. Such a file is found
    by its inode among ``/dev/shm``'s entries."""
    found: set[str] = set()
    renamed: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i == -1:
                        continue
                    path = line[i:].rstrip("\n")
                    if path.endswith(DELETED):
                        renamed.add(int(line.split(maxsplit=5)[4]))
                    else:
                        found.add(path)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    if renamed:
        found |= _names_of(renamed)
    return found


def _names_of(inodes: set[int], root: str = "/dev/shm") -> set[str]:
    """The entries directly in ``root`` whose inode is one of ``inodes``."""
    try:
        with os.scandir(root) as entries:
            return {e.path for e in entries
                    if e.inode() in inodes and e.is_file(follow_symlinks=False)}
    except OSError:
        return set()


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker: once the last process that
    registered a semaphore or segment with it is gone, it unlinks what they left, then
    exits."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


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
