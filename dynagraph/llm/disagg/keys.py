"""The disaggregation keys of the two NIXL workers' configs (kebab-case in YAML)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dynagraph.config import ConfigModel
from dynagraph.llm.disagg.policy import DisaggConfig
from dynagraph.llm.kv.transfer.nixl_settle import DEFAULT_SETTLE_US
from dynagraph.llm.kv.transfer.nixl_side import DEFAULT_DELAY_US

PROGRESS_DELAY_DOC = (
    "Poll timeout in microseconds of NIXL's progress thread, which wakes on UCX events "
    "anyway: KV transfers complete as soon as the data has moved, and the thread sleeps "
    "while idle. 0 = NIXL's own busy-spin (a full core per engine)."
)


class DisaggWorkerKeys(ConfigModel):
    """Keys both NIXL workers have (decode: ``DecodeDisaggKeys``, prefill:
    ``PrefillWorkerConfig``)."""

    prefill_queue_ack_wait: float = Field(default=3.0, gt=0)
    """Seconds before an unacked job is delivered again. A prefill worker working on a job
    says so every third of it (``in_progress``), so only a dead or frozen worker's job
    moves on, and soon enough for the decode worker, which waits
    ``remote-prefill-timeout``, to still use it. Share it between the decode and prefill
    workers (``Common``): the last process to connect sets the queue's value."""
    prefill_queue_max_deliver: int = Field(default=3, ge=1)
    nixl_progress_delay_us: int = Field(default=DEFAULT_DELAY_US, ge=0,
                                        description=PROGRESS_DELAY_DOC)
    """See ``dynagraph.llm.kv.transfer.nixl_connector``."""
    kv_transport: Literal["auto", "nixl", "shm", "tier"] = "nixl"
    """How a remote prefill's KV reaches the decode worker. ``nixl`` (default): a NIXL
    READ. ``shm`` / ``auto``: each engine's KV cache lives in shared memory, and a decode
    engine reads a same-host prefill engine's blocks with ``memcpy`` (``dynagraph.llm.kv.
    shm_direct``); a peer on another host, or one that is not in shared memory, is read
    over NIXL (``auto`` and ``shm`` do the same). Set it on both workers. ``tier``: through
    the ``kv-offload-dir`` tier both workers share (``dynagraph.llm.kv.transfer.tier_handoff``;
    needs ``kv-offload-dir`` on a tmpfs; a job a prefill worker cannot hand over through
    the tier goes over NIXL): slower than ``shm`` (a file per block), for hosts where
    NIXL does not work (``benchmarks/results/disagg_served_shm.md``)."""

    @model_validator(mode="after")
    def _tier_needs_a_tier(self) -> DisaggWorkerKeys:
        # kv-offload-dir is an engine key: the worker configs that mix these keys in have it
        if self.kv_transport == "tier" and not getattr(self, "kv_offload_dir", None):
            raise ValueError("kv-transport tier moves the KV through the kv-offload-dir tier "
                             "(with kv-offload-gib): set both, the tier on a tmpfs such as "
                             "/dev/shm (or kv-transport shm: no tier needed)")
        return self

    @property
    def shared_kv_memory(self) -> bool:
        """The engine's KV cache in shared memory, same-host READs as copies."""
        return self.kv_transport in ("shm", "auto")

    @property
    def through_tier(self) -> bool:
        """Remote prefills hand over through the shared tier (``tier_handoff``)."""
        return self.kv_transport == "tier"


class DecodeDisaggKeys(DisaggWorkerKeys, DisaggConfig):
    """The decode worker's keys: ``DisaggConfig``'s policy and the shared worker keys.

    ``max-local-prefill-length`` and ``max-prefill-queue-size`` can be changed live in
    etcd (``/{namespace}/settings/VllmWorker/<key>``).
    """

    nixl_settle_us: int = Field(default=DEFAULT_SETTLE_US, ge=0, le=1_000_000)
    """How long an engine step may poll the KV reads it has just posted, in microseconds,
    so that the same step reports them done instead of the next (an idle engine sleeps
    1 ms between steps). 0: vLLM's own polling only. See ``dynagraph.llm.kv.transfer.nixl_settle``."""

    @model_validator(mode="after")
    def _redelivery_can_be_used(self) -> DecodeDisaggKeys:
        if self.remote_prefill and self.prefill_queue_ack_wait * 2 > self.remote_prefill_timeout:
            raise ValueError(
                f"prefill-queue-ack-wait ({self.prefill_queue_ack_wait}s) must be at most half "
                f"of remote-prefill-timeout ({self.remote_prefill_timeout}s): a job whose "
                "prefill worker died is redelivered after ack-wait and must still have time "
                "to be prefilled before the decode worker gives up on it")
        return self

    def disagg_config(self) -> DisaggConfig:
        return DisaggConfig.model_validate(
            self.model_dump(include=set(DisaggConfig.model_fields)))
