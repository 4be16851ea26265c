"""Disaggregated prefill: long prompts prefilled by a PrefillWorker, their KV moved over NIXL.

One module per role::

    policy       local or remote? (pure) and the live thresholds from etcd
    keys         the two workers' config keys
    coordinator  decode side, per request: decide, enqueue, wait for the hand-off or fall back
    decode       what a decode worker process owns (queue producer, NIXL consumer, settings)
    prefill      prefill side: pull a job, prefill, hand the KV over, settle the job

The queue itself is ``dynagraph.runtime.queue``; NIXL set-up is ``dynagraph.llm.kv``.
"""

from dynagraph.llm.disagg.coordinator import (
    PREFILL_DONE_ENDPOINT,
    PrefillAck,
    PrefillPlan,
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.keys import DecodeDisaggKeys, DisaggWorkerKeys
from dynagraph.llm.disagg.policy import (
    DisaggConfig,
    LiveDisaggSettings,
    PrefillDecision,
    decide_prefill,
)
from dynagraph.llm.disagg.prefill import JobOutcome, PrefillJobHandler, reply_through, serve_queue

__all__ = [
    "PREFILL_DONE_ENDPOINT",
    "DecodeDisaggKeys",
    "DisaggConfig",
    "DisaggWorkerKeys",
    "JobOutcome",
    "LiveDisaggSettings",
    "PrefillAck",
    "PrefillDecision",
    "PrefillJobHandler",
    "PrefillPlan",
    "PrefillResult",
    "PrefixCacheEstimate",
    "RemotePrefillCoordinator",
    "decide_prefill",
    "reply_through",
    "serve_queue",
]
