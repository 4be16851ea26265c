"""Logging set-up shared by the supervisor and the component processes."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from dynagraph.sdk._context import RequestIdFilter

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def quiet_grpc() -> None:
    """gRPC (under the etcd client) logs every fork at INFO; keep its errors only."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


LEVELS = ("debug", "info", "warning", "error")


QUIET_VLLM = "DYN_QUIET_VLLM"
"""Set in a child's environment when ``dynamo serve`` chose vLLM's level (not the user)."""


def child_log_env(level: str, environ: dict[str, str]) -> dict[str, str]:
    """The logging environment of a component process for ``dynamo serve --log-level``.

    Our loggers get ``level``. vLLM's (``VLLM_LOGGING_LEVEL``, read by its engine-core
    processes too) get INFO at level info: ``dynamo serve`` shows the few INFO lines
    that mark start-up steps as progress lines and hides the other ~80 per engine
    (`dynagraph.cli.startup`); at debug everything is shown. A ``VLLM_LOGGING_LEVEL``
    the user set wins, and then nothing of vLLM's is hidden.
    """
    env = {"DYN_LOG_LEVEL": level.upper()}
    if "VLLM_LOGGING_LEVEL" not in environ:
        env["VLLM_LOGGING_LEVEL"] = {"debug": "DEBUG", "info": "INFO"}.get(level, "WARNING")
        env[QUIET_VLLM] = "1"
    if level != "debug":
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def quiet_vllm(child_env: dict[str, str]) -> bool:
    """True when vLLM's INFO lines in this child's output are ours to hide."""
    return child_env.get(QUIET_VLLM) == "1"


def setup_logging(level: str | None = None) -> None:
    """Log to stderr with the current request id on every line (``DYN_LOG_LEVEL``)."""
    quiet_grpc()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("DYN_LOG_LEVEL", "INFO")).upper())


def exit_now(code: int) -> NoReturn:
    """Flush the logs and the standard streams and exit without interpreter finalization,
    whose garbage collection over torch/vLLM objects took 0.4 s (an idle ``dynamo serve``)
    to 3+ s (a component with an engine). Only once everything is stopped and unregistered.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
