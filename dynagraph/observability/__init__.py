"""Observability: metric catalogue, component metric helpers, Prometheus target discovery.

- ``catalog``: every metric name dynagraph exports (and the infra names dashboards use).
- ``processor_metrics``, ``router_metrics``, ``disagg_metrics``: metric objects with a
  small API for the Processor, Router and (decode/prefill) workers.
- ``file_sd``, ``graph_targets``: a Prometheus ``file_sd`` file kept current from
  discovery by ``dynamo serve``; ``nats_exporter``: NATS monitoring as Prometheus gauges.
- ``dashboards``: checks of the Grafana dashboard JSON in ``deploy/``.
"""
