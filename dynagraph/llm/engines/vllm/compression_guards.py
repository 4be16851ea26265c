"""The start-up quality guards of a ``VllmEngine`` whose KV goes through a lossy codec:
the host pool's (``kv-compression``) and the NIXL wire's (``kv-transfer-compression``).

``VllmEngine.start`` calls them once vLLM is up and before the warm-up request, each
only where its codec is on; the calibration and the verdict are
``dynagraph.llm.kv.quality_guard``'s. Callers may rely on: each returns the passed
report (the engine keeps it as ``guard_report`` / ``wire_guard_report``); on a failed
guard, a misconfiguration (``ConfigError``) or any other error the engine is shut down
before the exception propagates, so the worker refuses to start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dynagraph.errors import ConfigError
from dynagraph.runtime import progress

if TYPE_CHECKING:
    from dynagraph.llm.engines.vllm.engine import VllmEngine
    from dynagraph.llm.kv.quality_guard import GuardReport

log = logging.getLogger(__name__)


async def _judged(engine: VllmEngine, calibrated: Callable[[], Awaitable[Any]]) -> Any:
    """``calibrated()``'s quality guard report, checked against this worker's limits;
    the engine is shut down if it or the check raises (the worker refuses to start)."""
    from dynagraph.llm.kv.quality_guard import check

    try:
        report = await calibrated()
        check(report, max_divergence=engine.args.kv_compression_max_divergence,
              min_agreement=engine.args.kv_compression_min_agreement)
    except BaseException:
        await engine.shutdown()
        raise
    return report


async def guard_compression(engine: VllmEngine, llm: Any) -> GuardReport:
    """Run the lossy pool codec's quality guard on ``engine`` (whose vLLM ``AsyncLLM``
    is ``llm``); refuse to start if it fails."""
    from dynagraph.llm.kv.quality_guard import calibrate

    progress.report("loading", f"kv-compression {engine.args.kv_compression}: quality guard")

    async def calibrated() -> GuardReport:
        report = await calibrate(engine, engine.args.kv_compression, engine.args.block_size,
                                 llm.reset_prefix_cache)
        log.info("quality guard: %s", report.summary())
        return report

    report: GuardReport = await _judged(engine, calibrated)
    return report


async def guard_wire_compression(engine: VllmEngine, llm: Any) -> GuardReport:
    """Run the NIXL wire codec's quality guard on ``engine`` (whose vLLM ``AsyncLLM`` is
    ``llm``); refuse to start if it fails."""
    from dynagraph.llm.kv.quality_guard import WIRE_KEY, calibrate_wire
    from dynagraph.llm.kv.transfer.wire_codec import ROUNDTRIP_RPC

    codec = engine.args.kv_transfer_compression
    progress.report("loading", f"{WIRE_KEY} {codec}: quality guard")

    async def calibrated() -> GuardReport:
        if not (engine.args.kv_transfer_config or {}).get("kv_connector_module_path"):
            raise ConfigError(f"{WIRE_KEY} {codec} compresses a remote prefill's KV on "
                              "the NIXL wire: this engine has no NIXL connector (set it "
                              "on the disaggregated graphs' VllmWorker and PrefillWorker)",
                              key=WIRE_KEY)
        if not engine.args.enable_prefix_caching:
            raise ConfigError(f"{WIRE_KEY}'s quality guard serves its calibration "
                              "prompts from the prefix cache: set enable-prefix-caching",
                              key=WIRE_KEY)
        moved: list[int] = []
        took: list[float] = []

        async def roundtrip() -> None:
            began = time.monotonic()
            moved.extend(await llm.collective_rpc(ROUNDTRIP_RPC))
            took.append(time.monotonic() - began)

        report = await calibrate_wire(engine, codec, engine.args.block_size, roundtrip)
        log.info("quality guard: %s (%.2f GiB of KV round-tripped in %.1f s)",
                 report.summary(), sum(moved) / 2**30, sum(took))
        if sum(moved) <= 0:
            raise ConfigError(f"{WIRE_KEY} {codec}: the engine's KV is not in a wire "
                              "shadow (it needs a 16-bit KV cache)", key=WIRE_KEY)
        return report

    report: GuardReport = await _judged(engine, calibrated)
    return report
