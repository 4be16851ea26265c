"""Reaper: helper processes die with their owner, even when the owner is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dynagraph.llm.engines.reaper import Reaper

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


def wait_gone(pid: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running after {within_s}s")


def test_close_terminates_the_watched_processes() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        reaper = Reaper([child.pid], grace_s=2.0)
        assert reaper.pids == [child.pid]
        reaper.close()
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_sigkilled_owner_takes_its_helpers_along() -> None:
    owner_code = (
        "import subprocess, sys, time\n"
        "from dynagraph.llm.engines.reaper import Reaper\n"
        "helper = subprocess.Popen(['sleep', '60'])\n"
        "reaper = Reaper([helper.pid], grace_s=2.0)\n"
        "print(helper.pid, reaper._proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    helper_pid = watchdog_pid = 0
    try:
        assert owner.stdout is not None
        helper_pid, watchdog_pid = map(int, owner.stdout.readline().split())
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        wait_gone(helper_pid, within_s=10)
        wait_gone(watchdog_pid, within_s=10)
    finally:
        for pid in (owner.pid, helper_pid, watchdog_pid):
            if pid and psutil.pid_exists(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
