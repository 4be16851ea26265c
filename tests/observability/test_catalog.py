"""The metric catalogue and the helper metric objects follow Prometheus conventions."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest

from dynagraph.llm.disagg.metrics import DecodeMetrics, PrefillQueueMetrics
from dynagraph.llm.processor_metrics import ProcessorMetrics
from dynagraph.llm.router.metrics import RouterMetrics
from dynagraph.observability.catalog import BY_NAME, CATALOG, PENDING_RENAMES, spec
from tests.support.metrics import value

from .conftest import promtool_check_metrics

NAME = re.compile(r"^dynamo_(frontend|processor|router|worker|prefill_queue|ffn)_[a-z0-9_]+$")
UNITS = ("_seconds", "_bytes", "_ratio", "_tokens", "_blocks", "_requests")


def test_names_are_unique_and_conventional() -> None:
    assert len(BY_NAME) == len(CATALOG)
    for m in CATALOG:
        assert NAME.match(m.name), m.name
        if m.name in PENDING_RENAMES:
            continue
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert not re.search(r"_(ms|milliseconds|percent|kb|mb)(_|$)", m.name), m.name
        if m.kind == "histogram":
            assert m.name.endswith(UNITS), m.name
        assert m.help and m.graph in {"agg", "agg_router", "disagg", "agg_afd"}


def test_pending_renames_are_catalogued_and_fix_the_convention() -> None:
    for old, new in PENDING_RENAMES.items():
        assert old in BY_NAME and new not in BY_NAME
        assert (BY_NAME[old].kind == "counter") == new.endswith("_total")


def test_spec_accepts_series_names() -> None:
    assert spec("dynamo_router_decision_seconds_bucket").name == "dynamo_router_decision_seconds"
    assert spec("dynamo_router_decisions_total").kind == "counter"


def _exercise(registry: CollectorRegistry) -> str:
    clock = iter([0.0, 0.001, 0.003, 0.010, 0.011, 0.012, 0.020]).__next__
    pm = ProcessorMetrics(registry, clock=clock)
    timer = pm.request()                 # t=0
    with timer.tokenizing():             # 0.001 .. 0.003 -> 2 ms
        pass
    timer.dispatched()                   # t=0.010: queue = 10 - 2 = 8 ms

    class Detok:
        def process(self, x: int) -> int:
            return x + 1

    detok = timer.timed(Detok())
    assert detok.process(1) == 2         # 0.011 .. 0.012 -> 1 ms
    timer.finished()
    timer.finished()
    rm = RouterMetrics(registry)
    rm.decision(mode="kv", worker="a1", request_blocks=8, overlap_blocks=6, seconds=0.0002)
    rm.kv_event_batch("a1", 3)
    rm.index_blocks("a1", 42, pooled=90, tiered=7)
    rm.index_blocks("b2", 1)
    rm.forget_worker("b2")
    rm.forget_worker("never-seen")
    dm = DecodeMetrics("a1", registry)
    dm.kv_transfer(4096, 0.002)
    dm.queue_depth(3)
    qm = PrefillQueueMetrics(registry, clock=lambda: 100.5)
    qm.pulled(enqueued_at=100.0, delivery_count=1)
    qm.pulled(enqueued_at=100.25, delivery_count=2)
    return generate_latest(registry).decode()


def test_helpers_export_catalogued_names_with_expected_values() -> None:
    registry = CollectorRegistry()
    text = _exercise(registry)
    families = {m.name for m in registry.collect()}
    for fam in families:
        name = fam + "_total" if f"# TYPE {fam}_total counter" in text or \
            f"# TYPE {fam} counter" in text else fam
        assert spec(name), fam
    assert abs(value(text, "dynamo_processor_queue_seconds_sum") - 0.008) < 1e-9
    assert abs(value(text, "dynamo_processor_tokenize_seconds_sum") - 0.002) < 1e-9
    assert abs(value(text, "dynamo_processor_detokenize_seconds_sum") - 0.001) < 1e-9
    assert value(text, "dynamo_processor_detokenize_seconds_count") == 1
    assert value(text, 'dynamo_router_decisions_total{mode="kv",worker="a1"}') == 1
    assert value(text, 'dynamo_router_request_blocks_total{worker="a1"}') == 8
    assert value(text, 'dynamo_router_overlap_blocks_total{worker="a1"}') == 6
    assert value(text, "dynamo_router_decision_seconds_count") == 1
    assert value(text, 'dynamo_router_index_blocks{worker="a1"}') == 42
    assert 'dynamo_router_index_blocks{worker="b2"}' not in text
    assert value(text, 'dynamo_router_index_pooled_blocks{worker="a1"}') == 90
    assert 'dynamo_router_index_pooled_blocks{worker="b2"}' not in text
    assert value(text, 'dynamo_router_index_tiered_blocks{worker="a1"}') == 7
    assert value(text, 'dynamo_router_kv_event_batches_total{worker="a1"}') == 3
    assert value(text, 'dynamo_worker_kv_transfer_bytes_total{worker="a1"}') == 4096
    assert value(text, "dynamo_prefill_queue_depth") == 3
    assert value(text, "dynamo_prefill_queue_wait_seconds_sum") == 0.75
    assert value(text, "dynamo_prefill_queue_redeliveries_total") == 1


def test_helper_metrics_pass_promtool() -> None:
    assert promtool_check_metrics(_exercise(CollectorRegistry())) == []


def test_every_catalogued_helper_family_is_created() -> None:
    registry = CollectorRegistry()
    _exercise(registry)
    text = generate_latest(registry).decode()
    for m in CATALOG:
        if m.component in {"Processor", "Router"} or m.name.startswith(
                ("dynamo_worker_kv_transfer", "dynamo_prefill_queue")):
            assert f"# TYPE {m.name} {m.kind}" in text, m.name
