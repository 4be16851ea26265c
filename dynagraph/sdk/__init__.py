"""The component SDK: what a component author imports.

```python
from dynagraph.sdk import service, depends, endpoint, async_on_start, async_on_shutdown
```
"""

from dynagraph.sdk._client import ClientFactory, ComponentClient, EndpointClient, failover
from dynagraph.sdk._config import ComponentConfig, ServiceArgs, resolve_config
from dynagraph.sdk._context import RuntimeContext, current_request_id
from dynagraph.sdk._graph import Graph, resolve_target
from dynagraph.sdk._service import (
    Component,
    ServiceSpec,
    async_on_shutdown,
    async_on_start,
    depends,
    endpoint,
    service,
    spec_of,
)

__all__ = [
    "ClientFactory",
    "Component",
    "ComponentClient",
    "ComponentConfig",
    "EndpointClient",
    "Graph",
    "RuntimeContext",
    "ServiceArgs",
    "ServiceSpec",
    "async_on_shutdown",
    "async_on_start",
    "current_request_id",
    "depends",
    "endpoint",
    "failover",
    "resolve_config",
    "resolve_target",
    "service",
    "spec_of",
]
