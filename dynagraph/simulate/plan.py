"""What to simulate: a served graph's resolved config turned into the simulation's settings.

``dynamo simulate`` resolves the graph and its YAML exactly as ``dynamo serve`` does
(``dynagraph.sdk._config.resolve_config``: the same overrides, the same errors naming
file, component and key); :func:`plan_simulation` then checks that the graph is one the
simulator runs and takes from each component's validated values what its policy needs:

- ``MockerWorker``: the engine args (``MockerEngineArgs``, the vocabulary from ``model``'s
  tokenizer as the served worker takes it), ``publish-kv-events``,
  ``load-metrics-interval``; the engine count is the component's instances
  (``ServiceArgs.workers`` x ``engines-per-process``).
- ``Frontend``: its admission (``max-inflight-requests``, ``max-queued-requests``,
  ``queue-timeout``): requests past the slots wait in a FIFO queue, refused (HTTP 429)
  when it is full or they waited too long.
- ``Processor``: ``router-mode`` and the context it enforces (``max-model-len``, at most
  the engines').
- ``Router`` (optional): its ``RouterConfig``.

How the served graph picks the routing mode, and so the simulation: the Processor sends
its ``router-mode`` with every request and the Router takes the request's mode over its
own ``mode`` (only a live etcd setting beats it), so the Router's ``mode`` key changes
nothing; ``round-robin`` and ``random`` are the Processor's own picks, without the
Router. A plan notes such keys (``notes``) rather than change that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict

from dynagraph.errors import ConfigError, GraphError
from dynagraph.llm.engines.mocker import MockerEngineArgs, Profile, load_profile
from dynagraph.llm.engines.mocker.core import kv_geometry
from dynagraph.llm.engines.mocker.serving import engine_args
from dynagraph.llm.router.config import RouterConfig
from dynagraph.sdk._config import ComponentConfig

SUPPORTED = {
    frozenset({"Frontend", "Processor", "Router", "MockerWorker"}): "graphs.mocker_router",
    frozenset({"Frontend", "Processor", "MockerWorker"}): "graphs.mocker_agg",
}
REAL_ENGINES = {"VllmWorker": "vLLM", "PrefillWorker": "vLLM (prefill)",
                "FfnWorker": "the AFD FFN server"}
NOT_YET = {"MockerPrefillWorker": "disaggregated prefill", "Planner": "the Planner"}
KV_MODES = ("kv", "kv-load")
WORKER = "MockerWorker"


class _WorkerKeys(MockerEngineArgs):
    """The MockerWorker values the simulation reads (its other keys are ignored)."""

    model_config = ConfigDict(extra="ignore", alias_generator=lambda n: n.replace("_", "-"),
                              validate_by_name=True, validate_by_alias=True)

    model: str | None = None
    publish_kv_events: bool = False
    load_metrics_interval: float = 0.1
    remote_prefill: bool = False


@dataclass(frozen=True)
class SimPlan:
    """The settings of one simulation. ``engine_args`` is every engine's (ids added per
    engine); ``mode`` is the routing mode in effect (see the module docstring)."""

    engine_args: MockerEngineArgs
    profile: Profile
    engines: int
    mode: str
    max_model_len: int
    router: RouterConfig | None = None
    publish_kv_events: bool = True
    load_interval_s: float = 0.1
    max_inflight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 30.0
    notes: list[str] = field(default_factory=list)
    """Things the user may not expect (keys with no effect, hits the Router cannot see)."""


def check_graph(target: str, names: Sequence[str]) -> None:
    """Refuse a graph the simulator does not run, naming the component that stops it."""
    for name in names:
        if name in REAL_ENGINES:
            raise GraphError(
                f"{target}: component {name} runs a real engine ({REAL_ENGINES[name]}); "
                f"dynamo simulate runs simulated engines only (MockerWorker): use "
                f"{' or '.join(sorted(SUPPORTED.values()))}")
    for name in names:
        if name in NOT_YET:
            raise GraphError(f"{target}: component {name} ({NOT_YET[name]}) is not simulated "
                             f"yet; dynamo simulate runs {' and '.join(sorted(SUPPORTED.values()))}")
    if frozenset(names) not in SUPPORTED:
        raise GraphError(f"{target}: the components {', '.join(names)} are not a graph dynamo "
                         f"simulate runs ({' and '.join(sorted(SUPPORTED.values()))})")


def plan_simulation(target: str, configs: Mapping[str, ComponentConfig], *,
                    file: str | None = None) -> SimPlan:
    """The plan for a resolved graph config (``ConfigError`` / ``GraphError`` if it
    cannot be simulated)."""
    check_graph(target, list(configs))
    worker = configs[WORKER]
    keys = _WorkerKeys.model_validate(worker.values)
    if keys.remote_prefill:
        raise ConfigError("remote prefill is not simulated yet (no prefill workers in this "
                          "graph either)", file=file, component=WORKER, key="remote-prefill")
    try:
        args = engine_args(keys, WORKER)
        profile = load_profile(args.profile)
        block_size, _ = kv_geometry(args, profile)
    except ConfigError as exc:
        message = str(exc).removeprefix(f"key {exc.key!r}: ") if exc.key else str(exc)
        raise ConfigError(message, file=file, component=WORKER, key=exc.key) from None
    proc: dict[str, Any] = configs["Processor"].values
    if (proc.get("slo-admission") or {}).get("enabled"):
        raise ConfigError("SLO-aware admission is not simulated yet", file=file,
                          component="Processor", key="slo-admission")
    notes: list[str] = []
    mode = str(proc["router-mode"])
    router = RouterConfig.model_validate(configs["Router"].values) if "Router" in configs else None
    if router is None and mode in KV_MODES:
        notes.append(f"Processor.router-mode is {mode} but the graph has no Router: requests "
                     "go round robin, as the served Processor does")
        mode = "round-robin"
    if router is not None:
        if router.mode.value != mode:
            notes.append(f"Router.mode ({router.mode.value}) has no effect: the Processor sends "
                         f"its router-mode ({mode}) with every request and the Router takes it; "
                         f"set --Processor.router-mode to change the routing")
        if router.block_size is not None and router.block_size != block_size:
            notes.append(f"Router.block-size ({router.block_size}) differs from the engines' "
                         f"({block_size}): the Router sees no cache hit")
        if mode in KV_MODES and not keys.publish_kv_events:
            notes.append("MockerWorker.publish-kv-events is false: the Router's index stays "
                         "empty")
    limit = args.max_model_len
    if proc.get("max-model-len") is not None:
        limit = min(limit, int(proc["max-model-len"]))
    front: dict[str, Any] = configs["Frontend"].values
    return SimPlan(engine_args=args, profile=profile, engines=worker.instances, mode=mode,
                   max_model_len=limit, router=router,
                   max_inflight=int(front["max-inflight-requests"]),
                   max_queued=int(front["max-queued-requests"]),
                   queue_timeout_s=float(front["queue-timeout"]), publish_kv_events=keys.publish_kv_events,
                   load_interval_s=keys.load_metrics_interval, notes=notes)
