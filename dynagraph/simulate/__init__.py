"""``dynamo simulate``: a request trace through a mocker graph's own policy code, on a
virtual clock, in one process (no sockets, no etcd or NATS, no wall clock).

What runs is the served graph's code, not a model of it: the mocker engines' scheduler,
KV block manager and step pricing (``dynagraph.llm.engines.mocker.core.EngineCore``), the
worker's KV event feed, and the Router's state, index and cost
(``dynagraph.llm.router``), fed as the served Router feeds them. Only the transport and
the clock are replaced.

Modules, one concept each:

    trace    Mooncake JSONL -> TraceRequest (errors name the file and line)
    prompts  trace block ids -> prompt token ids and the engines' block digests
    plan     the graph's resolved config -> SimPlan (refuses what is not simulated)
    clock    the discrete-event queue (simulated seconds)
    engines  SimEngine: one EngineCore stepped on the clock, its KV event feed
    routing  Routing: the Processor's pick or the Router's decision and bookkeeping
    fleet    Simulation: arrivals, steps, load samples -> SimResult
    report   summary, per-request lines, time series (pure)
    plots    the PNG plots
    run      the command's work: resolve, read, run, write
    served   the served twin: trace slices, request bodies, served vs simulated figures
"""

from __future__ import annotations

from .fleet import RequestRecord, SimResult, Simulation
from .plan import SimPlan, plan_simulation
from .run import SimulateOptions, simulate
from .trace import TraceRequest, parse_trace, read_trace

__all__ = [
    "RequestRecord",
    "SimPlan",
    "SimResult",
    "SimulateOptions",
    "Simulation",
    "TraceRequest",
    "parse_trace",
    "plan_simulation",
    "read_trace",
    "simulate",
]
