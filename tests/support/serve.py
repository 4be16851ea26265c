"""Run ``dynamo serve`` as a real subprocess (as users do) and read its output.

    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0"],
                graph_env(etcd_url, nats_url)) as graph:
        httpx.post(graph.url() + "/v1/completions", ...)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO
from tests.support.process import OutputProcess

__all__ = ["REPO", "ServeProcess", "graph_env", "keep_graph_log", "served"]

GRAPH_LOG_ENV = "DYNAGRAPH_TEST_GRAPH_LOG"
"""Set to a file path to keep a served graph's whole output (post-mortems of CI runs), or
to an existing directory to keep every served graph's, one file each."""


def keep_graph_log(name: str, text: str) -> None:
    """``text`` (a served graph's output) where ``DYNAGRAPH_TEST_GRAPH_LOG`` says, if set."""
    where = os.environ.get(GRAPH_LOG_ENV)
    if not where:
        return
    path = Path(where)
    if path.is_dir():
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
        path = path / f"{time.strftime('%H%M%S')}-{os.getpid()}-{slug}.log"
    path.write_text(text)


def graph_env(etcd_url: str, nats_url: str, *, in_process_engines: bool = False) -> dict[str, str]:
    """The environment of a served graph using these etcd and NATS.

    As served by default: the test environment's ``VLLM_ENABLE_V1_MULTIPROCESSING`` is
    not passed on, so each component chooses as in production (the disagg tests once
    passed with it set for every engine while every served remote prefill stalled).
    ``in_process_engines`` sets it to 0: faster engine start-up, not the production layout.
    """
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if in_process_engines:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class ServeProcess(OutputProcess):
    """``dynamo serve ARGS`` in its own session; its output is collected in ``lines``."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__([sys.executable, "-m", "dynagraph.cli.main", "serve", *args], env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.wait_for_line("dynamo serve: graph ", timeout)

    def dump_tasks(self, timeout: float = 5.0) -> str:
        """Every component's asyncio tasks and threads (SIGUSR1, see
        ``dynagraph.observability.task_dump``), as the graph printed them: for the
        assertion message of a test whose requests hang."""
        import psutil

        before = len(self.output())
        children = [c for c in psutil.Process(self.pid).children()
                    if "dynagraph.cli.child" in " ".join(c.cmdline())]
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while (self.output()[before:].count("asyncio tasks") < len(children)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        return self.output()[before:]

    def metrics_addresses(self, component: str) -> list[str]:
        """Each ``component`` instance's metrics address (``host:port``), from the ready
        banner, in its order."""
        return [m.group(1) for line in self.lines if f"{component}[" in line
                and " pid=" in line and (m := re.search(r"metrics=(\S+)", line))]

    def url(self) -> str:
        """The Frontend URL printed in the ready banner."""
        m = re.search(r"url=(http://\S+)", self.output())
        if m is None:
            raise AssertionError(f"no url in output:\n{self.output()}")
        return m.group(1)


@contextlib.contextmanager
def served(args: list[str], env: dict[str, str], *, ready_timeout: float = 300.0,
           stop_timeout: float = 30.0, clean_exit: bool = True) -> Iterator[ServeProcess]:
    """``dynamo serve ARGS`` until the block ends: ready first, stopped (SIGTERM) after.

    With ``clean_exit`` the graph must stop with exit code 0. The output goes to the
    file named by ``DYNAGRAPH_TEST_GRAPH_LOG`` when that is set. ``dynamo serve`` gets the
    same ``--ready-timeout`` (vLLM engines can take minutes to start on a busy 2-core box).
    """
    sp = ServeProcess([*args, f"--ready-timeout={ready_timeout:g}"], env)
    try:
        sp.wait_ready(ready_timeout)
        yield sp
    finally:
        code = sp.stop(timeout=stop_timeout)
        keep_graph_log(args[0] if args else "graph", sp.output())
        if clean_exit:
            assert code == 0, sp.output()[-3000:]
