"""``sweep_group``: what a child's process group left is killed, and the semaphores only
its multiprocessing resource tracker knew are unlinked (the tracker is killed last)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from dynagraph.cli.scaling import Child, sweep_group
from dynagraph.runtime.procfs import group_pids, is_resource_tracker, pid_alive

LEADER = """
import multiprocessing, os, time

def leave_a_semaphore():
    lock = multiprocessing.get_context("spawn").Lock()  # registered with the tracker
    print(lock._semlock.name, flush=True)
    os._exit(0)  # no clean-up: now only the resource tracker knows the name

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=leave_a_semaphore)
    child.start()
    child.join()
    print("ready", flush=True)
    time.sleep(60)
"""


async def test_the_resource_tracker_unlinks_what_it_knows_before_it_is_killed(
        tmp_path: Path) -> None:
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True)
    sem = None
    try:
        assert proc.stdout is not None
        name = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        sem = Path(f"/dev/shm/sem.{name.lstrip('/')}")
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
        assert sem.exists()
        members = group_pids(proc.pid)
        assert proc.pid in members and any(map(is_resource_tracker, members)), members

        await sweep_group(Child("Leader", 0, {}, proc=proc))

        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
        assert not sem.exists()
        assert not any(map(pid_alive, group_pids(proc.pid)))  # zombies wait for init
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if sem is not None:
            sem.unlink(missing_ok=True)
