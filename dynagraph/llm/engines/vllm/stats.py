"""Load numbers from vLLM: a stat logger hook that feeds a thread-safe snapshot.

vLLM v1's ``AsyncLLM`` calls every stat logger's ``record()`` after each engine-core
step with that step's ``SchedulerStats`` (running / waiting requests, KV cache usage
as a fraction, prefix cache queries and hits of the requests scheduled in the step).
``VllmEngine.load()`` reads the latest snapshot. vLLM marks this interface unstable.

Speeds (for the Router's time cost, ``dynagraph.llm.router.rates``): with vLLM's
``enable_logging_iteration_details`` each step's stats also say what the step computed
(prompt tokens, decoding requests). A step's duration is the time from the previous
step's record (the engine was still busy then) or, after the engine went idle, from
the first request's arrival (``request_arrived``), to this record: measured where the
stats arrive, so it holds whichever process runs the engine core (vLLM's own
``elapsed_ms`` only times the forward pass when the core has a separate worker
process). The tracker adds each step to the prefill or the decode counters of
``EngineLoad``. ``requests_total`` counts ``request_arrived`` calls, ``prefilling`` the
requests between that and their first output.

The same hook sees the KV connector's per-step stats (``SchedulerStats.kv_connector_stats``:
vLLM's NixlConnector reports one ``bytes_transferred`` / ``transfer_duration`` pair per
finished NIXL transfer); :func:`kv_transfers` extracts them and the tracker passes each
to its ``on_kv_transfer`` listener (the decode worker's transfer metrics).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dynagraph.llm.engines.base import EngineLoad


class LoadTracker:
    """Latest scheduler numbers, written by vLLM's stat logger hook, read by ``load()``.

    ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._load = EngineLoad()
        self._step_from: float | None = None
        """When the engine's next step began: the previous record while it stays busy,
        else the first arrival after it went idle (``None``: idle, nothing arrived)."""
        self.on_kv_transfer: Callable[[int, float], None] | None = None
        """Called with (bytes, seconds) for each finished KV transfer into this engine."""

    def update(
        self, *, running: int, waiting: int, kv_usage: float, queries: int, hits: int, total: int,
        prefill_tokens: int | None = None, decode_seqs: int = 0,
    ) -> None:
        """One stats record. ``prefill_tokens`` / ``decode_seqs``: what the step that
        produced it computed (``None``: not known, the step is not timed)."""
        now = self._clock()
        with self._lock:
            prev = self._load
            fields: dict[str, Any] = {
                "running": running,
                "waiting": waiting,
                "kv_blocks_used": round(kv_usage * total),
                "kv_blocks_total": total,
                "prefix_cache_queries": prev.prefix_cache_queries + queries,
                "prefix_cache_hits": prev.prefix_cache_hits + hits,
            }
            if prefill_tokens is not None:
                began = self._step_from
                seconds = now - began if began is not None else 0.0
                if began is not None and seconds > 0:
                    if prefill_tokens > 0:
                        fields["prefill_tokens_total"] = prev.prefill_tokens_total + prefill_tokens
                        fields["prefill_seconds_total"] = prev.prefill_seconds_total + seconds
                    elif decode_seqs > 0:
                        fields["decode_steps_total"] = prev.decode_steps_total + 1
                        fields["decode_seconds_total"] = prev.decode_seconds_total + seconds
            # The next step starts now if the engine has work (or a request is on its way
            # to it); an idle engine's next step starts when a request arrives.
            if running + waiting > 0 or prev.prefilling > 0:
                if prefill_tokens is not None:
                    self._step_from = now
            else:
                self._step_from = None
            self._load = prev.model_copy(update=fields)

    def request_arrived(self) -> None:
        """A request was handed to the engine (before its first output)."""
        now = self._clock()
        with self._lock:
            if self._step_from is None:
                self._step_from = now
            load = self._load
            self._load = load.model_copy(update={"prefilling": load.prefilling + 1,
                                                 "requests_total": load.requests_total + 1})

    def request_started(self) -> None:
        """A request that arrived got its first output (or left without one)."""
        with self._lock:
            n = max(self._load.prefilling - 1, 0)
            self._load = self._load.model_copy(update={"prefilling": n})

    def set_total(self, total: int) -> None:
        with self._lock:
            self._load = self._load.model_copy(update={"kv_blocks_total": total})

    def set_limits(self, *, batched_tokens: int, seqs: int) -> None:
        """The scheduler's limits: tokens per step, requests at once (0 = not known)."""
        with self._lock:
            self._load = self._load.model_copy(update={"max_num_batched_tokens": batched_tokens,
                                                       "max_num_seqs": seqs})

    def get(self) -> EngineLoad:
        with self._lock:
            return self._load

    def kv_connector_stats(self, payload: Mapping[str, Any] | None,
                           lookups: Any = None) -> None:
        """One step's connector stats: NIXL transfers go to ``on_kv_transfer``, the host
        pool's counters into the load; ``lookups``: vLLM's ``PrefixCacheStats`` of the
        connectors (its ``hits_by_source`` "host" and "disk" are the pool's and its tier's)."""
        listener = self.on_kv_transfer
        if listener is not None and payload:
            for nbytes, seconds in kv_transfers(payload):
                listener(nbytes, seconds)
        got = pool_counters(payload) if payload else {}
        queries = int(getattr(lookups, "queries", 0) or 0)
        sources = {str(getattr(source, "value", source)): int(n) for source, n
                   in (getattr(lookups, "hits_by_source", None) or {}).items()}
        hits = sum(n for source, n in sources.items() if source in POOL_SOURCES)
        tier_hits = sources.get(TIER_SOURCE, 0)
        if not got and not queries:
            return
        with self._lock:
            load = self._load
            update: dict[str, Any] = {
                "kv_pool_query_tokens": load.kv_pool_query_tokens + queries,
                "kv_pool_hit_tokens": load.kv_pool_hit_tokens + hits,
                "kv_tier_hit_tokens": load.kv_tier_hit_tokens + tier_hits,
                "kv_pool_loaded_bytes": load.kv_pool_loaded_bytes + int(got.get(_LOAD_BYTES, 0)),
                "kv_pool_load_seconds": load.kv_pool_load_seconds + got.get(_LOAD_TIME, 0.0),
                "kv_pool_stored_bytes": load.kv_pool_stored_bytes + int(got.get(_STORE_BYTES, 0)),
                "kv_pool_evictions": load.kv_pool_evictions + int(got.get(_EVICTIONS, 0)),
                "kv_tier_read_bytes": (load.kv_tier_read_bytes
                                       + int(got.get(_TIER_READ_BYTES, 0))),
                "kv_tier_read_seconds": (load.kv_tier_read_seconds
                                         + got.get(_TIER_READ_TIME, 0.0)),
            }
            if _USAGE in got:
                update["kv_pool_usage"] = got[_USAGE]
            self._load = load.model_copy(update=update)


