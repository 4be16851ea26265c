"""Aggregated serving on one simulated engine: HTTP -> Processor -> MockerWorker.

``graphs.agg`` with ``MockerWorker`` standing in for ``VllmWorker``: what
``benchmarks/mocker_fidelity.py`` compares with the real vLLM graph, served the same way.
"""

from components.frontend import Frontend
from components.mocker_worker import MockerWorker
from components.processor import Processor

graph = Frontend.link(Processor).link(MockerWorker)
# dynamo serve graphs.mocker_agg:Frontend -f configs/mocker_agg.yaml
