"""The vLLM engine: vLLM v1's ``AsyncLLM`` embedded behind the :class:`Engine` protocol.

Importing this module does not import vLLM. :meth:`VllmEngine.start` first sets the
environment vLLM reads (``VLLM_CPU_KVCACHE_SPACE``, ``HF_HUB_OFFLINE``, ...) and only
then imports it. ``AsyncLLM`` always runs its engine core in a child process; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the model runs inside that child instead of a
third process, which starts in a few seconds (good for tests).

KV events: ``kv_events_endpoint`` is handed to vLLM's ZMQ publisher as is. Use
``ipc://PATH``: vLLM binds it and subscribers connect (local only). A
``tcp://HOST:PORT`` endpoint makes vLLM *connect* its PUB socket to a SUB you bound,
which is not supported (events are lost).
Wildcard hosts (``tcp://*``) are refused: they listen on every interface. Each batch
is three frames: topic, 8-byte big-endian sequence number, msgpack payload.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

from dynagraph.errors import ConfigError, EngineError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines.base import EngineLoad, EngineOutput, SamplingSpec
from dynagraph.llm.engines.reaper import Reaper, vllm_descendants
from dynagraph.llm.engines.vllm import forkserver
from dynagraph.llm.engines.vllm.adapter import (
    cpu_build,
    require_supported_vllm,
    start_processes_from,
)
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.compression_guards import (
    guard_compression,
    guard_wire_compression,
)
from dynagraph.llm.engines.vllm.convert import (
    invalid_request,
    to_engine_outputs,
    to_sampling_params,
)
from dynagraph.llm.engines.vllm.env import apply_env
from dynagraph.llm.engines.vllm.kv_config import kv_transfer_config
from dynagraph.llm.engines.vllm.stats import (
    LoadTracker,
    make_stat_logger_factory,
    no_prometheus_logger,
)
from dynagraph.runtime import progress
from dynagraph.runtime.nice import ENGINE_NICE_DIR_ENV, defer_renice, renice

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""Upper bound on model load + engine core start (torch.compile can take a minute)."""
SHUTDOWN_TIMEOUT_S = 30.0
ENGINE_EXIT_WAIT_S = 0.2
"""How long vLLM may wait for its engine-core processes to exit on their own before it
kills them. Left alone, their teardown is a garbage collection over the model runner's
heap that nothing after a shutdown needs; the
shared-memory queue a killed worker leaves is unlinked by multiprocessing's resource
tracker when this process exits (and by ``dynamo serve``'s sweep)."""



