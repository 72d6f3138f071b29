"""A replica leader's Watch stream keeps its replica alive without Heartbeat calls (at 1,536
replicas a beat every 0.2 s per leader was ~7,700 calls/s, more than the service could take): the
service counts the replica alive while the stream is open, the heartbeat timeout runs from when
it ends, and a SIGKILLed leader's stream ends at once. A stale incarnation holds nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta

import pytest

from fthsdp.services.quorum.client import AsyncQuorumClient, QuorumClient
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import QuorumServer, QuorumServerThread
from tests.integration.conftest import eventually
from tests.integration.test_quorum_server import RANK

HEARTBEAT = timedelta(milliseconds=600)


async def _members(client: AsyncQuorumClient) -> set[str]:
    return {m.replica_id for m in (await client.status()).members}


async def test_an_open_leader_stream_keeps_its_replica_alive_and_its_end_starts_the_timeout(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    server = await make_quorum_server(heartbeat_timeout=HEARTBEAT)
    async with AsyncQuorumClient(server.address, token) as client:
        held = await client.join("held", [RANK])
        await client.join("silent", [RANK])
        stream = client.watch(holder=("held", held))
        events = aiter(stream)
        assert (await anext(events)).kind == "snapshot"
        # Neither beats: the silent one goes after the timeout, the held one stays.
        await eventually(lambda: _gone(client, "silent"))
        started = time.monotonic()
        while time.monotonic() - started < 3 * HEARTBEAT.total_seconds():
            status = {m.replica_id: m for m in (await client.status()).members}
            assert "held" in status and status["held"].live
            await asyncio.sleep(0.05)
        stream.cancel()
        ended = time.monotonic()
        await eventually(lambda: _gone(client, "held"))
        # Not before the heartbeat timeout has run from the stream's end.
        assert time.monotonic() - ended >= HEARTBEAT.total_seconds() * 0.9


async def test_a_stale_incarnation_gets_a_plain_stream_that_holds_nothing(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    server = await make_quorum_server(heartbeat_timeout=HEARTBEAT)
    async with AsyncQuorumClient(server.address, token) as client:
        first = await client.join("r", [RANK])
        second = await client.join("r", [RANK])  # a restart: the first is superseded
        stale = client.watch(holder=("r", first))
        events = aiter(stale)
        snapshot = await anext(events)
        assert (snapshot.kind, snapshot.incarnation) == ("snapshot", None)
        await eventually(lambda: _gone(client, "r"))
        # The stream still carries events: the eviction, then a rejoin.
        evicted = await anext(events)
        assert (evicted.kind, evicted.incarnation) == ("evicted", second)
        third = await client.join("r", [RANK])
        joined = await anext(events)
        assert (joined.kind, joined.incarnation) == ("joined", third)
        assert third > second
        held = client.watch(holder=("r", third))
        assert (await anext(aiter(held))).incarnation == third
        stale.cancel()
        held.cancel()


def test_a_killed_leaders_stream_ends_and_its_replica_is_evicted(
    quorum_thread_fast: tuple[str, str],
) -> None:
    """The leader holding the stream is another process; SIGKILL it and the replica goes within
    the heartbeat timeout of the kill, with no report from anyone."""
    address, token = quorum_thread_fast
    code = (
        "import sys, time\n"
        "from fthsdp.services.quorum.client import QuorumClient, RankEndpoint\n"
        "c = QuorumClient(sys.argv[1], sys.argv[2])\n"
        "inc = c.join('leader', [RankEndpoint(ftar='127.0.0.1:1', checkpoint='http://x:1')])\n"
        "stream = c.watch(holder=('leader', inc))\n"
        "next(stream)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, address, token], stdout=subprocess.PIPE, text=True
    )
    client = QuorumClient(address, token)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert "leader" in {m.replica_id for m in client.status().members}
        proc.kill()
        killed = time.monotonic()
        deadline = killed + 10
        while "leader" in {m.replica_id for m in client.status().members}:
            assert time.monotonic() < deadline, "the killed leader's replica was never evicted"
            time.sleep(0.02)
        # The stream ended at the kill (the kernel reset the connection), then the timeout ran.
        assert time.monotonic() - killed < HEARTBEAT.total_seconds() + 2.0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        client.close()


async def _gone(client: AsyncQuorumClient, replica_id: str) -> bool:
    return replica_id not in await _members(client)


@pytest.fixture
def quorum_thread_fast(token: str) -> Iterator[tuple[str, str]]:
    """A quorum server on its own loop thread with a short heartbeat timeout."""
    thread = QuorumServerThread(
        QuorumConfig(port=0, admin_port=0, heartbeat_timeout=HEARTBEAT), token
    )
    thread.start()
    yield thread.address, token
    thread.stop(timedelta(seconds=0.5))
