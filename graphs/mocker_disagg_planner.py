"""``graphs.mocker_disagg`` with a Planner that scales the decode and the prefill workers
(prefill-queue depth, decode KV usage and queue) within a GPU budget, moving a replica
from one role to the other when the budget is full.
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.mocker_prefill_worker import MockerPrefillWorker
from components.mocker_worker import MockerWorker
from components.planner import Planner
from components.processor import Processor

graph = (Frontend.link(Processor).link(Router).link(MockerWorker).link(MockerPrefillWorker)
         .link(Planner))
# dynamo serve graphs.mocker_disagg_planner:Frontend -f configs/mocker_disagg_planner.yaml
