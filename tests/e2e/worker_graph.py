"""One VllmWorker on its own: a worker joining a running deployment (another model)."""

from components.worker import VllmWorker
from dynagraph.sdk import Graph

graph = Graph.of(VllmWorker)
