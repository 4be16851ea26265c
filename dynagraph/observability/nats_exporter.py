"""A small NATS exporter: nats-server's monitoring JSON as Prometheus gauges.

Debian and PyPI ship no Prometheus exporter for NATS, and nats-server has no
Prometheus endpoint of its own. The compose stack (``deploy/``) runs the official
``natsio/prometheus-nats-exporter``; local runs (``dynamo serve``, ``scripts/prometheus.sh``,
the tests) use this collector, which emits a subset of the same names and labels,
so one dashboard works with both:

- ``/varz``: ``gnatsd_varz_<field>`` for connections, total_connections, subscriptions,
  slow_consumers, in_msgs, out_msgs, in_bytes, out_bytes, mem, cpu (label ``server_id``:
  the monitoring URL, as the official exporter sets it by default).
- ``/jsz?consumers=true&config=true``: ``jetstream_server_total_{streams,consumers,messages,
  message_bytes}``, ``jetstream_stream_{total_messages,total_bytes,first_seq,last_seq}`` (labels ``stream_name``, ``account``), ``jetstream_consumer_{num_pending,
  num_ack_pending,num_redelivered,num_waiting,delivered_stream_seq}`` (plus ``consumer_name``).

All are gauges, as the official exporter reports them (counter-like ones such as
``in_msgs`` are cumulative: use ``rate()``). A monitoring URL that does not answer
yields no samples (Prometheus's ``up`` stays 1 for the exporter itself).

    python -m dynagraph.observability.nats_exporter --nats-monitor http://127.0.0.1:8222 \
        --port 7777
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

VARZ_FIELDS = ("connections", "total_connections", "subscriptions", "slow_consumers", "in_msgs",
               "out_msgs", "in_bytes", "out_bytes", "mem", "cpu")
SERVER_FIELDS = (("streams", "total_streams"), ("consumers", "total_consumers"),
                 ("messages", "total_messages"), ("bytes", "total_message_bytes"))
STREAM_FIELDS = (("messages", "total_messages"), ("bytes", "total_bytes"),
                 ("first_seq", "first_seq"), ("last_seq", "last_seq"))
# Left out: jetstream_stream_consumer_count (promtool: a gauge must not end in _count).
CONSUMER_FIELDS = ("num_pending", "num_ack_pending", "num_redelivered", "num_waiting")


def _get(url: str, timeout: float) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback monitor
            data = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        log.debug("NATS monitor %s: %s", url, exc)
        return None
    return data if isinstance(data, dict) else None


def varz_families(varz: dict[str, Any], server_id: str) -> list[GaugeMetricFamily]:
    out = []
    for field in VARZ_FIELDS:
        value = varz.get(field)
        if isinstance(value, int | float):
            g = GaugeMetricFamily(f"gnatsd_varz_{field}", field, labels=["server_id"])
            g.add_metric([server_id], float(value))
            out.append(g)
    return out


def jsz_families(jsz: dict[str, Any], server_id: str) -> list[GaugeMetricFamily]:
    fams: dict[str, GaugeMetricFamily] = {}

    def fam(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        if name not in fams:
            fams[name] = GaugeMetricFamily(name, doc, labels=labels)
        return fams[name]

    for key, suffix in SERVER_FIELDS:
        value = jsz.get(key)
        if isinstance(value, int | float):
            fam(f"jetstream_server_{suffix}", f"JetStream {key}", ["server_id"]).add_metric(
                [server_id], float(value))
    for account in jsz.get("account_details") or []:
        acct = str(account.get("name", ""))
        for stream in account.get("stream_detail") or []:
            sname = str(stream.get("name", ""))
            state = stream.get("state") or {}
            labels = [server_id, acct, sname]
            for key, suffix in STREAM_FIELDS:
                if isinstance(state.get(key), int | float):
                    fam(f"jetstream_stream_{suffix}", f"Stream {key}",
                        ["server_id", "account", "stream_name"]).add_metric(labels, float(state[key]))
            for consumer in stream.get("consumer_detail") or []:
                clabels = [*labels, str(consumer.get("name", ""))]
                names = ["server_id", "account", "stream_name", "consumer_name"]
                for key in CONSUMER_FIELDS:
                    if isinstance(consumer.get(key), int | float):
                        fam(f"jetstream_consumer_{key}", f"Consumer {key}", names).add_metric(
                            clabels, float(consumer[key]))
                seq = (consumer.get("delivered") or {}).get("stream_seq")
                if isinstance(seq, int | float):
                    fam("jetstream_consumer_delivered_stream_seq",
                        "Consumer delivered stream sequence", names).add_metric(clabels, float(seq))
    return list(fams.values())


class NatsCollector(Collector):
    """Reads ``monitor_url`` (``http://host:8222``) at every scrape."""

    def __init__(self, monitor_url: str, timeout: float = 2.0) -> None:
        self.monitor_url = monitor_url.rstrip("/")
        self.timeout = timeout

    def collect(self) -> Iterator[GaugeMetricFamily]:
        varz = _get(f"{self.monitor_url}/varz", self.timeout)
        if varz is not None:
            yield from varz_families(varz, self.monitor_url)
        jsz = _get(f"{self.monitor_url}/jsz?consumers=true&config=true", self.timeout)
        if jsz is not None:
            yield from jsz_families(jsz, self.monitor_url)


def serve(monitor_url: str, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, str]:
    """Serve a NatsCollector on ``addr:port`` (0: a free port); returns (server, address)."""
    registry = CollectorRegistry()
    registry.register(NatsCollector(monitor_url))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, f"{addr}:{server.server_port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynagraph.observability.nats_exporter")
    p.add_argument("--nats-monitor", required=True, help="nats-server monitoring URL")
    p.add_argument("--port", type=int, default=7777)
    p.add_argument("--addr", default="127.0.0.1")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, address = serve(args.nats_monitor, args.port, args.addr)
    log.info("NATS exporter for %s at http://%s/metrics", args.nats_monitor, address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
