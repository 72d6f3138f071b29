"""The health service over real servers on free ports: grpc.aio ingest, uvicorn HTTP, a real
quorum service. Auth, agent -> central forwarding, fail-stop -> eviction -> new quorum, policy
evictions, and clear errors for bad inputs."""

from __future__ import annotations

import asyncio
import math
import time
from datetime import timedelta

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.health.client import TelemetryClient
from fthsdp.services.health.client_http import HealthClient
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.domain import AuthError, InvalidReportError
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint
from tests.integration.conftest import QuorumServerFactory, eventually
from tests.integration.health_support import (
    NodeFactory,
    health_nodes,
    heartbeat,
    incident,
    rank_ref,
    report,
)

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


@pytest.fixture
async def make_node(token: str):  # type: ignore[no-untyped-def]
    async with health_nodes(token) as make:
        yield make


async def test_every_api_needs_the_token_except_probes_and_the_page(
    make_node: NodeFactory, token: str
) -> None:
    central = await make_node()
    request = pb.ReportRequest(source="x", heartbeats=[heartbeat("r0")])
    for presented in (None, "wrong-token-wrong-token"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await report(central.grpc_address, presented, request)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert central.engine is not None and central.engine.replicas() == []
    async with httpx.AsyncClient(base_url=central.http_url or "") as http:
        for path in ("/v1/replicas", "/v1/incidents", "/v1/detectors", "/metrics"):
            response = await http.get(path)
            assert response.status_code == 401, path
            assert response.json()["error"] == "unauthorized"
        assert (
            await http.get("/v1/replicas", headers={"authorization": "Bearer " + token})
        ).is_success
        for path in ("/livez", "/readyz", "/dashboard", "/static/dashboard.js"):
            assert (await http.get(path)).status_code == 200, path
    with HealthClient(central.http_url or "", "x" * 20) as intruder, pytest.raises(AuthError):
        await asyncio.to_thread(intruder.replicas)


async def test_agent_forwards_telemetry_and_node_state_to_central(
    make_node: NodeFactory, token: str
) -> None:
    central = await make_node()
    agent = await make_node(mode="agent", central=central.grpc_address, node="node-a")
    client = TelemetryClient(agent.grpc_address, token, replica_id="r0", rank=1, host="node-a")
    try:
        now = time.time()
        client.step(7, started_at=now - 0.5, duration_s=0.5, tokens=1024, sum_seq_len_sq=4096)
        client.fingerprint(7, "abc123")
        engine = central.engine
        assert engine is not None

        async def central_sees_it() -> bool:
            views = {v.replica_id: v for v in engine.replicas()}
            steps = await engine.store.records("steps", 10)
            return "r0" in views and views["r0"].last_step == 7 and len(steps) == 1

        await eventually(central_sees_it)
        view = engine.replicas()[0]
        assert view.hosts == ("node-a",) and view.state == "healthy"
        assert [n.node for n in engine.nodes()] == ["node-a"]
        steps = await engine.store.records("steps", 10)
        assert steps[0]["rank"] == {"replica_id": "r0", "rank": 1}
        assert steps[0]["tokens"] == 1024 and steps[0]["sum_seq_len_sq"] == 4096
        # The time was rebased onto the receiver's clock, within the transit delay.
        assert abs(steps[0]["started_at"] - (now - 0.5)) < 2.0
    finally:
        await asyncio.to_thread(client.close)


async def test_an_agent_forwards_at_the_interval_central_asks_for(
    make_node: NodeFactory, token: str
) -> None:
    """A central service that takes 2 forwards a second asks its 3 agents for one every 1.5 s
    (not their own 0.2 s), and they follow from their next forward on."""
    central = await make_node(ingest_forwards_per_s=2.0)
    agents = [
        await make_node(mode="agent", central=central.grpc_address, node=f"node-{i}")
        for i in range(3)
    ]
    engine = central.engine
    assert engine is not None

    async def asked() -> bool:
        return all(a.agent is not None and a.agent.asked_interval_s == 1.5 for a in agents)

    await eventually(asked)
    assert engine.forward_interval_ms() == 1500
    agent = agents[0].agent
    assert agent is not None
    before, started = agent.forwarded, time.monotonic()
    await eventually(lambda: _async(agent.forwarded >= before + 2))
    # Two more forwards take at least one full asked interval (at 0.2 s they took 0.4 s).
    assert time.monotonic() - started >= 1.5


async def test_an_incident_is_forwarded_at_once_whatever_interval_central_asked_for(
    make_node: NodeFactory, token: str
) -> None:
    """Central asks its one agent for a forward every 20 s; a rank of that agent falls
    silent, and the agent's incident reaches central within seconds, not at the next
    interval."""
    central = await make_node(ingest_forwards_per_s=0.05)
    agent = await make_node(
        mode="agent", central=central.grpc_address, heartbeat_timeout=timedelta(milliseconds=400)
    )
    rank = TelemetryClient(agent.grpc_address, token, replica_id="r1", rank=0, host="testhost")
    engine = central.engine
    assert engine is not None and agent.agent is not None
    node = agent.agent
    try:
        await eventually(lambda: _async(len(node.node_state().ranks) == 1))
        await eventually(lambda: _async(node.asked_interval_s == 20.0))
        await asyncio.to_thread(rank.close, leave=False)  # silent, no clean-exit notice

        async def central_has_the_incident() -> bool:
            return bool(await engine.store.incidents(kind=None))

        # Well before the next node-state forward, 20 s away.
        await eventually(central_has_the_incident, seconds=5.0)
        (found,) = await engine.store.incidents()
        assert (found.kind.value, found.replica_id, found.evidence["found_by"]) == (
            "fail_stop",
            "r1",
            "agent:testhost",
        )
    finally:
        await asyncio.to_thread(rank.close)


async def test_a_backlog_of_records_goes_at_the_agents_own_pace(
    make_node: NodeFactory, token: str
) -> None:
    """Central asks for a forward every 20 s; 30 step records wait at an agent that sends 10
    a batch. They all reach central within seconds: the spaced interval is for node states."""
    central = await make_node(ingest_forwards_per_s=0.05)
    agent = await make_node(mode="agent", central=central.grpc_address, max_batch_records=10)
    rank = TelemetryClient(agent.grpc_address, token, replica_id="r0", rank=0, host="testhost")
    engine = central.engine
    assert engine is not None and agent.agent is not None
    node = agent.agent
    try:
        await eventually(lambda: _async(node.asked_interval_s == 20.0))
        now = time.time()
        for step in range(30):
            rank.step(step, started_at=now, duration_s=0.01, tokens=1, sum_seq_len_sq=1)

        async def all_arrived() -> bool:
            return len(await engine.store.records("steps", 100)) == 30

        await eventually(all_arrived, seconds=10.0)  # not at 20 s intervals
    finally:
        await asyncio.to_thread(rank.close)


async def _two_replica_quorum(address: str, token: str) -> tuple[AsyncQuorumClient, int]:
    """Replicas r0 and r1 joined and in a first quorum; returns r0's client and incarnation."""
    a, b = AsyncQuorumClient(address, token), AsyncQuorumClient(address, token)
    inc_a, inc_b = await a.join("r0", [RANK]), await b.join("r1", [RANK])
    first = await asyncio.gather(
        a.quorum("r0", inc_a, 0, timeout=timedelta(seconds=10)),
        b.quorum("r1", inc_b, 0, timeout=timedelta(seconds=10)),
    )
    assert {m.replica_id for m in first[0].members} == {"r0", "r1"}
    await b.close()
    return a, inc_a


async def test_a_silent_rank_is_reported_by_its_agent_and_a_new_quorum_forms_without_it(
    make_node: NodeFactory, make_quorum_server: QuorumServerFactory, token: str
) -> None:
    # The quorum service's own timeouts are long, so only the agent's report can explain a
    # quick new quorum without r1.
    quorum = await make_quorum_server(
        heartbeat_timeout=timedelta(seconds=30), join_timeout=timedelta(seconds=30)
    )
    central = await make_node()
    agent = await make_node(
        mode="agent",
        central=central.grpc_address,
        quorum=(quorum.address,),
        heartbeat_timeout=timedelta(milliseconds=400),
    )
    leader, incarnation = await _two_replica_quorum(quorum.address, token)
    ranks = [
        TelemetryClient(agent.grpc_address, token, replica_id=r, rank=0, host="testhost")
        for r in ("r0", "r1")
    ]
    try:
        assert agent.agent is not None
        await eventually(lambda: _async(len(agent.agent.node_state().ranks) == 2))
        # r1's process falls silent (no clean-exit notice).
        await asyncio.to_thread(ranks[1].close, leave=False)
        silent_since = time.monotonic()
        new = await leader.quorum("r0", incarnation, 1, timeout=timedelta(seconds=10))
        elapsed = time.monotonic() - silent_since
        assert [m.replica_id for m in new.members] == ["r0"]
        print(f"silence -> new quorum: {elapsed:.3f} s")
        assert elapsed < 3.0, f"new quorum after {elapsed:.2f} s"
        engine = central.engine
        assert engine is not None

        async def central_has_the_incident() -> bool:
            return bool(await engine.store.incidents(kind=None))

        await eventually(central_has_the_incident)
        (found,) = await engine.store.incidents()
        assert (found.kind.value, found.replica_id, found.rank) == ("fail_stop", "r1", 0)
        assert found.evidence["quorum"] == "evicted"
        assert found.evidence["found_by"] == "agent:testhost"
        await eventually(lambda: _async(_state(engine, "r1") == "down"))
        assert _state(engine, "r0") == "healthy"
    finally:
        for client in ranks:
            await asyncio.to_thread(client.close)
        await leader.close()


def _state(engine: object, replica_id: str) -> str | None:
    views = {v.replica_id: v for v in engine.replicas()}  # type: ignore[attr-defined]
    view = views.get(replica_id)
    return None if view is None else view.state


async def _async(value: bool) -> bool:
    return value


async def test_sdc_is_evicted_by_policy_and_fail_slow_policy_is_settable(
    make_node: NodeFactory, make_quorum_server: QuorumServerFactory, token: str
) -> None:
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    clients = [AsyncQuorumClient(quorum.address, token) for _ in range(3)]
    for i, client in enumerate(clients):
        await client.join(f"r{i}", [RANK])
    central = await make_node(quorum=(quorum.address,))
    fingerprints = [
        pb.FingerprintRecord(replica_id=f"r{i}", step=5, digest="bad" if i == 2 else "good")
        for i in range(3)
    ]
    await report(central.grpc_address, token, pb.ReportRequest(fingerprints=fingerprints))

    async def r2_evicted() -> bool:
        status = await clients[0].status()
        return [m.replica_id for m in status.members] == ["r0", "r1"]

    await eventually(r2_evicted)
    http = HealthClient(central.http_url or "", token)
    incidents = await asyncio.to_thread(http.incidents, kind="sdc")
    assert [(i["replica_id"], i["evidence"]["policy"]) for i in incidents] == [("r2", "evict")]
    assert await asyncio.to_thread(http.incidents, kind="hang") == []
    changed = await asyncio.to_thread(http.set_detectors, {"fail_slow_policy": "evict"})
    assert changed["fail_slow_policy"] == "evict"
    assert central.engine is not None
    assert central.engine.detectors.fail_slow_policy == "evict"
    assert central.engine.detectors.heartbeat_timeout_s == DetectorConfig().heartbeat_timeout_s
    history = await asyncio.to_thread(http.quorum_history)
    assert history["configured"] is True
    assert [m["replica_id"] for m in history["members"]] == ["r0", "r1"]
    http.close()
    for client in clients:
        await client.close()


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (
            pb.ReportRequest(heartbeats=[pb.HeartbeatRecord(rank=rank_ref(""), at=1.0)]),
            "replica_id",
        ),
        (pb.ReportRequest(heartbeats=[heartbeat("r 0")]), "whitespace"),
        (pb.ReportRequest(heartbeats=[heartbeat("r0", rank=-1)]), "rank"),
        (
            pb.ReportRequest(heartbeats=[pb.HeartbeatRecord(rank=rank_ref("r0"), at=math.nan)]),
            "heartbeat.at",
        ),
        (pb.ReportRequest(heartbeats=[heartbeat("r0")] * 10001), "at most 10000"),
        (pb.ReportRequest(incidents=[incident("meltdown", "r0", "x")]), "incident.kind"),
        (
            pb.ReportRequest(
                incidents=[pb.IncidentRecord(kind="sdc", replica_id="r0", evidence_json="[1]")]
            ),
            "JSON object",
        ),
        (
            pb.ReportRequest(
                steps=[pb.StepRecord(rank=rank_ref("r0"), duration_s=1.0, exchange_wait_s=2.0)]
            ),
            "exchange_wait_s",
        ),
    ],
)
async def test_bad_batches_are_invalid_argument_and_change_nothing(
    make_node: NodeFactory, token: str, request_: pb.ReportRequest, needle: str
) -> None:
    central = await make_node(http_port=None)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await report(central.grpc_address, token, request_)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (refused.value.details() or "")
    assert central.engine is not None and central.engine.replicas() == []


