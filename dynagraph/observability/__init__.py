"""Observability: metric catalogue, generic metric helpers, Prometheus target discovery.

Component-agnostic: nothing here imports ``dynagraph.llm``. Each component's metric
group lives with its component (``dynagraph.llm.http.metrics``,
``dynagraph.llm.processor_metrics``, ``dynagraph.llm.router.metrics``,
``dynagraph.llm.engines.metrics``, ``dynagraph.llm.disagg.metrics``,
``dynagraph.llm.afd.metrics``) and builds its families from the catalogue's names.

- ``catalog``: every metric name dynagraph exports (and the infra names dashboards use),
  as data.
- ``metrics``: ``counter``/``gauge``/``histogram`` built from a catalogue entry.
- ``task_dump``: a dump of a process's asyncio tasks.
- ``file_sd``, ``graph_targets``: a Prometheus ``file_sd`` file kept current from
  discovery by ``dynamo serve``; ``nats_exporter``: NATS monitoring as Prometheus gauges.
- ``dashboards``: checks of the Grafana dashboard JSON in ``deploy/``.
"""
