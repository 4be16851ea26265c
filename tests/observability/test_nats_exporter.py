"""The NATS exporter maps monitoring JSON to the official exporter's names; live check."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynagraph.observability import nats_exporter
from dynagraph.observability.catalog import INFRA_METRICS
from dynagraph.runtime.infra import LocalService

from .conftest import promtool_check_metrics

VARZ = {"connections": 3, "in_msgs": 10, "out_msgs": 12, "in_bytes": 100, "out_bytes": 120,
        "mem": 1 << 20, "cpu": 0.5, "slow_consumers": 0, "subscriptions": 7,
        "total_connections": 4, "server_name": "n1"}
JSZ = {"streams": 1, "consumers": 1, "messages": 2, "bytes": 70, "account_details": [
    {"name": "$G", "stream_detail": [
        {"name": "PREFILL_dynamo", "state": {"messages": 2, "bytes": 70, "first_seq": 1,
                                              "last_seq": 2, "consumer_count": 1},
         "consumer_detail": [{"name": "prefill_workers", "num_pending": 1, "num_ack_pending": 1,
                              "num_redelivered": 0, "num_waiting": 2,
                              "delivered": {"consumer_seq": 1, "stream_seq": 1}}]}]}]}


def _text(families: list) -> str:  # type: ignore[type-arg]
    registry = CollectorRegistry()

    class C:
        def collect(self):  # type: ignore[no-untyped-def]
            return iter(families)

    registry.register(C())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_families_from_json() -> None:
    text = _text(nats_exporter.varz_families(VARZ, "http://m:8222")
                 + nats_exporter.jsz_families(JSZ, "http://m:8222"))
    assert 'gnatsd_varz_in_msgs{server_id="http://m:8222"} 10.0' in text
    assert ('jetstream_consumer_num_pending{account="$G",consumer_name="prefill_workers",'
            'server_id="http://m:8222",stream_name="PREFILL_dynamo"} 1.0') in text
    assert 'jetstream_stream_total_messages{account="$G"' in text
    assert "jetstream_server_total_streams" in text
    for name, source in INFRA_METRICS.items():
        if source == "nats":
            assert f"# TYPE {name} gauge" in text, name
    assert promtool_check_metrics(text) == []


def test_unreachable_monitor_yields_nothing() -> None:
    assert list(nats_exporter.NatsCollector("http://127.0.0.1:9", timeout=0.5).collect()) == []


@pytest.mark.integration
def test_live_nats(nats_service: LocalService | None) -> None:
    if nats_service is None:
        pytest.skip("NATS_SERVER is set: the monitoring URL of that server is unknown")
    server, address = nats_exporter.serve(nats_service.extra["monitor_url"])
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "gnatsd_varz_connections{" in text
    assert "jetstream_server_total_streams{" in text
    assert promtool_check_metrics(text) == []
