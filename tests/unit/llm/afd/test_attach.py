"""The VllmWorker's side: which instances are FfnWorkers, waiting for coverage, the AFD
file and the engine arguments it hands to vLLM, and the clear error on failure."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynagraph.errors import EngineError
from dynagraph.llm.afd import attach
from dynagraph.llm.afd.attach import AfdAttachment, live_peers
from dynagraph.llm.afd.errors import AfdUnavailable
from dynagraph.llm.afd.settings import (
    AfdOptions,
    EngineFailure,
    read_engine_config,
    write_failure,
)
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from tests.support.poll import until


@dataclass
class Inst:
    instance_id: int
    metadata: dict[str, Any] = field(default_factory=dict)


def record(name: str, layers: list[int], model: str = "m", experts: list[int] | None = None
           ) -> dict[str, Any]:
    return {"afd": {"instance": name, "model": model, "tcp": "127.0.0.1:9", "uds": "@x",
                    "host": "h", "layers": layers, "experts": experts}}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "dtype": "bfloat16"}))
    return d


def test_live_peers_keeps_ffn_workers_of_this_model() -> None:
    insts = [Inst(1, record("b", [0])), Inst(2, {"pid": 3}), Inst(3, record("a", [1])),
             Inst(4, record("c", [0], model="other")), Inst(5, {"afd": {"instance": "bad"}})]
    assert [p.instance for p in live_peers(insts, "m")] == ["a", "b"]


async def test_prepare_waits_for_coverage_then_selects_the_afd_model(model_dir: Path) -> None:
    instances: list[Inst] = [Inst(1, record("e01", [0, 1], experts=[0, 1]))]
    afd = AfdAttachment(AfdOptions(ping_pong=False, wait_for_workers_s=5), str(model_dir),
                        lambda: list(instances))
    try:
        args = VllmEngineArgs(model=str(model_dir), extra_engine_args={"hf_overrides": {"x": 1}})
        task = asyncio.create_task(afd.prepare(args))
        await asyncio.sleep(0.4)
        assert not task.done()                      # experts 2-3 are missing
        instances.append(Inst(2, record("e23", [0, 1], experts=[2, 3])))
        ready = await asyncio.wait_for(task, 5)
        overrides = ready.extra_engine_args["hf_overrides"]
        assert overrides["architectures"] == ["AfdMixtralForCausalLM"]
        assert overrides["x"] == 1 and overrides["afd_config_path"] == str(afd.path)
        cfg = read_engine_config(afd.path)
        assert cfg.model == "m" and not cfg.ping_pong
        assert [p.instance for p in cfg.peers] == ["e01", "e23"]
        follow = asyncio.create_task(afd.follow())
        instances.pop(0)
        for _ in range(40):
            await asyncio.sleep(0.05)
            if [p.instance for p in read_engine_config(afd.path).peers] == ["e23"]:
                break
        assert [p.instance for p in read_engine_config(afd.path).peers] == ["e23"]
        follow.cancel()
    finally:
        afd.close()
    assert not afd.path.parent.exists()


async def test_prepare_gives_up_naming_the_missing_layers(model_dir: Path) -> None:
    afd = AfdAttachment(AfdOptions(wait_for_workers_s=0.3), str(model_dir),
                        lambda: [Inst(1, record("l0", [0]))])
    try:
        with pytest.raises(AfdUnavailable, match=r"no FfnWorkers for layers \[1\]"):
            await afd.prepare(VllmEngineArgs(model=str(model_dir)))
    finally:
        afd.close()


def fail(afd: AfdAttachment, reason: str, failed: list[str] | None = None) -> None:
    """What the engine's connector leaves when it gives up."""
    write_failure(afd.error_file, EngineFailure(reason=reason, failed=failed or []))


def timed_restarts() -> tuple[list[float], Callable[[], Awaitable[None]]]:
    """A restart that only records when it ran."""
    times: list[float] = []

    async def restart() -> None:
        times.append(asyncio.get_running_loop().time())
    return times, restart


@contextlib.asynccontextmanager
async def following(afd: AfdAttachment, restart: Callable[[], Awaitable[None]]
                    ) -> AsyncIterator[asyncio.Task[None]]:
    """``afd.follow(restart)`` running; cancelled and the attachment closed afterwards."""
    follow = asyncio.create_task(afd.follow(restart))
    try:
        yield follow
    finally:
        follow.cancel()
        afd.close()


