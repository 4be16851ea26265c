"""The NIXL wire codec's quality guard (``kv-transfer-compression``) on a real vLLM engine
with our NIXL connector: the engine's cached calibration blocks are round-tripped through
the codec in place and served again; int8 and fp8 pass, a deliberately bad codec is refused
and the engine does not start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine
from dynagraph.llm.kv.transfer.nixl_side import prepare_nixl
from tests.vllm.conftest import TEST_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(300)]


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("codec, passes", [
    ("int8", True), ("fp8", True), ("tests.support.bad_codec:SignOnly", False)])
async def test_the_wire_guard_passes_int8_and_fp8_and_refuses_a_bad_codec(
        model_dir: Path, codec: str, passes: bool, restored_env: None) -> None:
    kv_cfg, _ = prepare_nixl("kv_consumer", engine_id=f"wire-guard-{os.getpid()}",
                             host="127.0.0.1", wire_codec=codec)
    engine = VllmEngine(VllmEngineArgs(
        model=str(model_dir), block_size=TEST_BLOCK_SIZE, max_model_len=1024, max_num_seqs=2,
        num_gpu_blocks_override=256, kv_transfer_config=kv_cfg, kv_transfer_compression=codec,
        cpu_reserved_cores=0))
    if not passes:
        with pytest.raises(ConfigError, match="kv-transfer-compression.*quality guard refused|"
                                              "quality guard refused.*SignOnly.*divergence"):
            await engine.start()
        assert not engine.started
        return
    await engine.start()
    try:
        report = engine.wire_guard_report
        assert report.key == "kv-transfer-compression"
        assert report.agreement >= 0.75 and 0 < report.divergence <= 0.05
        assert report.restored_tokens >= 8 * 4 * TEST_BLOCK_SIZE * 0.9
    finally:
        await engine.shutdown()
