"""A node agent's quorum event stream follows its own host's replicas only (a real quorum
service and a real agent; ranks beat it over gRPC). It opens once a rank beats here, learns
the incarnations that joined before from the snapshot, opens a wider stream when another
replica's rank beats here and ends the old one (one stream per agent on the service), and
hears later joins of its replicas, not those of other hosts' replicas; a failed stream comes back
after a growing jittered wait."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from fthsdp.services.common.backoff import Retries
from fthsdp.services.common.tokens import Token
from fthsdp.services.health import quorum_reporter
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.client import TelemetryClient
from fthsdp.services.health.quorum_reporter import QuorumReporter
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint
from fthsdp.services.quorum.server import QuorumServer
from tests.integration.conftest import QuorumServerFactory, eventually
from tests.integration.health_support import NodeFactory, health_nodes

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


@pytest.fixture
async def make_node(token: str) -> AsyncIterator[NodeFactory]:
    async with health_nodes(token) as make:
        yield make


async def _true(value: bool) -> bool:
    return value


def _incarnation(agent: NodeAgent, replica_id: str) -> int | None:
    return agent._incarnation_at(replica_id, agent._clock())


async def test_the_stream_follows_this_hosts_replicas_and_their_incarnations(
    make_node: NodeFactory, make_quorum_server: QuorumServerFactory, token: str
) -> None:
    quorum: QuorumServer = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    node = await make_node(
        mode="agent", node="node-a", quorum=(quorum.address,), failure_action="report"
    )
    assert node.agent is not None
    agent = node.agent
    client = AsyncQuorumClient(quorum.address, token)
    ranks: list[TelemetryClient] = []
    try:
        # No rank here yet: no stream.
        assert agent.watched == frozenset() and quorum.coordinator.watch_streams == 0
        first = {r: await client.join(r, [RANK]) for r in ("r0", "r1", "elsewhere")}
        ranks.append(TelemetryClient(node.grpc_address, token, replica_id="r0", rank=0))
        await eventually(lambda: _true(agent.watched == {"r0"}))
        assert _incarnation(agent, "r0") == first["r0"]  # joined before: from the snapshot
        assert quorum.coordinator.watch_streams == 1

        ranks.append(TelemetryClient(node.grpc_address, token, replica_id="r1", rank=0))
        await eventually(lambda: _true(agent.watched == {"r0", "r1"}))
        assert _incarnation(agent, "r1") == first["r1"]
        await eventually(lambda: _true(quorum.coordinator.watch_streams == 1))

        again = {r: await client.join(r, [RANK]) for r in ("r1", "elsewhere")}
        await eventually(lambda: _true(_incarnation(agent, "r1") == again["r1"]))
        assert "elsewhere" not in agent._joins  # another host's replica
        assert _incarnation(agent, "r0") == first["r0"]
    finally:
        for rank in ranks:
            rank.close()
        await client.close()


async def test_a_stream_that_fails_comes_back_after_a_growing_jittered_wait(
    monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    """12K agents retrying every 0.2 s after a quorum service restart would be 60K stream
    opens a second: the wait grows to `WATCH_RETRY.maximum`, jittered."""
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(quorum_reporter, "_sleep", record)
    # Seeded jitter: with fresh entropy the growth check below fails once in ~10^4 runs (five
    # uniform draws up to 5 s all under 0.8 s).
    monkeypatch.setattr(
        quorum_reporter, "Retries", lambda backoff: Retries(backoff, random.Random(7))
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: every stream is refused at once
        reporter = QuorumReporter([f"127.0.0.1:{s.getsockname()[1]}"], Token(token))
        teardowns = reporter.teardowns(replicas=("r0",))
        task = asyncio.create_task(anext(teardowns))
        try:
            await eventually(lambda: _true(len(waits) >= 10))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await teardowns.aclose()
            await reporter.close()
    bounds = [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0, 5.0]
    assert all(0.0 <= w <= b for w, b in zip(waits, bounds, strict=False))
    assert max(waits[5:10]) > 0.8  # grown past the first bounds, not pinned at 0.2
