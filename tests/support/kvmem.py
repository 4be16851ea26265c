"""Which processes map which engines' shared KV caches (``kv-transport: shm``)."""

from __future__ import annotations

import psutil


def kv_memfd_inodes(root_pid: int) -> dict[int, set[int]]:
    """pid -> inodes of the ``memfd:dynagraph-kv`` regions it maps, for ``root_pid`` and
    its descendants (an engine maps its own cache; a decode engine also its peers')."""
    root = psutil.Process(root_pid)
    out: dict[int, set[int]] = {}
    for proc in (root, *root.children(recursive=True)):
        try:
            with open(f"/proc/{proc.pid}/maps") as fh:
                inodes = {int(line.split()[4]) for line in fh if "/memfd:dynagraph-kv" in line}
        except OSError:
            continue
        if inodes:
            out[proc.pid] = inodes
    return out
