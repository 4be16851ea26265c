"""The AFD file that tells the engine process where its FfnWorkers are.

vLLM builds the model inside its engine-core process, which the VllmWorker cannot
reach with Python calls. So the VllmWorker (``dynagraph.llm.afd.peers``) writes one
JSON file, ``AfdEngineConfig``, before the engine starts and rewrites it (atomically:
temp file + rename) whenever FfnWorkers come or go in etcd; its path reaches the model
as ``hf_overrides={"afd_config_path": PATH}`` (together with the AFD architecture
name). The connector in the engine reads it at start and again whenever its
modification time changed (checked once per forward pass) or a call failed.

``AfdOptions`` are the user-facing knobs (the VllmWorker's ``afd`` config section);
``AfdEngineConfig`` is those plus the live peer list.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dynagraph.config import ConfigModel

TransportKind = Literal["auto", "shm", "tcp"]


class PeerInfo(BaseModel):
    """One live FfnWorker as published in its discovery metadata (``afd`` key)."""

    model_config = ConfigDict(extra="forbid")

    instance: str
    """Its instance id (hex)."""
    model: str
    tcp: str
    """``host:port`` of its TCP listener."""
    uds: str | None = None
    """Its abstract Unix socket (``@name``), for the same-host shared-memory transport."""
    host: str = ""
    """Its host's boot id: shared memory only between equal ones."""
    layers: list[int]
    experts: list[int] | None = None
    """None: the whole FFN of each of its layers; else the experts it holds."""


class AfdOptions(ConfigModel):
    """How the engine talks to its FfnWorkers (YAML: the VllmWorker's ``afd`` section)."""

    transport: TransportKind = "auto"
    """``shm`` (same host: shared memory + a Unix socket), ``tcp``, or ``auto`` (shm
    when the FfnWorker runs on this host, else tcp)."""
    ping_pong: bool = True
    """Split a batch of several requests into two micro-batches, so one micro-batch's
    attention runs while the FfnWorkers compute the other's FFN."""
    microbatch_min_tokens: int = Field(default=2, ge=1)
    """Smallest micro-batch worth splitting off; smaller batches run as one."""
    call_timeout_s: float = Field(default=10.0, gt=0)
    """Longest wait for one FFN result before the FfnWorker counts as failed."""
    failover_timeout_s: float = Field(default=30.0, ge=0)
    """How long a forward pass waits for some FfnWorker to serve a layer whose workers
    all failed (a restarted one registering, say) before it fails with AfdUnavailable."""
    wait_for_workers_s: float = Field(default=180.0, gt=0)
    """How long the VllmWorker waits at start for FfnWorkers covering every layer."""


class AfdEngineConfig(AfdOptions):
    """Everything the engine-side connector reads from the AFD file."""

    model: str
    peers: list[PeerInfo] = Field(default_factory=list)
    error_file: str | None = None
    """Where the connector writes why it gave up (``EngineFailure``; the VllmWorker
    reports it and restarts the engine once other workers cover every layer)."""
    stats_file: str | None = None
    """Where the connector publishes its ``ExchangeStats`` (JSON, now and then)."""


class EngineFailure(BaseModel):
    """Why the engine's connector gave up: ``reason`` for callers, ``failed`` (the
    FfnWorker instances it found dead) so the VllmWorker does not restart the engine
    onto them while their etcd records outlive them (until their lease expires)."""

    reason: str
    failed: list[str] = Field(default_factory=list)


def write_failure(path: Path, failure: EngineFailure) -> None:
    write_atomic(path, failure.model_dump_json())


def read_failure(path: Path) -> EngineFailure | None:
    """The failure recorded at ``path``; None when there is none (or it cannot be read)."""
    try:
        return EngineFailure.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s content in one rename (readers never see half a file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_engine_config(path: Path, config: AfdEngineConfig) -> None:
    write_atomic(path, config.model_dump_json(indent=1))


def read_engine_config(path: Path) -> AfdEngineConfig:
    return AfdEngineConfig.model_validate(json.loads(path.read_text()))
