"""Aggregated serving with attention-FFN disaggregation: HTTP -> Processor -> VllmWorker,
whose engine keeps attention and the KV cache and sends each layer's FFN (or MoE
experts) to FfnWorkers."""

from components.ffn_worker import FfnWorker
from components.frontend import Frontend
from components.processor import Processor
from components.worker import VllmWorker

graph = Frontend.link(Processor).link(VllmWorker).link(FfnWorker)
# dynamo serve graphs.agg_afd:Frontend -f configs/agg_afd.yaml
