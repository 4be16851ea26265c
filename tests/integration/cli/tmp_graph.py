"""One component that writes where its temporary files go (``tempfile.gettempdir()``)
to the file named by ``TMPDIR_REPORT``."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynagraph.sdk import async_on_start, endpoint, service


@service(dynamo={"namespace": "tmpcheck"})
class Reporter:
    @async_on_start
    async def start(self) -> None:
        report = Path(os.environ["TMPDIR_REPORT"])
        await asyncio.to_thread(report.write_text, tempfile.gettempdir())

    @endpoint()
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[int]:
        yield 1