async def test_a_batch_held_up_in_the_network_is_refused_and_changes_nothing(
    make_node: NodeFactory, token: str
) -> None:
    """A forward its agent gave up on, delivered seconds later (a cut link's TCP retransmit),
    must not read as fresh: its heartbeat would show the rank beating now at an old step."""
    central = await make_node(http_port=None)
    engine = central.engine
    assert engine is not None

    def batch(step: int, age_s: float) -> pb.ReportRequest:
        now = time.time()
        beat = pb.HeartbeatRecord(rank=rank_ref("r0"), step=step, at=now - age_s)
        return pb.ReportRequest(source="agent:h", host="h", sent_at=now - age_s, heartbeats=[beat])

    await report(central.grpc_address, token, batch(40, 0.0))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await report(central.grpc_address, token, batch(50, 6.0))  # a step not seen yet
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "later than this sender's others" in (refused.value.details() or "")
    (view,) = engine.replicas()
    assert view.last_step == 40
    # Another sender's first batch, however its clock reads, is on time; so is the agent's next.
    other = batch(41, 6.0)
    other.source, other.host = "agent:g", "g"
    await report(central.grpc_address, token, other)
    await report(central.grpc_address, token, batch(42, 0.0))
    (view,) = engine.replicas()
    assert view.last_step == 42