class VllmEngine:
    """One vLLM ``AsyncLLM`` serving token-id requests. See :class:`Engine`."""

    def __init__(self, args: VllmEngineArgs) -> None:
        self.args = args
        self._llm: Any = None
        self._tracker = LoadTracker()
        self._num_blocks = [0]
        self._max_model_len = 0
        self._start_seconds = 0.0
        self._in_flight: set[str] = set()
        self._reaper: Reaper | None = None
        self.guard_report: Any = None
        """The host pool codec's quality guard report (``kv-compression``), once passed."""
        self.wire_guard_report: Any = None
        """The wire codec's (``kv-transfer-compression``), once passed."""

    @property
    def started(self) -> bool:
        return self._llm is not None

    @property
    def engine_pids(self) -> list[int]:
        """The processes vLLM started for this engine (engine core, model runner), once up."""
        return list(self._reaper.pids) if self._reaper is not None else []

    @property
    def max_model_len(self) -> int:
        """The context length in tokens (known after :meth:`start`)."""
        return self._max_model_len

    @property
    def start_seconds(self) -> float:
        """How long :meth:`start` took."""
        return self._start_seconds

    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments for ``vllm.AsyncEngineArgs`` (without config objects)."""
        a = self.args
        kwargs: dict[str, Any] = {
            "model": a.model,
            "served_model_name": a.served_model_name,
            "block_size": a.block_size,
            "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "num_gpu_blocks_override": a.num_gpu_blocks_override,
            "enforce_eager": a.enforce_eager,
            "enable_prefix_caching": a.enable_prefix_caching,
            "scheduling_policy": a.scheduling_policy,
            "seed": a.seed,
            "dtype": a.dtype,
            "disable_log_stats": not a.log_stats,
            "enable_log_requests": False,
            "max_logprobs": a.max_logprobs,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        overlap = set(kwargs) & set(a.extra_engine_args)
        if overlap:
            raise ConfigError(
                f"extra-engine-args repeats typed settings {sorted(overlap)}; "
                "set them as top-level keys instead",
                key="extra-engine-args",
            )
        return {**kwargs, **a.extra_engine_args}

    def _build(self) -> Any:
        """Create the AsyncLLM (blocking: loads the model, starts the engine core)."""
        apply_env(self.args)
        from_forkserver = forkserver.wanted(cpu_build(), self.args.engine_processes)
        if from_forkserver:
            forkserver.start()  # it imports vLLM while this process does
        with warnings.catch_warnings():  # vLLM's import trips torch FutureWarnings
            warnings.simplefilter("ignore", FutureWarning)
            from vllm import AsyncEngineArgs
            from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM

        if from_forkserver:
            start_processes_from(forkserver.CONTEXT)
        if current_platform.is_cpu() and self.args.block_size % 32:
            raise ConfigError(
                f"block-size {self.args.block_size} must be a multiple of 32 on the CPU",
                key="block-size",
            )
        kwargs = self.engine_args()
        if self.args.kv_events_endpoint:
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.args.kv_events_endpoint,
                replay_endpoint=self.args.kv_events_replay_endpoint,
                topic=self.args.kv_events_topic,
            )
        transfer = kv_transfer_config(self.args)
        if transfer:
            kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
        if "enable_logging_iteration_details" in getattr(AsyncEngineArgs, "__dataclass_fields__",
                                                         {}):
            # What each step computed, for the step timings in ``load()`` (vLLM logs them
            # only with its own stat loggers on, at INFO).
            kwargs.setdefault("enable_logging_iteration_details", True)
        if self.args.structured_outputs_backend != "none":
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                backend=self.args.structured_outputs_backend,
                disable_any_whitespace=self.args.structured_outputs_disable_any_whitespace,
                disable_additional_properties=(
                    self.args.structured_outputs_disable_additional_properties))
        try:
            engine_args = AsyncEngineArgs(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"bad vLLM engine argument: {exc}") from exc
        loggers = [make_stat_logger_factory(self._tracker, self._num_blocks)]
        if not self.args.vllm_metrics:  # else vLLM adds its Prometheus logger
            loggers.append(no_prometheus_logger())
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)

    async def start(self) -> None:
        """Load the model and start vLLM's engine core, off the event loop.

        Raises :class:`EngineError` at once where the installed vLLM is not a supported
        one (``dynagraph.llm.engines.vllm.adapter.SUPPORTED_VLLM``)."""
        if self._llm is not None:
            return
        require_supported_vllm()  # before anything: it patches vLLM internals of those
        began = time.monotonic()
        progress.report("loading", f"vLLM engine for {self.args.model}: importing vLLM")
        helpers_before = set(vllm_descendants())
        built: list[Any] = []  # not a return value: a thread pool future would keep it alive
        building = asyncio.get_running_loop().run_in_executor(
            None, lambda: built.append(self._build())
        )
        try:
            await asyncio.wait_for(asyncio.shield(building), START_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The build thread cannot be stopped; shut its engine down when it finishes.
            building.add_done_callback(lambda _: [llm.shutdown() for llm in built])
            if isinstance(exc, TimeoutError):
                raise EngineError(
                    f"vLLM did not start within {START_TIMEOUT_S:.0f}s for {self.args.model}"
                ) from exc
            raise
        except ConfigError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM failed to start for {self.args.model}: {exc}") from exc
        llm = self._llm = built.pop()
        # vLLM's helper processes outlive a SIGKILLed owner; a watchdog ends them.
        self._reaper = Reaper(sorted(set(vllm_descendants()) - helpers_before))
        if (nice_dir := os.environ.get(ENGINE_NICE_DIR_ENV)) and self.engine_pids:
            defer_renice(self.engine_pids, self.args.engine_nice, nice_dir)
            log.info("engine processes %s: niceness left to dynamo serve's core keeper "
                     "(+%d where they share cores with the graph)", self.engine_pids,
                     self.args.engine_nice)
        elif self.args.engine_nice:
            threads = renice(self.engine_pids, self.args.engine_nice)
            log.info("engine processes %s: niceness +%d on %d threads", self.engine_pids,
                     self.args.engine_nice, threads)
        self._max_model_len = int(llm.model_config.max_model_len)
        self._num_blocks[0] = int(llm.vllm_config.cache_config.num_gpu_blocks or 0)
        self._tracker.set_total(self._num_blocks[0])
        scheduler = llm.vllm_config.scheduler_config
        self._tracker.set_limits(batched_tokens=int(scheduler.max_num_batched_tokens or 0),
                                 seqs=int(scheduler.max_num_seqs or 0))
        if self.args.kv_offload_gib > 0 and self.args.kv_compression != "none":
            self.guard_report = await guard_compression(self, llm)
        if self.args.kv_transfer_compression != "none":
            self.wire_guard_report = await guard_wire_compression(self, llm)
        if self.args.warmup:
            await self._warm_up()
        self._start_seconds = time.monotonic() - began
        log.info(
            "vLLM engine ready in %.1fs: model %s, %d KV blocks of %d tokens, context %d",
            self._start_seconds,
            self.args.model,
            self._num_blocks[0],
            self.args.block_size,
            self._max_model_len,
        )

    async def _warm_up(self) -> None:
        """Run one short request through the engine before anyone can send one: the
        first request an engine serves pays for lazy set-up on the request path, and
        on a loaded box that showed as a burst of late first tokens when load began.
        Prompt and output together stay shorter than one block, so no block is ever
        full: nothing enters the prefix cache or a KV pool, and no KV event goes out."""
        progress.report("loading", f"vLLM engine for {self.args.model}: warm-up request")
        began = time.monotonic()
        half = max(self.args.block_size // 2, 1)
        prompt = [1 + i for i in range(half)]
        out_tokens = max(self.args.block_size - half - 1, 1)
        async for _ in self.generate(f"warmup-{os.getpid()}", prompt,
                                     SamplingSpec(max_tokens=out_tokens, temperature=0.0,
                                                  ignore_eos=True)):
            pass
        log.info("warm-up request: %.0f ms", (time.monotonic() - began) * 1000)

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._in_flight:  # their streams end with finish_reason "abort"
            await llm.abort(list(self._in_flight))
        # Stop vLLM's output handler before its engine core goes away; otherwise it
        # logs the core's exit as an EngineDeadError.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task):
            handler.cancel()
            await asyncio.wait([handler], timeout=SHUTDOWN_TIMEOUT_S)
        try:
            await asyncio.wait_for(asyncio.to_thread(llm.shutdown, ENGINE_EXIT_WAIT_S),
                                   SHUTDOWN_TIMEOUT_S)
        finally:
            reaper, self._reaper = self._reaper, None
            if reaper is not None:
                await asyncio.to_thread(reaper.close)
        log.info("vLLM engine for %s shut down", self.args.model)

    def load(self) -> EngineLoad:
        return self._tracker.get()

    def observe_kv_transfers(self, listener: Callable[[int, float], None] | None) -> None:
        """Call ``listener(bytes, seconds)`` for each KV transfer this engine receives
        (vLLM's KV connector stats; NixlConnector only)."""
        self._tracker.on_kv_transfer = listener

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def _check(self, prompt_token_ids: list[int]) -> None:
        if self._llm is None:
            raise EngineError("the vLLM engine is not started (call start() first)")
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self._max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self._max_model_len} tokens including at least one generated token",
                param="prompt",
                code="context_length_exceeded",
            )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineOutput]:
        self._check(prompt_token_ids)
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        if request_id in self._in_flight:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        if sampling.structured_outputs is not None and (
                self.args.structured_outputs_backend == "none"):
            raise InvalidRequest("this worker has structured outputs turned off "
                                 "(structured-outputs-backend: none)", param="response_format")
        try:
            params = to_sampling_params(sampling, kv_transfer_params)
        except VLLMClientError as exc:
            raise invalid_request(exc) from exc
        try:
            prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
            if sampling.cache_salt:
                prompt["cache_salt"] = sampling.cache_salt
            (engine_input,) = self._llm.renderer.render_cmpl([prompt])
        except VLLMClientError as exc:
            raise invalid_request(exc) from exc
        priority = sampling.priority if self.args.scheduling_policy == "priority" else 0
        self._tracker.request_arrived()
        started = False
        stream = self._llm.generate(engine_input, params, request_id, priority=priority)
        self._in_flight.add(request_id)
        try:
            async for out in stream:
                if not started:
                    started = True
                    self._tracker.request_started()
                for output in to_engine_outputs(out, len(prompt_token_ids)):
                    yield output
        except VLLMClientError as exc:
            raise invalid_request(exc) from exc
        except (InvalidRequest, EngineError, asyncio.CancelledError, GeneratorExit):
            raise
        except ValueError as exc:  # vLLM's request validation (e.g. a bad JSON schema)
            raise InvalidRequest(f"vLLM refused request {request_id}: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"vLLM failed request {request_id}: {exc}") from exc
        finally:
            # Closing vLLM's generator aborts the request in the engine core if it
            # has not finished (consumer cancelled us or stopped iterating).
            self._in_flight.discard(request_id)
            if not started:
                self._tracker.request_started()
            await stream.aclose()
