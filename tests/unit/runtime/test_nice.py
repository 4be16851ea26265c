"""dynagraph.runtime.nice: every thread of the given processes, capped at 19."""

from __future__ import annotations

import os
import subprocess
import sys

from dynagraph.runtime.nice import renice

CHILD = ("import threading, time\n"
         "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
         "print('up', flush=True); time.sleep(30)\n")


def _nices(pid: int) -> list[int]:
    return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task"))


def test_every_thread_of_the_process_is_reniced_and_capped() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert renice([child.pid], 5) == 2
        assert _nices(child.pid) == [min(19, base + 5)] * 2
        renice([child.pid], 30)
        assert _nices(child.pid) == [19, 19]
        assert renice([child.pid], 0) == 0
    finally:
        child.kill()
        child.wait()
    assert renice([child.pid], 3) == 0  # gone: skipped
