"""Aggregated serving with KV-aware routing.

HTTP -> Processor -> Router (which worker holds the prompt's prefix?) -> VllmWorker
(prefill and decode in one engine). The workers publish their KV cache events and
load to the Router (``publish-kv-events: true``).
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.processor import Processor
from components.worker import VllmWorker

graph = Frontend.link(Processor).link(Router).link(VllmWorker)
# dynamo serve graphs.agg_router:Frontend -f configs/agg_router.yaml
