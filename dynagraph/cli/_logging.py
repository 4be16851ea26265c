"""Logging set-up shared by the supervisor and the component processes."""

from __future__ import annotations

import logging
import os

from dynagraph.sdk._context import RequestIdFilter

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def quiet_grpc() -> None:
    """gRPC (under the etcd client) logs every fork at INFO; keep its errors only."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def setup_logging(level: str | None = None) -> None:
    """Log to stderr with the current request id on every line (``DYN_LOG_LEVEL``)."""
    quiet_grpc()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("DYN_LOG_LEVEL", "INFO")).upper())
