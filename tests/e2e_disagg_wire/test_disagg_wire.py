"""``kv-transfer-compression: int8``: a remote prefill's KV crosses the NIXL wire encoded
(66 bytes per 128), is decoded into the decode engine's cache, and the greedy output
agrees with the agg graph's (within each token's lead over the runner-up)."""

from __future__ import annotations

import pytest

from tests.e2e_disagg.conftest import (
    BLOCK,
    BLOCK_BYTES,
    DisaggGraph,
    check_remote_prompts,
    check_transfer,
    transferred,
)
from tests.support.greedy import Greedy

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

RATIO = 66 / 128


def test_kv_crosses_the_wire_encoded_and_the_output_agrees_with_agg(
        wire_graph: DisaggGraph, agg_reference: dict[str, Greedy]) -> None:
    def arrived(n: int, before: tuple[dict[str, float], tuple[float, float]]) -> None:
        # every full block arrived, encoded: never more than the encoded whole prompt
        check_transfer(wire_graph, n, before, low=(n // BLOCK - 1) * BLOCK_BYTES * RATIO,
                       high=-(-n // BLOCK) * BLOCK_BYTES * RATIO)

    remote = check_remote_prompts(wire_graph, agg_reference,
                                  lambda: (wire_graph.metrics(), transferred(wire_graph)),
                                  arrived)
    assert remote >= 10
    # both engines passed the wire codec's quality guard at start-up
    out = wire_graph.proc.output()
    assert out.count("quality guard: kv-transfer-compression int8") == 2, out[-3000:]
