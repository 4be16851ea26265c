"""Load numbers from vLLM: a stat logger hook that feeds a thread-safe snapshot.

vLLM v1's ``AsyncLLM`` calls every stat logger's ``record()`` after each engine-core
step with that step's ``SchedulerStats`` (running / waiting requests, KV cache usage
as a fraction, prefix cache queries and hits of the requests scheduled in the step).
``VllmEngine.load()`` reads the latest snapshot. vLLM marks this interface unstable.

The same hook sees the KV connector's per-step stats (``SchedulerStats.kv_connector_stats``:
vLLM's NixlConnector reports one ``bytes_transferred`` / ``transfer_duration`` pair per
finished NIXL transfer); :func:`kv_transfers` extracts them and the tracker passes each
to its ``on_kv_transfer`` listener (the decode worker's transfer metrics).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dynagraph.llm.engines.base import EngineLoad


class LoadTracker:
    """Latest scheduler numbers, written by vLLM's stat logger hook, read by ``load()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load = EngineLoad()
        self.on_kv_transfer: Callable[[int, float], None] | None = None
        """Called with (bytes, seconds) for each finished KV transfer into this engine."""

    def update(
        self, *, running: int, waiting: int, kv_usage: float, queries: int, hits: int, total: int
    ) -> None:
        with self._lock:
            prev = self._load
            self._load = EngineLoad(
                running=running,
                waiting=waiting,
                kv_blocks_used=round(kv_usage * total),
                kv_blocks_total=total,
                prefix_cache_queries=prev.prefix_cache_queries + queries,
                prefix_cache_hits=prev.prefix_cache_hits + hits,
            )

    def set_total(self, total: int) -> None:
        with self._lock:
            self._load = self._load.model_copy(update={"kv_blocks_total": total})

    def get(self) -> EngineLoad:
        with self._lock:
            return self._load

    def kv_connector_stats(self, payload: Mapping[str, Any] | None) -> None:
        listener = self.on_kv_transfer
        if listener is None or not payload:
            return
        for nbytes, seconds in kv_transfers(payload):
            listener(nbytes, seconds)


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
            tracker.update(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                kv_usage=scheduler_stats.kv_cache_usage,
                queries=pcs.queries if pcs is not None else 0,
                hits=pcs.hits if pcs is not None else 0,
                total=total,
            )
            tracker.kv_connector_stats(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            return None

    def factory(vllm_config: Any, engine_index: int) -> StatLoggerBase:
        return _TrackerStatLogger(vllm_config, engine_index)

    return factory
