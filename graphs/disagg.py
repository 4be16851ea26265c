"""Disaggregated serving: HTTP -> Processor -> VllmWorker (decode) -> PrefillWorker.

The decode worker prefills short prompts itself and queues long ones for a prefill
worker, whose KV cache then moves to it over NIXL (see ``components/worker.py`` and
``components/prefill_worker.py``).
"""

from components.frontend import Frontend
from components.prefill_worker import PrefillWorker
from components.processor import Processor
from components.worker import VllmWorker

graph = Frontend.link(Processor).link(VllmWorker).link(PrefillWorker)
# dynamo serve graphs.disagg:Frontend -f configs/disagg.yaml
