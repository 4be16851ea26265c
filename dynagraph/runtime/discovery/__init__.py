"""Service discovery: who is serving which endpoint, where; plus shared settings.

    from dynagraph.runtime.discovery import EtcdDiscovery, discovery_from_env

    disc = discovery_from_env()            # EtcdDiscovery on ETCD_ENDPOINTS
    await disc.start()                     # grants this process's lease
    await disc.register("dynamo", "Worker", "generate", "127.0.0.1:40123", {"pid": 42})
    watch = await disc.watch_instances("dynamo", "Worker", "generate")
    await watch.wait_for(1)
    ...
    await disc.close()                     # revokes the lease: registrations vanish

`MemoryDiscovery` (several sharing one `MemoryStore`) has the same semantics without
I/O, for unit tests. Key layout and codec: see `_types`.
"""

from __future__ import annotations

from dynagraph.runtime.discovery._base import DiscoveryBase
from dynagraph.runtime.discovery._endpoints import discovery_from_env, parse_endpoints
from dynagraph.runtime.discovery._etcd import EtcdDiscovery
from dynagraph.runtime.discovery._memory import MemoryDiscovery, MemoryStore
from dynagraph.runtime.discovery._types import (
    Discovery,
    InstanceInfo,
    endpoint_prefix,
    instance_key,
)
from dynagraph.runtime.discovery._watch import InstanceWatch

__all__ = [
    "Discovery",
    "DiscoveryBase",
    "EtcdDiscovery",
    "InstanceInfo",
    "InstanceWatch",
    "MemoryDiscovery",
    "MemoryStore",
    "discovery_from_env",
    "endpoint_prefix",
    "instance_key",
    "parse_endpoints",
]
