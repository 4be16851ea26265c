"""KV-aware routing over simulated engines: HTTP -> Processor -> Router -> MockerWorker.

``MockerWorker`` stands in for ``VllmWorker`` (same endpoints and wire messages), so the
Processor and the Router are the ones ``graphs.agg_router`` serves. Each worker process
runs ``engines-per-process`` simulated engines with the ``cpu-tiny`` timing profile
(vLLM on this machine's tiny model), each its own instance behind the Router.
"""

from components.frontend import Frontend
from components.kv_router import Router
from components.mocker_worker import MockerWorker
from components.processor import Processor

graph = Frontend.link(Processor).link(Router).link(MockerWorker)
# dynamo serve graphs.mocker_router:Frontend -f configs/mocker_router.yaml