async def test_a_dead_engine_is_restarted_once_every_layer_is_covered(model_dir: Path) -> None:
    instances: list[Inst] = [Inst(1, record("l0", [0]))]
    afd = AfdAttachment(AfdOptions(), str(model_dir), lambda: list(instances))
    restarts, restart = timed_restarts()
    async with following(afd, restart):
        fail(afd, "no FfnWorker can compute layer 1")
        await asyncio.sleep(0.6)
        assert restarts == []                       # layer 1 still has no worker
        instances.append(Inst(2, record("l1", [1])))
        await until(lambda: restarts, 2.0, "a restart")
        await asyncio.sleep(0.3)
        assert len(restarts) == 1 and not afd.error_file.exists()


def test_explain_prefers_the_connector_reason(model_dir: Path) -> None:
    afd = AfdAttachment(AfdOptions(), str(model_dir), list)
    try:
        plain = EngineError("engine dead")
        assert afd.explain(plain) is plain
        fail(afd, "no FfnWorker can compute layer 1")
        explained = afd.explain(plain)
        assert isinstance(explained, EngineError)
        assert str(explained).endswith("failed: no FfnWorker can compute layer 1")
    finally:
        afd.close()


async def test_no_restart_onto_the_worker_that_failed_while_its_record_outlives_it(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed worker's etcd record stays until its lease expires: restarting onto it
    would only fail again. Its replacement (a new instance id) is what restarts."""
    monkeypatch.setattr(attach, "POLL_S", 0.02)
    instances = [Inst(1, record("a", [0, 1])), Inst(2, record("b", [0, 1]))]
    afd = AfdAttachment(AfdOptions(), str(model_dir), lambda: list(instances))
    restarts: list[list[str]] = []

    async def restart() -> None:
        restarts.append([p.instance for p in read_engine_config(afd.path).peers])

    async with following(afd, restart):
        fail(afd, "no FfnWorker can compute layer 0", failed=["a", "b"])
        await asyncio.sleep(0.3)
        assert restarts == []                       # both records still there, both dead
        instances[1] = Inst(3, record("c", [0, 1]))  # b's replacement registers
        await until(lambda: restarts, 3.0, "a restart")
        assert restarts == [["a", "c"]] and afd.failure() is None


async def test_a_failed_restart_is_tried_again_and_the_reason_stays_meanwhile(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attach, "POLL_S", 0.02)
    monkeypatch.setattr(attach, "RESTART_BACKOFF_S", 0.1)
    afd = AfdAttachment(AfdOptions(), str(model_dir), lambda: [Inst(1, record("a", [0, 1]))])
    attempts: list[str | None] = []

    async def restart() -> None:
        failure = afd.failure()
        attempts.append(failure.reason if failure else None)
        if len(attempts) == 1:  # the new engine's warm-up failed: its connector says why
            fail(afd, "warm-up: no FfnWorker can compute layer 1")
            raise EngineError("engine died in its warm-up")

    async with following(afd, restart) as follow:
        fail(afd, "no FfnWorker can compute layer 1")
        await until(lambda: len(attempts) == 2, 3.0, "a second restart")
        # during each restart callers still get the reason; the second is the new one
        assert attempts == ["no FfnWorker can compute layer 1",
                            "warm-up: no FfnWorker can compute layer 1"]
        await until(lambda: afd.failure() is None, 3.0, "the failure cleared")
        assert not follow.done()                    # a failed restart does not end it


async def test_a_failed_worker_counts_again_after_the_grace(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that was only slow keeps its record: after the grace it is tried again."""
    monkeypatch.setattr(attach, "POLL_S", 0.02)
    monkeypatch.setattr(attach, "FAILED_PEER_GRACE_S", 0.3)
    afd = AfdAttachment(AfdOptions(), str(model_dir), lambda: [Inst(1, record("a", [0, 1]))])
    restarts, restart = timed_restarts()
    async with following(afd, restart):
        began = asyncio.get_running_loop().time()
        fail(afd, "no FfnWorker can compute layer 0", failed=["a"])
        await until(lambda: restarts, 3.0, "a restart")
        assert restarts[0] - began >= 0.3
