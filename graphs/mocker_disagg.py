"""Disaggregated serving over simulated engines, with KV-aware routing.

HTTP -> Processor -> Router -> MockerWorker (decode; prefills short prompts itself,
queues long ones on the prefill queue, NATS JetStream) -> MockerPrefillWorker (pulls the
job, prefills on its simulated engine, hands the transfer parameters back; the decode
engine waits out the simulated KV transfer at ``kv-transfer-bandwidth-gbps``).
The real Processor, Router, queue and disaggregation policy; only the engines are mocked.
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.mocker_prefill_worker import MockerPrefillWorker
from components.mocker_worker import MockerWorker
from components.processor import Processor

graph = Frontend.link(Processor).link(Router).link(MockerWorker).link(MockerPrefillWorker)
# dynamo serve graphs.mocker_disagg:Frontend -f configs/mocker_disagg.yaml
