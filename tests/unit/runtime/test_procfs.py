"""Process groups, their shared-memory segments, and removing the ones a killed group left."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

from dynagraph.runtime.procfs import group_pids, pid_alive, shm_files, unlink_orphaned_shm

HOLDER = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(60)
"""


def _segment() -> Path:
    path = Path(f"/dev/shm/dynagraph-test-{uuid.uuid4().hex}")
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_killed_group_s_segment_is_removed_and_a_shared_one_kept() -> None:
    own, shared = _segment(), _segment()
    group = subprocess.Popen([sys.executable, "-c", HOLDER, str(own)], start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
    with open(shared, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # this process maps it
        try:
            assert group.stdout is not None and group.stdout.readline().strip() == "mapped"
            members = set(group_pids(group.pid))
            assert members == {group.pid} and pid_alive(group.pid)
            assert shm_files([group.pid]) == {str(own)}
            removed = unlink_orphaned_shm({str(own), str(shared)}, members)
            assert removed == [str(own)] and not own.exists() and shared.exists()
        finally:
            os.killpg(group.pid, 9)
            group.wait()
            own.unlink(missing_ok=True)
            shared.unlink(missing_ok=True)
    assert not pid_alive(group.pid)


def test_a_semaphore_is_found_under_its_own_name() -> None:
    """glibc maps a named semaphore under the temporary name it was created with."""
    lock = multiprocessing.get_context("spawn").Lock()
    name = lock._semlock.name  # type: ignore[attr-defined]
    path = f"/dev/shm/sem.{name.lstrip('/')}"
    try:
        assert path in shm_files([os.getpid()])
    finally:
        del lock  # unlinks it
    assert not Path(path).exists()
