"""The graph secret: one random key per served graph, shared by its processes.

``dynamo serve`` makes one (or takes ``DYNAGRAPH_GRAPH_SECRET`` from its environment) and
hands it to every component it starts, in that variable; the tenants' signer
(``dynagraph.llm.tenants.identity.Signer``) keys its HMACs with it.
"""

from __future__ import annotations

import secrets

SECRET_ENV = "DYNAGRAPH_GRAPH_SECRET"


def new_secret() -> str:
    """A fresh secret (64 hex characters)."""
    return secrets.token_hex(32)
