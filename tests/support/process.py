"""A child process in its own session whose output the test reads line by line."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from dynagraph.runtime.procfs import pid_alive
from tests.support.paths import REPO

__all__ = ["OutputProcess", "pid_alive"]


class OutputProcess:
    """``argv`` started in its own session (so its whole group can be killed), stdout and
    stderr collected in ``lines``. ``stop()`` sends SIGTERM, then SIGKILL to the group."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 60.0) -> str:
        """The first output line containing ``needle`` (fails if the process exits first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line containing {needle!r}; output:\n{self.output()}")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM; SIGKILL to the whole group after ``timeout``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        return self.proc.returncode
