"""The component SDK: what a component author imports.

```python
from dynagraph.sdk import service, depends, endpoint, async_on_start, async_on_shutdown
from dynagraph.sdk import direct, at_random, instance_ids   # typed calls on self.dep.endpoint
```
"""

from dynagraph.sdk._client import (
    ClientFactory,
    ComponentClient,
    EndpointClient,
    at_random,
    direct,
    endpoint_client,
    failover,
    instance_ids,
    instances,
    nearest,
    wait_for_instances,
)
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
    "at_random",
    "direct",
    "endpoint_client",
    "instance_ids",
    "instances",
    "nearest",
    "current_request_id",
    "depends",
    "endpoint",
    "failover",
    "resolve_config",
    "resolve_target",
    "service",
    "spec_of",
    "wait_for_instances",
]
