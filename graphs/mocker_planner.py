"""Planner-scaled serving over simulated engines: HTTP -> Processor -> Router ->
MockerWorker, and a Planner that adds decode worker processes under load and retires
them (draining first) when idle, through ``dynamo serve``'s scale keys in etcd.
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.mocker_worker import MockerWorker
from components.planner import Planner
from components.processor import Processor

graph = Frontend.link(Processor).link(Router).link(MockerWorker).link(Planner)
# dynamo serve graphs.mocker_planner:Frontend -f configs/mocker_planner.yaml --drain-grace 30
