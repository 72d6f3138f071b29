"""One fault, one incident: the central engine's fail-stop verdict on a live node agent's rank
waits for that agent's own incident, and is acted on only when none comes; behind an agent it no
longer hears (host loss, or a link cut from central alone) it is only reported on condition that
the quorum service does not hear the replica either (fake clock, in-memory store, a recording
quorum link)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fthsdp.services.health.central import (
    AGENT_GRACE_S,
    UNHEARD_QUIET_S,
    UNHEARD_REPORT_EVERY_S,
    CentralEngine,
)
from fthsdp.services.health.client_codec import NodeRank, NodeState, ReportBatch
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.store import InMemoryTelemetryStore
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Heartbeat,
    Incident,
    IncidentKind,
    RankId,
)

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
        self.reports: list[tuple[str, bool, int | None]] = []
        self.conditional: list[tuple[str, float, float]] = []
        """(replica, unless_heard_within, clock) of each conditional report."""
        self.heard = True
        """Whether the quorum service still hears the replicas (a conditional report fails)."""
        self.clock: Clock | None = None

    async def report_failure(
        self,
        replica_id: str,
        reason: str,
        *,
        reporter: str,
        teardown: bool,
        incarnation: int | None = None,
        unless_heard_within: float | None = None,
    ) -> str:
        if unless_heard_within is not None:
            now = self.clock.now if self.clock is not None else 0.0
            self.conditional.append((replica_id, unless_heard_within, now))
            return "already_gone" if self.heard else "evicted"
        self.reports.append((replica_id, teardown, incarnation))
        return "evicted"


def _engine(
    clock: Clock, quorum: RecordingQuorum | None = None, metrics: HealthMetrics | None = None
) -> CentralEngine:
    return CentralEngine(
        HealthConfig(mode="central", failure_action="kill"),
        DetectorConfig(heartbeat_timeout_s=TIMEOUT_S),
        InMemoryTelemetryStore(),
        metrics or HealthMetrics(CollectorRegistry()),
        quorum=quorum,  # type: ignore[arg-type]
        clock=clock,
    )


def _node_state(*ranks: RankId) -> ReportBatch:
    listed = tuple(NodeRank(rank=r, step=3, silent_s=0.0, process="p") for r in ranks)
    return ReportBatch(
        source="agent:node-a", host="node-a", node=NodeState(node="node-a", ranks=listed)
    )


def _agent_failstop(
    quorum: str, *, rank: int = 0, action: str = "report", incarnation: int | None = None
) -> ReportBatch:
    evidence: dict[str, Any] = {"found_by": "agent:node-a", "quorum": quorum, "action": action}
    if incarnation is not None:
        evidence["incarnation"] = incarnation
    incident = Incident(
        kind=IncidentKind.FAIL_STOP,
        replica_id="r1",
        rank=rank,
        host="node-a",
        detected_at=0.0,
        summary=f"rank {rank} of replica r1 stopped heartbeating",
        evidence=evidence,
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
    assert quorum.reports == [("r1", True, None)]


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


async def _silent_node(engine: CentralEngine, clock: Clock, seconds: float) -> None:
    """The node agent's link is lost (or its host with it): no node state any more."""
    for _ in range(round(seconds / 0.1)):
        clock.now += 0.1
        await engine.evaluate_once()
        await asyncio.sleep(0)  # a yield: the reports it spawned get their (immediate) answers


