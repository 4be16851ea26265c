"""``EngineCore``: one simulated engine's state and step pricing, with no clock and no I/O.

What a ``MockerEngine`` is apart from its asyncio task: the geometry (KV blocks and their
size, from the args and the profile), the block hasher, the :class:`Scheduler`, the step
counters and the load report. The served engine (``engine.py``) waits out each step's
price in wall-clock time; a discrete-event simulation (``dynagraph.simulate``) adds it
to a virtual clock. Both call the same methods in the same order, so they schedule,
cache and price alike:

- :meth:`EngineCore.sequence` checks one request and builds its :class:`Sequence`
  (no side effect); :meth:`EngineCore.admit` hands it to the scheduler;
- :meth:`EngineCore.step` runs one scheduler step and returns it with its duration in
  simulated seconds (the profile's price divided by ``speed``; 0 when nothing was
  scheduled), counting it in ``stats``;
- :meth:`EngineCore.load` is the ``EngineLoad`` report of the current state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dynagraph.errors import ConfigError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines.base import EngineLoad, SamplingSpec
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env

from .args import MockerEngineArgs
from .outputs import unsupported
from .profile import Profile, load_profile
from .scheduler import Scheduler, SchedulerConfig, StepResult
from .sequence import Sequence, TokenSource, output_key


class StepStats:
    """Counters of the steps run (for benchmarks, tests and ``load()``)."""

    __slots__ = ("busy_seconds", "decode_seconds", "decode_steps", "prefill_seconds",
                 "prefill_tokens", "python_seconds", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.busy_seconds = 0.0
        """Simulated step time (after the speed factor)."""
        self.python_seconds = 0.0
        """Wall time spent in the scheduler and delivering outputs: the mocker's own cost
        (counted by the served engine only)."""
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        """Simulated time of the steps that computed prompt tokens."""
        self.decode_steps = 0
        self.decode_seconds = 0.0
        """Simulated time of the steps that only decoded."""


def kv_geometry(args: MockerEngineArgs, profile: Profile) -> tuple[int, int]:
    """(block size in tokens, number of KV blocks) of an engine with these args.

    Raises ``ConfigError`` (key ``num-gpu-blocks``) when the blocks cannot hold one
    request of ``max-model-len`` tokens.
    """
    block_size = args.block_size or profile.block_size
    bytes_per_block = profile.kv_bytes_per_token * block_size
    num_blocks = args.num_gpu_blocks or int(args.kv_cache_space_gib * 2**30 // bytes_per_block)
    needed = -(-args.max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ConfigError(
            f"{num_blocks} KV blocks of {block_size} tokens cannot hold one "
            f"request of max-model-len {args.max_model_len} (needs {needed})",
            key="num-gpu-blocks",
        )
    return block_size, num_blocks


class EngineCore:
    """A simulated engine's scheduler, hasher, counters and load; see the module docstring.

    ``emit_events``: the scheduler buffers KV events (taken with each step's result).
    ``env`` gives the hash seed (``PYTHONHASHSEED``) as the engine's environment would
    (default ``os.environ``). Not thread-safe; one caller drives it.
    """

    def __init__(self, args: MockerEngineArgs, *, engine_id: str, emit_events: bool,
                 profile: Profile | None = None, env: Mapping[str, str] | None = None) -> None:
        self.args = args
        self.profile = profile if profile is not None else load_profile(args.profile)
        self.block_size, self.num_blocks = kv_geometry(args, self.profile)
        self.engine_id = engine_id
        self.max_model_len = args.max_model_len
        self.hasher = BlockHasher(self.block_size, args.prefix_caching_hash_algo,
                                  seed_from_env(os.environ if env is None else env))
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=self.num_blocks, block_size=self.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching, watermark=args.watermark,
            engine_id=engine_id, emit_events=emit_events, policy=args.scheduling_policy,
        ))
        self.stats = StepStats()
        self.admitted = 0
        chunk = args.max_num_batched_tokens
        chunk_s = self.profile.prefill_seconds(chunk, 0)
        self._nominal_prefill_tps = chunk * args.speed / chunk_s if chunk_s > 0 else None
        self._nominal_decode_s = self.profile.decode_seconds(1, 1024) / args.speed or None
        self._excluded = frozenset(args.eos_token_ids)

    def sequence(self, request_id: str, prompt: list[int], sampling: SamplingSpec,
                 kv_transfer_params: dict[str, Any] | None = None, *,
                 digests: list[bytes] | None = None) -> Sequence:
        """The request as the scheduler will hold it; nothing changes until :meth:`admit`.

        Raises ``InvalidRequest`` (empty prompt, a sampling option the mocker cannot
        honour) or ``PromptTooLong`` (no room for one generated token). ``max_tokens``
        is capped by the room left in the context. ``digests``: the prompt's block
        digests when the caller has them (they must be ``hasher.digests(prompt)``).
        """
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        refused = unsupported(sampling)
        if refused is not None:
            raise InvalidRequest(f"the mocker engine cannot honour {refused}: it has no model "
                                 "to produce it", param=refused)
        if len(prompt) >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; the model's context is "
                f"{self.max_model_len} tokens including at least one generated token",
                param="prompt", code="context_length_exceeded",
            )
        args = self.args
        limit = self.max_model_len - len(prompt)
        max_tokens = min(sampling.max_tokens or limit, limit)
        params = kv_transfer_params or {}
        key = output_key(prompt, engine_seed=args.seed, request_id=request_id,
                         temperature=sampling.temperature, seed=sampling.seed)
        return Sequence(
            request_id, prompt, max_tokens=max_tokens, hasher=self.hasher,
            tokens=TokenSource(key, args.vocab_size,
                               self._excluded | frozenset(sampling.stop_token_ids)),
            remote_decode=bool(params.get("do_remote_decode")),
            remote_prefill=dict(params) if params.get("do_remote_prefill") else None,
            cache_salt=sampling.cache_salt,
            priority=sampling.priority if args.scheduling_policy == "priority" else 0,
            digests=digests,
        )

    def admit(self, seq: Sequence) -> None:
        """Queue ``seq`` in the scheduler (``InvalidRequest`` if its id is in flight)."""
        self.scheduler.add(seq)
        self.admitted += 1

    def step(self) -> tuple[StepResult, float]:
        """Run one scheduler step: (its result, its simulated duration in seconds)."""
        result = self.scheduler.step()
        if not result.scheduled:
            return result, 0.0
        duration = self.profile.step_seconds(result.work) / self.args.speed
        stats = self.stats
        stats.steps += 1
        stats.busy_seconds += duration
        if result.work.prefill_tokens:
            stats.prefill_tokens += result.work.prefill_tokens
            stats.prefill_seconds += duration
        elif result.work.decode_seqs:
            stats.decode_steps += 1
            stats.decode_seconds += duration
        return result, duration

    def load(self) -> EngineLoad:
        """The scheduler's state and the step counters (simulated seconds, as the Router
        should learn them), with the profile's nominal speeds as the Router's priors."""
        s, st = self.scheduler, self.stats
        return EngineLoad(
            running=s.num_running, waiting=s.num_waiting, kv_blocks_used=s.kv.num_used_blocks,
            kv_blocks_total=self.num_blocks, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            requests_total=self.admitted,
            prefilling=sum(1 for seq in s.requests.values()
                           if seq.num_computed_tokens < seq.num_prompt_tokens),
            prefill_tokens_total=st.prefill_tokens, prefill_seconds_total=st.prefill_seconds,
            decode_steps_total=st.decode_steps, decode_seconds_total=st.decode_seconds,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            max_num_seqs=self.args.max_num_seqs,
            nominal_prefill_tokens_per_s=self._nominal_prefill_tps,
            nominal_decode_step_s=self._nominal_decode_s,
        )
