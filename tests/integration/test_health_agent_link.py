"""A node agent cut from health central (issue 15): real quorum, central and agent servers on
free ports, the agent's link to central through a TCP proxy that blackholes it. Behind the cut
the replicas still train and beat the quorum service: central must not evict them. A rank that
dies while its agent is connected is still reported at once, for its own incarnation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from fthsdp.services.health.client import TelemetryClient
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint
from tests.integration.conftest import QuorumServerFactory, eventually
from tests.integration.health_support import NodeFactory, health_nodes
from tests.tcp_proxy import TcpProxy

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
REPLICAS = ("r0", "r1")


@pytest.fixture
async def make_node(token: str) -> AsyncIterator[NodeFactory]:
    async with health_nodes(token) as make:
        yield make


def _sample(node: HealthProcess, name: str, **labels: str) -> float:
    return node.metrics.registry.get_sample_value(name, labels) or 0.0


def _states(node: HealthProcess) -> dict[str, str]:
    assert node.engine is not None
    return {v.replica_id: v.state for v in node.engine.replicas()}


async def _members(client: AsyncQuorumClient) -> set[str]:
    return {m.replica_id for m in (await client.status()).members}


async def test_a_cut_agent_link_evicts_nobody_and_a_death_behind_a_live_agent_is_reported(
    make_node: NodeFactory, make_quorum_server: QuorumServerFactory, token: str
) -> None:
    # The quorum service's own timeouts are long: only a health report could evict anyone.
    quorum = await make_quorum_server(
        heartbeat_timeout=timedelta(seconds=30), join_timeout=timedelta(seconds=30)
    )
    central = await make_node(
        quorum=(quorum.address,),
        failure_action="report",
        detectors=DetectorConfig(heartbeat_timeout_s=0.5),
    )
    host, port = central.grpc_address.rsplit(":", 1)
    proxy = TcpProxy(host, int(port)).start()
    agent = await make_node(
        mode="agent",
        node="node-a",
        central=f"127.0.0.1:{proxy.port}",
        quorum=(quorum.address,),
        failure_action="report",  # the agent follows joins for the incarnation even so
        heartbeat_timeout=timedelta(milliseconds=400),
    )
    assert agent.agent is not None and central.engine is not None
    node_agent = agent.agent
    clients = [AsyncQuorumClient(quorum.address, token) for _ in REPLICAS]
    incarnations = {r: await c.join(r, [RANK]) for c, r in zip(clients, REPLICAS, strict=True)}
    ranks = [
        TelemetryClient(agent.grpc_address, token, replica_id=r, rank=0, host="node-a")
        for r in REPLICAS
    ]
    try:
        await eventually(lambda: _true(_states(central) == dict.fromkeys(REPLICAS, "healthy")))
        # Its event stream follows its replicas; the snapshot names the incarnations they joined
        # as before the stream.
        await eventually(lambda: _true(node_agent.watched == set(REPLICAS)))
        proxy.blackhole()
        # Central finds both ranks silent behind the lost agent and leaves them to the quorum
        # service (before the fix it reported them, and the quorum service evicted both).
        await eventually(
            lambda: _true(_sample(central, "fthsdp_health_failstops_unreachable_total") >= 2)
        )
        assert await _members(clients[0]) == set(REPLICAS)
        assert _sample(central, "fthsdp_health_quorum_reports_total", outcome="evicted") == 0
        assert await central.engine.store.incidents() == []

        proxy.heal()
        await eventually(
            lambda: _true(_states(central) == dict.fromkeys(REPLICAS, "healthy")), seconds=15
        )
        assert await _members(clients[0]) == set(REPLICAS)
        # r1's process dies (no goodbye) while its agent is connected: reported by the agent
        # for r1's incarnation, and the incident reaches central.
        await asyncio.to_thread(ranks[1].close, leave=False)
        silent_since = time.monotonic()
        await eventually(lambda: _members_are(clients[0], {"r0"}))
        elapsed = time.monotonic() - silent_since
        assert elapsed < 3.0, f"r1 evicted {elapsed:.2f} s after its rank fell silent"
        engine = central.engine

        async def central_has_the_incident() -> bool:
            return bool(await engine.store.incidents())

        await eventually(central_has_the_incident)
        (found,) = await engine.store.incidents()
        assert (found.kind.value, found.replica_id, found.rank) == ("fail_stop", "r1", 0)
        assert found.evidence["found_by"] == "agent:node-a"
        assert found.evidence["quorum"] == "evicted"
        assert found.evidence["incarnation"] == incarnations["r1"]
    finally:
        for rank in ranks:
            await asyncio.to_thread(rank.close)
        for client in clients:
            await client.close()
        proxy.stop()


async def _members_are(client: AsyncQuorumClient, expected: set[str]) -> bool:
    return await _members(client) == expected


async def _true(value: bool) -> bool:
    return value