async def test_ranks_behind_an_agent_no_longer_heard_are_left_to_the_quorum_service() -> None:
    """Host loss and a link cut from central alone look the same from here; behind a cut link
    the replica still trains and asks the quorum service, so it is reported only on condition
    that the quorum service does not hear it either, again and again while the agent is
    silent, and nothing is stored."""
    clock, quorum, metrics = Clock(), RecordingQuorum(), HealthMetrics(CollectorRegistry())
    quorum.clock = clock
    engine = _engine(clock, quorum, metrics)
    await _run(engine, clock, 1.0, R0, R1)
    await _silent_node(engine, clock, TIMEOUT_S + AGENT_GRACE_S + 1.0)
    await _drain(engine)
    assert quorum.reports == []  # never unconditionally
    assert {r for r, _, _ in quorum.conditional} == {"r0", "r1"}
    assert all(quiet == UNHEARD_QUIET_S for _, quiet, _ in quorum.conditional)
    times = [t for r, _, t in quorum.conditional if r == "r1"]
    assert len(times) >= 4  # repeated while the replica is still heard by the quorum service
    assert min(b - a for a, b in itertools.pairwise(times)) >= UNHEARD_REPORT_EVERY_S - 1e-9
    assert await _stored(engine) == []
    assert _unreachable(metrics) == 2
    # The link is back and the ranks beat again: healthy, nothing was ever an incident, and
    # the conditional reports stop.
    await _run(engine, clock, 0.3, R0, R1)
    assert (_state(engine, "r0"), _state(engine, "r1")) == ("healthy", "healthy")
    assert await _stored(engine) == []
    reported = len(quorum.conditional)
    await _run(engine, clock, 1.0, R0, R1)
    await _drain(engine)
    assert len(quorum.conditional) == reported


async def test_a_silent_host_that_the_quorum_service_no_longer_hears_is_evicted_once() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    quorum.clock, quorum.heard = clock, False
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await _silent_node(engine, clock, TIMEOUT_S + 1.0)
    await _drain(engine)
    # One conditional report per replica evicts it; nothing repeats after that.
    assert sorted(r for r, _, _ in quorum.conditional) == ["r0", "r1"]


async def test_a_held_verdict_whose_agent_falls_silent_in_the_grace_is_dropped() -> None:
    """The race of a cut: the ranks' last beats are up to a beat older than the agent's last
    node state, so the core finds them silent while the agent still counts as alive (held),
    and only then does the agent's silence show."""
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await _run(engine, clock, TIMEOUT_S + 0.3, R0)  # r1 is held
    assert _state(engine, "r1") == "down"
    await _silent_node(engine, clock, AGENT_GRACE_S + TIMEOUT_S)
    await _drain(engine)
    assert quorum.reports == []
    assert await _stored(engine) == []


async def test_a_link_that_flaps_leaves_the_ranks_behind_it_to_the_quorum_service() -> None:
    """A link to central alone that comes back for one forward and is cut again: the outage is
    not the agent's cadence, so the agent is not taken as alive for seconds after that forward
    (its ranks' silence then is the cut again, not a death under a live agent)."""
    clock, quorum = Clock(), RecordingQuorum()
    quorum.clock = clock
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await _silent_node(engine, clock, 6.0)
    await _run(engine, clock, 0.1, R0, R1)  # one forward gets through
    (node,) = engine.nodes()
    assert node.interval_s is not None and node.interval_s < 0.25
    await _silent_node(engine, clock, TIMEOUT_S + AGENT_GRACE_S + 1.0)
    await _drain(engine)
    assert quorum.reports == []  # never unconditionally: the replica trains on behind the cut
    assert {r for r, _, _ in quorum.conditional} == {"r0", "r1"}
    assert await _stored(engine) == []


async def test_a_rank_dying_once_its_agent_is_heard_again_is_reported() -> None:
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    await _run(engine, clock, 1.0, R0, R1)
    await _silent_node(engine, clock, TIMEOUT_S + 1.0)
    await _run(engine, clock, 1.0, R0, R1)
    # r1 dies with its agent connected, and the agent says nothing: acted on after the grace.
    await _run(engine, clock, TIMEOUT_S + AGENT_GRACE_S + 0.3, R0)
    await _drain(engine)
    assert quorum.reports == [("r1", True, None)]
    assert await _stored(engine) == [("fail_stop", "r1", "central")]


