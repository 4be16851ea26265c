"""A stand-in worker process: registers one endpoint, prints ``ready <id-hex>``, waits.

Run as ``python -m tests.integration.discovery._registrar ETCD_URL TTL``; the test kills
it with SIGKILL. It exits by itself after 60 s so it can never be left behind.
"""

from __future__ import annotations

import asyncio
import os
import sys

from dynagraph.runtime.discovery import EtcdDiscovery


async def main(url: str, ttl: int) -> None:
    disc = EtcdDiscovery(url, lease_ttl=ttl)
    await disc.start()
    await disc.register("itest", "Victim", "generate", "127.0.0.1:1", {"pid": os.getpid()})
    sys.stdout.write(f"ready {disc.instance_id:x}\n")
    sys.stdout.flush()
    await asyncio.sleep(60)
    await disc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