async def test_bad_http_inputs_are_400_with_a_json_body(make_node: NodeFactory, token: str) -> None:
    central = await make_node()
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=central.http_url or "", headers=headers) as http:
        for path in (
            "/v1/incidents?kind=meltdown",
            "/v1/incidents?limit=0",
            "/v1/incidents?since=-1",
            "/v1/incidents?since=nan",
        ):
            response = await http.get(path)
            assert response.status_code == 400, path
            assert response.json()["error"] == "invalid_argument"
        before = (await http.get("/v1/detectors")).json()
        for body in (
            b'{"no_such_setting": 1}',
            b'{"fail_slow_policy": "shrug"}',
            b"[1]",
            b"{",
            # Sizes that broke the detectors' memory, and a timeout that fails every rank:
            b'{"slow_rank_window": 9223372036854775808}',
            b'{"slow_rank_window": 9223372036854775807}',
            b'{"heartbeat_timeout_s": 1e-300}',
            b'{"hang_timeout_s": 1e300}',
        ):
            response = await http.put("/v1/detectors", content=body)
            assert response.status_code == 400, body
            assert response.json()["error"] == "invalid_argument"
        big = b'{"x": "' + b"a" * 70_000 + b'"}'
        assert (await http.put("/v1/detectors", content=big)).status_code == 413
        assert (await http.get("/v1/records/nope")).status_code == 404
        assert (await http.get("/v1/detectors")).json() == before  # nothing half-applied
    with HealthClient(central.http_url or "", token) as client, pytest.raises(InvalidReportError):
        await asyncio.to_thread(client.incidents, kind="meltdown")


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from a /metrics page."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_one_report_of_5000_open_collectives_in_distinct_groups_keeps_the_bound(
    make_node: NodeFactory, token: str
) -> None:
    central = await make_node()
    now = time.time()
    flood = [
        pb.CollectiveRecord(
            rank=rank_ref("r0"), group=f"ftar:{q}:0", seq=0, op="allreduce", started_at=now
        )
        for q in range(5_000)
    ]
    await report(central.grpc_address, token, pb.ReportRequest(source="x", collectives=flood))
    bound = DetectorConfig().collective_groups_per_rank
    dropped = ("fthsdp_health_collective_groups_dropped_total", (("reason", "rank_bound"),))
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=central.http_url or "", headers=headers) as http:

        async def evaluated() -> bool:
            page = (await http.get("/metrics")).raise_for_status().text
            return _samples(page).get(dropped) == 5_000 - bound

        await eventually(evaluated)
        samples = _samples((await http.get("/metrics")).text)
    assert samples[("fthsdp_health_collective_groups", ())] == bound
    assert samples[("fthsdp_health_open_collectives", ())] == bound
    assert central.engine is not None
    assert central.engine.core.stats().groups == bound
    assert central.engine.core.stats().open_collectives == bound