async def test_ranks_with_no_agent_are_reported_at_once() -> None:
    """Ranks that beat straight to the central service (no node agent, as under `fthsdp up`):
    it is their only watcher, so their silence is reported without a grace."""
    clock, quorum = Clock(), RecordingQuorum()
    engine = _engine(clock, quorum)
    for _ in range(10):
        clock.now += 0.1
        beats = tuple(Heartbeat(rank=r, host="node-b", step=3, at=clock.now) for r in (R0, R1))
        await engine.ingest(ReportBatch(source="rank", host="node-b", heartbeats=beats))
        await engine.evaluate_once()
    await _silent_node(engine, clock, TIMEOUT_S + 0.3)
    await _drain(engine)
    assert sorted(quorum.reports) == [("r0", True, None), ("r1", True, None)]
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
    await engine.ingest(_agent_failstop("failed", incarnation=3))
    await _drain(engine)
    # For the incarnation the agent named: a newer one that took over meanwhile stays.
    assert quorum.reports == [("r1", True, 3)]
    await engine.ingest(_agent_failstop("evicted", incarnation=3))
    await _drain(engine)
    assert quorum.reports == [("r1", True, 3)]
    await engine.ingest(_agent_failstop("failed", incarnation=True))  # type: ignore[arg-type]
    await _drain(engine)
    assert quorum.reports[-1] == ("r1", True, None)  # not an incarnation: the JSON is untrusted


async def _drain(engine: CentralEngine) -> None:
    await engine.stop()  # waits for the pending evictions


def _unreachable(metrics: HealthMetrics) -> float:
    """Fail-stops left to the quorum service, from the metric."""
    value = metrics.registry.get_sample_value("fthsdp_health_failstops_unreachable_total")
    return value or 0.0


def _state(engine: CentralEngine, replica_id: str) -> str:
    return {v.replica_id: v.state for v in engine.replicas()}[replica_id]


def _node(node: str, rank: RankId, dropped: int = 0, *records: CollectiveRecord) -> ReportBatch:
    state = NodeState(
        node=node, ranks=(NodeRank(rank=rank, step=3, silent_s=0.0, process="p"),), dropped=dropped
    )
    return ReportBatch(source=f"agent:{node}", host=node, node=state, collectives=records)


@pytest.mark.parametrize("records_lost", [False, True])
async def test_a_rank_whose_exit_from_a_collective_was_lost_on_the_way_is_not_hung(
    records_lost: bool,
) -> None:
    """r1's agent sends its entry into allreduce #5, then loses batches (its link to here was
    cut; its node state counts them as dropped): r1's exit may be among them. Without the lost
    batches the same records are a hang of r1 (the control)."""
    clock = Clock()
    engine = CentralEngine(
        HealthConfig(mode="central", failure_action="kill"),
        DetectorConfig(heartbeat_timeout_s=TIMEOUT_S, hang_timeout_s=2.0),
        InMemoryTelemetryStore(),
        HealthMetrics(CollectorRegistry()),
        clock=clock,
    )
    t = clock.now
    entered = CollectiveRecord(rank=R1, group="ftar:1:0", seq=5, op="allreduce", started_at=t)
    peer = CollectiveRecord(
        rank=R0, group="ftar:1:0", seq=5, op="allreduce", started_at=t, ended_at=t + 0.01
    )
    await engine.ingest(_node("node-a", R1, 0, entered))
    await engine.ingest(_node("node-b", R0, 0, peer))
    dropped = 3 if records_lost else 0
    for _ in range(40):  # 4 s: past the hang timeout
        clock.now += 0.1
        await engine.ingest(_node("node-a", R1, dropped))
        await engine.ingest(_node("node-b", R0))
        await engine.evaluate_once()
    hangs = [i for i in await engine.store.incidents() if i.kind == IncidentKind.HANG]
    if records_lost:
        assert hangs == []
    else:
        assert [(i.replica_id, i.rank) for i in hangs] == [("r1", 0)]
