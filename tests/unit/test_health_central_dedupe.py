"""One fault, one incident: the central engine's fail-stop verdict on a live node agent's rank
waits for that agent's own incident, and is acted on only when none comes (fake clock, in-memory
store, a recording quorum link)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from fthsdp.services.health.central import AGENT_GRACE_S, CentralEngine
from fthsdp.services.health.client_codec import NodeRank, NodeState, ReportBatch
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.store import InMemoryTelemetryStore
from fthsdp.services.health.telemetry import Incident, IncidentKind, RankId

R1 = RankId(replica_id="r1", rank=0)
R0 = RankId(replica_id="r0", rank=0)
TIMEOUT_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingQuorum:
    def __init__(self) -> None:
        self.reports: list[tuple[str, bool]] = []

    async def report_failure(
        self, replica_id: str, reason: str, *, reporter: str, teardown: bool
    ) -> str:
        self.reports.append((replica_id, teardown))
        return "evicted"


def _engine(clock: Clock, quorum: RecordingQuorum | None = None) -> CentralEngine:
    return CentralEngine(
        HealthConfig(mode="central", failure_action="kill"),
        DetectorConfig(heartbeat_timeout_s=TIMEOUT_S),
        InMemoryTelemetryStore(),
        HealthMetrics(CollectorRegistry()),
        quorum=quorum,  # type: ignore[arg-type]
        clock=clock,
    )


def _node_state(*ranks: RankId) -> ReportBatch:
    listed = tuple(NodeRank(rank=r, step=3, silent_s=0.0, process="p") for r in ranks)
    return ReportBatch(
        source="agent:node-a", host="node-a", node=NodeState(node="node-a", ranks=listed)
    )


def _agent_failstop(quorum: str, *, rank: int = 0, action: str = "report") -> ReportBatch:
    incident = Incident(
        kind=IncidentKind.FAIL_STOP,
        replica_id="r1",
        rank=rank,
        host="node-a",
        detected_at=0.0,
        summary=f"rank {rank} of replica r1 stopped heartbeating",
        evidence={"found_by": "agent:node-a", "quorum": quorum, "action": action},
    )
    return ReportBatch(source="agent:node-a", host="node-a", incidents=(incident,))


async def _run(engine: CentralEngine, clock: Clock, seconds: float, *beating: RankId) -> None:
    """The agent forwards its node state (the ranks still beating) every 0.1 s, and the engine
    evaluates after each."""
    for _ in range(round(seconds / 0.1)):
        clock.now += 0.1
        await engine.ingest(_node_state(*beating))
        await engine.evaluate_once()


async def _stored(engine: CentralEngine) -> list[tuple[str, str, Any]]:
    return [
        (i.kind.value, i.replica_id, i.evidence.get("found_by"))
        for i in await engine.store.incidents()
    ]


async def test_central_verdict_before_the_agents_incident_is_dropped_for_it() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    # r1 stops: the agent no longer lists it; the core finds it silent a timeout later, and
    # the agent's own incident (after its quorum report) arrives half a second after that.
    await _run(engine, clock, TIMEOUT_S + 0.3, R0)
    assert _state(engine, "r1") == "down"  # the held verdict is in the state already
    assert await _stored(engine) == []
    await engine.ingest(_agent_failstop("evicted"))
    await _run(engine, clock, AGENT_GRACE_S + 0.5, R0)
    assert await _stored(engine) == [("fail_stop", "r1", "agent:node-a")]
    assert quorum.reports == []  # the agent evicted it; nobody here evicts it again


async def test_central_verdict_is_acted_on_when_the_live_agent_says_nothing() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await _run(engine, clock, TIMEOUT_S + 0.3, R0)
    assert await _stored(engine) == []
    await _run(engine, clock, AGENT_GRACE_S, R0)
    assert await _stored(engine) == [("fail_stop", "r1", "central")]
    await _drain(engine)
    assert quorum.reports == [("r1", True)]


async def test_a_replica_its_agent_tore_down_is_not_evicted_again_from_here() -> None:
    """Rank 1 of r1 dies; its agent reports it (for its incarnation) and tears r1 down on its
    node, which ends rank 0 too. The core finds rank 0 silent as well; that verdict is dropped,
    though no agent incident names rank 0: a report from here names no incarnation, and would
    evict the warm spare that took over as r1's next incarnation meanwhile."""
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await engine.ingest(_agent_failstop("evicted", rank=1, action="kill"))
    await _run(engine, clock, TIMEOUT_S + 0.3, R0)  # rank 0 of r1 is silent now
    await _run(engine, clock, AGENT_GRACE_S + 0.5, R0)
    await _drain(engine)
    assert quorum.reports == []
    assert await _stored(engine) == [("fail_stop", "r1", "agent:node-a")]


async def test_a_silent_node_is_no_reason_to_wait() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    # The whole host goes: no node state any more, so nobody else will report its ranks.
    for _ in range(round((TIMEOUT_S + 0.3) / 0.1)):
        clock.now += 0.1
        await engine.evaluate_once()
    assert sorted(await _stored(engine)) == [
        ("fail_stop", "r0", "central"),
        ("fail_stop", "r1", "central"),
    ]


async def test_a_rank_beating_again_during_the_grace_is_no_incident() -> None:
    clock = Clock()
    engine = _engine(clock)
    await _run(engine, clock, 1.0, R0, R1)
    await _run(engine, clock, TIMEOUT_S + 0.3, R0)
    await _run(engine, clock, AGENT_GRACE_S + 0.5, R0, R1)
    assert await _stored(engine) == []
    assert _state(engine, "r1") == "healthy"


async def test_an_agent_incident_whose_quorum_report_failed_is_evicted_from_here() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await engine.ingest(_agent_failstop("failed"))
    await _drain(engine)
    assert quorum.reports == [("r1", True)]
    await engine.ingest(_agent_failstop("evicted"))
    await _drain(engine)
    assert quorum.reports == [("r1", True)]


async def _drain(engine: CentralEngine) -> None:
    await engine.stop()  # waits for the pending evictions


def _state(engine: CentralEngine, replica_id: str) -> str:
    return {v.replica_id: v.state for v in engine.replicas()}[replica_id]