def kv_transfers(payload: Mapping[str, Any]) -> Iterator[tuple[int, float]]:
    """(bytes, seconds) of each finished transfer in a connector stats payload.

    A NixlConnector payload holds parallel lists ``bytes_transferred`` and
    ``transfer_duration``; a MultiConnector's nests one payload per connector.
    Payloads of other connectors yield nothing.
    """
    sizes, durations = payload.get("bytes_transferred"), payload.get("transfer_duration")
    if isinstance(sizes, list) and isinstance(durations, list):
        for nbytes, seconds in zip(sizes, durations, strict=False):
            yield int(nbytes), float(seconds)
        return
    for value in payload.values():
        if isinstance(value, Mapping):
            yield from kv_transfers(value)


POOL_SOURCES = frozenset({"host", "disk"})
"""vLLM's ``CacheHitSource`` values of the host pool and the tier under it."""
TIER_SOURCE = "disk"
"""The ``CacheHitSource`` of vLLM's file-system tier (``kv-offload-dir``)."""

_LOAD_BYTES = "vllm:kv_offload_load_bytes"
_LOAD_TIME = "vllm:kv_offload_load_time"
_STORE_BYTES = "vllm:kv_offload_store_bytes"
_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
_EVICTIONS = "vllm:kv_offload_pool_evictions"  # dynagraph.llm.kv.offload.host_pool.EVICTIONS
_TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"  # tier -> pool (kv-offload-dir)
_TIER_READ_TIME = "vllm:kv_offload_tiering_read_time"
_POOL_KEYS = (_LOAD_BYTES, _LOAD_TIME, _STORE_BYTES, _USAGE, _EVICTIONS, _TIER_READ_BYTES,
              _TIER_READ_TIME)


def pool_counters(payload: Mapping[str, Any]) -> dict[str, float]:
    """The host pool's numbers in one step's connector stats payload: vLLM's
    offloading connector sends ``{"types": ..., "data": {name: {labels: value}}}``
    (a MultiConnector nests one payload per connector). Counters are this step's
    increments; the usage gauge is its latest value."""
    data = payload.get("data")
    if isinstance(data, Mapping) and isinstance(payload.get("types"), Mapping):
        out: dict[str, float] = {}
        for name in _POOL_KEYS:
            series = data.get(name)
            if isinstance(series, Mapping):
                values = [v for v in series.values() if isinstance(v, int | float)]
                if values:
                    out[name] = max(values) if name == _USAGE else float(sum(values))
        return out
    for value in payload.values():
        if isinstance(value, Mapping):
            found = pool_counters(value)
            if found:
                return found
    return {}


def no_prometheus_logger() -> Any:
    """A stand-in for vLLM's own ``PrometheusStatLogger`` that records nothing.

    vLLM adds its Prometheus logger to every engine that logs stats (ours must: the load
    tracker reads them) unless a logger of that class is passed in; its ``record`` runs on
    every engine step. Passed in
    when ``vllm-metrics`` is false.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class _NoPrometheus(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            self.engine_indexes = engine_indexes or [0]

        def record(self, *args: Any, **kwargs: Any) -> None:
            return None

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            return None

        def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
            return None

        def log_engine_initialized(self) -> None:
            return None

        def log(self) -> None:
            return None

    return _NoPrometheus


def make_stat_logger_factory(tracker: LoadTracker, num_blocks: list[int]) -> Any:
    """A vLLM per-engine stat logger factory that feeds ``tracker``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _TrackerStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._config = vllm_config

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            total = num_blocks[0] or (self._config.cache_config.num_gpu_blocks or 0)
            pcs = scheduler_stats.prefix_cache_stats
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is not None and details.is_dummy:
                details = None
            tracker.update(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                kv_usage=scheduler_stats.kv_cache_usage,
                queries=pcs.queries if pcs is not None else 0,
                hits=pcs.hits if pcs is not None else 0,
                total=total,
                prefill_tokens=details.num_ctx_tokens if details is not None else None,
                decode_seqs=details.num_generation_requests if details is not None else 0,
            )
            tracker.kv_connector_stats(
                scheduler_stats.kv_connector_stats,
                getattr(scheduler_stats, "connector_prefix_cache_stats", None))

        def log_engine_initialized(self) -> None:
            return None

    def factory(vllm_config: Any, engine_index: int) -> StatLoggerBase:
        return _TrackerStatLogger(vllm_config, engine_index)

    return factory
