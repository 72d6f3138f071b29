"""A real health ingest server (gRPC, port 0) over a sink that keeps what it takes, for tests of
what talks to it (the rank client, an agent's forwards)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import ReportBatch
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.server import IngestServer


class RecordingSink:
    """Keeps every batch; `gate` (when cleared) holds every Report open."""

    def __init__(self) -> None:
        self.batches: list[ReportBatch] = []
        self.entered = 0
        """Reports that reached the sink (held ones included)."""
        self.gate = asyncio.Event()
        self.gate.set()

    async def ingest(self, batch: ReportBatch) -> None:
        self.entered += 1
        await self.gate.wait()
        self.batches.append(batch)

    def forward_interval_ms(self) -> int:
        return 0


@asynccontextmanager
async def ingest_server(token: str) -> AsyncIterator[tuple[RecordingSink, IngestServer]]:
    """A started server and its sink; stopped (the gate opened) on exit."""
    sink = RecordingSink()
    server = IngestServer(
        host="127.0.0.1",
        port=0,
        token=Token(token),
        sink=sink,
        metrics=HealthMetrics(),
        grace=timedelta(milliseconds=100),
    )
    await server.start()
    try:
        yield sink, server
    finally:
        sink.gate.set()
        await server.stop()
