"""Aggregated serving: HTTP -> Processor -> VllmWorker (prefill and decode in one engine)."""

from components.frontend import Frontend
from components.processor import Processor
from components.worker import VllmWorker

graph = Frontend.link(Processor).link(VllmWorker)
