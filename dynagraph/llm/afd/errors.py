"""AFD errors, under the project's hierarchy (``dynagraph.errors``).

    EngineError
    └── AfdError               attention-FFN disaggregation failed
        ├── ChannelError       one connection to one FfnWorker broke, timed out or was
        │                      refused; the connector retries on another replica
        └── AfdUnavailable     no FfnWorker serves a layer/expert group within the
                               failover timeout: the forward pass cannot complete
"""

from __future__ import annotations

from dynagraph.errors import EngineError


class AfdError(EngineError):
    """Attention-FFN disaggregation failed."""


class ChannelError(AfdError):
    """A connection to one FfnWorker failed; safe to retry the call on another replica
    (an FFN call has no side effects)."""


class AfdUnavailable(AfdError):
    """No live FfnWorker holds what a forward pass needs, within the failover timeout."""
