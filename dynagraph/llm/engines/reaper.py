"""Kill an engine's helper processes when the process that owns them dies.

vLLM's engine-core (and worker) processes do not exit when their parent is killed
with SIGKILL (seen with vLLM 0.32: they keep running, holding ~2 GiB each). A
:class:`Reaper` is a tiny watchdog process holding the read end of a pipe whose
write end only the owner has. When the owner exits for any reason the pipe closes,
and the watchdog sends SIGTERM, then SIGKILL after a grace period, to the watched
processes that are still the same processes (pid plus start time), then exits.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

_WATCHDOG = r"""
import os, signal, sys, time
import psutil
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the group is the owner's to handle
fd, grace = int(sys.argv[1]), float(sys.argv[2])
targets = [(int(p), float(t)) for p, t in (a.split("@") for a in sys.argv[3:])]
try:
    while os.read(fd, 64):
        pass
except OSError:
    pass
def alive():
    out = []
    for pid, created in targets:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out
for sig in (signal.SIGTERM, signal.SIGKILL):
    procs = alive()
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while procs and time.monotonic() < deadline:
        time.sleep(0.1)
        procs = alive()
    if not procs:
        break
"""


class Reaper:
    """Watch ``pids``; they are terminated when this process exits or :meth:`close` runs."""

    def __init__(self, pids: list[int], *, grace_s: float = 5.0) -> None:
        import psutil

        targets = []
        for pid in pids:
            try:
                targets.append(f"{pid}@{psutil.Process(pid).create_time()!r}")
            except psutil.Error:
                continue
        read_fd, self._write_fd = os.pipe()  # both O_CLOEXEC: no other child inherits them
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(read_fd), str(grace_s), *targets],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(read_fd)
        self.pids = [int(t.split("@")[0]) for t in targets]

    def close(self, timeout_s: float = 15.0) -> None:
        """Terminate what is left of the watched processes and stop the watchdog."""
        if self._write_fd < 0:
            return
        os.close(self._write_fd)
        self._write_fd = -1
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("reaper %d did not finish in %.0fs; killing it", self._proc.pid, timeout_s)
            self._proc.kill()
            self._proc.wait(timeout=timeout_s)


def vllm_descendants() -> list[int]:
    """PIDs of this process's vLLM helper processes (``VLLM::EngineCore``, ``VLLM::Worker``)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("VLLM::"):
                out.append(child.pid)
        except psutil.Error:
            continue
    return out
