"""Disaggregated serving with KV-aware routing: the full graph.

HTTP -> Processor -> Router (which decode worker holds the prompt's prefix?) ->
VllmWorker (decode; prefills short prompts itself, queues long ones) ->
PrefillWorker (prefills, hands the KV over NIXL to the decode worker).
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.prefill_worker import PrefillWorker
from components.processor import Processor
from components.worker import VllmWorker

graph = Frontend.link(Processor).link(Router).link(VllmWorker).link(PrefillWorker)
# dynamo serve graphs.disagg_router:Frontend -f configs/disagg_router.yaml
