"""Integration fixtures. Quorum service only: a real grpc.aio server on port 0."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import QuorumServer, QuorumServerThread

QuorumServerFactory = Callable[..., Awaitable[QuorumServer]]


@pytest.fixture
async def make_quorum_server(token: str) -> AsyncIterator[QuorumServerFactory]:
    """Starts quorum servers on free ports (config fields as keyword overrides); stops them all."""
    servers: list[QuorumServer] = []

    async def make(**overrides: Any) -> QuorumServer:
        fields: dict[str, Any] = {"port": 0, "admin_port": 0, **overrides}
        server = QuorumServer(QuorumConfig(**fields), token)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop(timedelta(seconds=0.5))


@pytest.fixture
async def quorum_server(make_quorum_server: QuorumServerFactory) -> QuorumServer:
    """A quorum server with the default rules on a free port."""
    return await make_quorum_server()


@pytest.fixture
def make_quorum_thread(token: str) -> Iterator[Callable[..., QuorumServerThread]]:
    """Starts quorum servers on their own loop threads, for synchronous clients (config fields
    as keyword overrides); stops them all."""
    threads: list[QuorumServerThread] = []

    def make(**overrides: Any) -> QuorumServerThread:
        thread = QuorumServerThread(
            QuorumConfig(**{"port": 0, "admin_port": 0, **overrides}), token
        )
        thread.start()
        threads.append(thread)
        return thread

    yield make
    for thread in threads:
        thread.stop(timedelta(seconds=0.5))


@pytest.fixture
def quorum_thread(make_quorum_thread: Callable[..., QuorumServerThread]) -> QuorumServerThread:
    """A quorum server on its own loop thread, for synchronous clients."""
    return make_quorum_thread(join_timeout=timedelta(seconds=1))


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Polls `check` until it holds; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
