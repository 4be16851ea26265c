"""Per-process NIXL set-up for vLLM's NixlConnector: side channel, engine id, etcd record.

Each NIXL-enabled engine needs its own side-channel port (the decode engine connects to
the prefill engine's to exchange agent metadata) and a unique engine id. vLLM reads the
side channel from ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` in its engine-core
process, which inherits this process's environment, so :func:`prepare_nixl` must run
before the engine starts.

The side channel binds this host's address (``DYNAMO_HOST``, default 127.0.0.1; see
``dynagraph.runtime.addresses``), so a decode engine on another host can reach it.

Both values are published under the instance's etcd lease at
``/{namespace}/nixl/{component}/{instance_id:x}`` (:func:`nixl_key`), so they vanish
with the process. These records are how peers find each other's agents: a decode worker
takes the prefill engine's side channel from the prefill instance's record
(``dynagraph.llm.kv.transfer.nixl_peers``), not from the host and port inside the prefill
engine's ``kv_transfer_params``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from dynagraph.errors import ConfigError
from dynagraph.llm.kv.transfer.nixl_settle import DEFAULT_SETTLE_US
from dynagraph.llm.kv.transfer.nixl_settle import ENV as SETTLE_ENV
from dynagraph.llm.kv.transfer.switches import KV_SHM as SHM_ENV
from dynagraph.llm.kv.transfer.switches import KV_WIRE_CODEC as WIRE_CODEC_ENV
from dynagraph.runtime.addresses import host_from_env
from dynagraph.runtime.infra import free_port

Role = Literal["kv_producer", "kv_consumer", "kv_both"]

CONNECTOR_MODULE = "dynagraph.llm.kv.transfer.nixl_connector"
"""Our NIXL connector module (vLLM's NixlConnector without the idle busy-spin, with the
shared-memory and wire-codec wiring): ``kv_connector_module_path``."""

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""``0`` (set by :func:`prepare_nixl` unless already set): vLLM's single-process executor,
the model runner inside the engine-core process. With a separate worker process per
engine (one core bound each) every remote prefill's NIXL handshake waited out the
prefill side's 30 s KV lease; in-process it takes ~0.3 s once, then ~0.06 s.
(``AsyncLLM`` keeps its engine core in a process of its own either way.)"""

DELAY_ENV = "DYNAGRAPH_NIXL_PROGRESS_DELAY_US"
"""How ``nixl_connector`` (in the engine-core process) learns the progress thread's delay."""
DEFAULT_DELAY_US = 10_000
"""The NIXL progress thread's poll timeout; it wakes on UCX events before that."""


@dataclass(frozen=True)
class NixlEndpoint:
    """What a peer needs to reach this engine's NIXL agent."""

    engine_id: str
    host: str
    port: int
    role: Role

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _micros_from_env(environ: Any, name: str, default: int) -> int:
    """A non-negative count of microseconds from ``environ[name]`` (``default`` when unset
    or not an integer; 0 when negative)."""
    raw = str(environ.get(name, default)).strip()
    try:
        return max(int(raw), 0)
    except ValueError:
        return default


def progress_delay_from_env(environ: Any = os.environ) -> int:
    """``DYNAGRAPH_NIXL_PROGRESS_DELAY_US`` in microseconds (default on a bad value)."""
    return _micros_from_env(environ, DELAY_ENV, DEFAULT_DELAY_US)


def settle_budget_from_env(environ: Any = os.environ) -> float:
    """``DYNAGRAPH_NIXL_SETTLE_US`` in seconds (default on a bad value), for ``nixl_connector``."""
    return _micros_from_env(environ, SETTLE_ENV, DEFAULT_SETTLE_US) / 1e6


def delayed_agent_config(base: type, delay_us: int) -> type:
    """A subclass of NIXL's ``nixlAgentConfig`` binding that turns the ``pthrDelay = 0``
    ``nixl._api`` hard-codes into ``delay_us`` (the agent reads it once, when made).

    Idempotent: given its own result it only updates the delay.
    """
    if getattr(base, "__dynagraph_delay__", None) is not None:
        base.__dynagraph_delay__ = delay_us  # type: ignore[attr-defined]
        return base

    class DelayedAgentConfig(base):  # type: ignore[misc]  # base: a pybind11 class known at run time
        __dynagraph_delay__ = delay_us

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = type(self).__dynagraph_delay__
            super().__setattr__(name, value)

    return DelayedAgentConfig


def nixl_key(namespace: str, component: str, instance_id: int) -> str:
    return f"/{namespace}/nixl/{component}/{instance_id:x}"


def prepare_nixl(
    role: Role,
    *,
    engine_id: str,
    base: dict[str, Any] | None = None,
    progress_delay_us: int = DEFAULT_DELAY_US,
    settle_us: int = DEFAULT_SETTLE_US,
    port: int | None = None,
    host: str | None = None,
    shared_memory: bool = False,
    wire_codec: str = "none",
) -> tuple[dict[str, Any], NixlEndpoint]:
    """The ``kv_transfer_config`` for a NixlConnector engine, and its endpoint.

    Sets ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``, ``DYNAGRAPH_NIXL_PROGRESS_DELAY_US``
    (``progress_delay_us``, for ``nixl_connector``), ``DYNAGRAPH_NIXL_SETTLE_US`` (``settle_us``:
    how long a step polls the reads it posted, ``nixl_settle``), ``DYNAGRAPH_KV_SHM``
    (``shared_memory``: the engine's KV cache in shared memory, ``shm_direct``),
    ``DYNAGRAPH_KV_WIRE_CODEC`` (``wire_codec``: the KV encoded on the NIXL wire,
    ``wire_codec``) and, unless set, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (see
    ``IN_PROCESS_ENV``) in ``os.environ`` (side effect).
    ``base`` (the user's ``kv-transfer-config``) wins over the defaults here, except that
    the role and engine id are always ours. A consumer recomputes locally if a KV load
    fails, so a request survives a prefill worker dying after its hand-off. The side
    channel binds ``host`` (default: this host's address, ``DYNAMO_HOST``).
    """
    cfg: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_module_path": CONNECTOR_MODULE,
    }
    cfg.update(base or {})
    if cfg.get("kv_connector") != "NixlConnector":
        raise ConfigError(
            f"remote prefill needs kv-transfer-config.kv_connector NixlConnector, got "
            f"{cfg.get('kv_connector')!r}", key="kv-transfer-config",
        )
    cfg["kv_role"] = role
    cfg["engine_id"] = engine_id
    host = host or host_from_env()
    port = port or free_port(host)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ[DELAY_ENV] = str(progress_delay_us)
    os.environ[SETTLE_ENV] = str(settle_us)
    os.environ[SHM_ENV] = "1" if shared_memory else "0"
    os.environ[WIRE_CODEC_ENV] = wire_codec
    os.environ.setdefault(IN_PROCESS_ENV, "0")
    return cfg, NixlEndpoint(engine_id=engine_id, host=host, port=port, role=role)
