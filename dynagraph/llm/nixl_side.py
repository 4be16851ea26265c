"""Per-process NIXL set-up for vLLM's NixlConnector: side channel, engine id, etcd record.

Each NIXL-enabled engine needs its own side-channel port (the decode engine connects to
the prefill engine's to exchange agent metadata) and a unique engine id. vLLM reads the
side channel from ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` in its engine-core
process, which inherits this process's environment, so :func:`prepare_nixl` must run
before the engine starts.

Both values are published under the instance's etcd lease at
``/{namespace}/nixl/{component}/{instance_id:x}`` (:func:`nixl_key`), so they vanish
with the process. The decode worker does not need to look them up: the prefill
engine's ``kv_transfer_params`` carry them. They are there for operators and tests.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Literal

from dynagraph.errors import ConfigError

Role = Literal["kv_producer", "kv_consumer", "kv_both"]

QUIET_MODULE = "dynagraph.llm.nixl_quiet"
"""Connector module that removes NIXL's idle busy-spin (see ``nixl_quiet``)."""

HOST = "127.0.0.1"


@dataclass(frozen=True)
class NixlEndpoint:
    """What a peer needs to reach this engine's NIXL agent."""

    engine_id: str
    host: str
    port: int
    role: Role

    def record(self) -> dict[str, Any]:
        return asdict(self)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def nixl_key(namespace: str, component: str, instance_id: int) -> str:
    return f"/{namespace}/nixl/{component}/{instance_id:x}"


def prepare_nixl(
    role: Role,
    *,
    engine_id: str,
    base: dict[str, Any] | None = None,
    quiet: bool = True,
    port: int | None = None,
) -> tuple[dict[str, Any], NixlEndpoint]:
    """The ``kv_transfer_config`` for a NixlConnector engine, and its endpoint.

    Sets ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` in ``os.environ`` (side effect).
    ``base`` (the user's ``kv-transfer-config``) wins over the defaults here, except that
    the role and engine id are always ours. A consumer recomputes locally if a KV load
    fails, so a request survives a prefill worker dying after its hand-off.
    """
    cfg: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }
    if quiet:
        cfg["kv_connector_module_path"] = QUIET_MODULE
    cfg.update(base or {})
    if cfg.get("kv_connector") != "NixlConnector":
        raise ConfigError(
            f"remote prefill needs kv-transfer-config.kv_connector NixlConnector, got "
            f"{cfg.get('kv_connector')!r}", key="kv-transfer-config",
        )
    cfg["kv_role"] = role
    cfg["engine_id"] = engine_id
    port = port or free_loopback_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    return cfg, NixlEndpoint(engine_id=engine_id, host=HOST, port=port, role=role)
