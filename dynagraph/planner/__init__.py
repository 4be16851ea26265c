"""The Planner: scales prefill and decode workers from their load, within a GPU budget.

``policy``: the pure decision (``decide``); ``connector``: how a decision is applied
(``dynamo serve`` through etcd, Kubernetes); ``observer``: the load the decision is fed.
"""

from __future__ import annotations

from dynagraph.planner.policy import (
    Decision,
    Observation,
    PlannerPolicy,
    PlannerState,
    Reason,
    Replicas,
    decide,
    pressures,
    surge,
)

__all__ = ["Decision", "Observation", "PlannerPolicy", "PlannerState", "Reason", "Replicas",
           "decide", "pressures", "surge"]
