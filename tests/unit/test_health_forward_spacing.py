"""A central service with more node agents than it takes forwards asks them to forward less
often (`HealthConfig.ingest_forwards_per_s`), and judges fail-stops and hangs that much later: a
rank's records may then arrive one interval late, and must not read as a silence or as a
collective not entered (fake clock, in-memory store, no quorum service)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fthsdp.services.health import central
from fthsdp.services.health.central import NODE_FORGET_S, CentralEngine
from fthsdp.services.health.client_codec import NodeRank, NodeState, ReportBatch
from fthsdp.services.health.config import MAX_FORWARD_INTERVAL, HealthConfig
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.store import InMemoryTelemetryStore
from fthsdp.services.health.telemetry import CollectiveRecord, IncidentKind, RankId

CAPACITY = 10.0
"""Forwards a second the engine takes in these tests: 2 agents fit in 0.2 s, 40 take 4 s."""
AGENTS = 40
SPACED_S = AGENTS / CAPACITY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(clock: Clock, capacity: float = CAPACITY) -> CentralEngine:
    return CentralEngine(
        HealthConfig(mode="central", ingest_forwards_per_s=capacity),
        DetectorConfig(heartbeat_timeout_s=1.0, hang_timeout_s=2.0),
        InMemoryTelemetryStore(),
        HealthMetrics(CollectorRegistry()),
        clock=clock,
    )


def _rank(node: int) -> RankId:
    return RankId(replica_id=f"r{node}", rank=0)


def _forward(node: int, *records: CollectiveRecord) -> ReportBatch:
    """Node `node`'s agent: its one rank beats (as of this forward), and its new records."""
    rank = NodeRank(rank=_rank(node), step=3, silent_s=0.0, process="p")
    state = NodeState(node=f"n{node}", ranks=(rank,))
    return ReportBatch(source=f"agent:n{node}", host=f"n{node}", node=state, collectives=records)


async def test_the_interval_asked_grows_with_the_agents_past_what_the_service_takes() -> None:
    engine = _engine(Clock())
    await _ingest_all(engine, 2)
    assert engine.forward_interval_ms() == 0  # 2 agents every 0.2 s: 10 a second, taken
    assert engine.core.delivery_slack_s == 0.0
    await _ingest_all(engine, AGENTS)
    assert engine.forward_interval_ms() == SPACED_S * 1000
    assert engine.core.delivery_slack_s == SPACED_S
    many = _engine(Clock(), capacity=1.0)
    await _ingest_all(many, 100)
    assert many.forward_interval_ms() == MAX_FORWARD_INTERVAL.total_seconds() * 1000


async def _ingest_all(engine: CentralEngine, count: int) -> None:
    for node in range(count):
        await engine.ingest(_forward(node))


async def _round(engine: CentralEngine, clock: Clock, seconds: float) -> list[IncidentKind]:
    """Every agent forwards once, `seconds` apart, the engine evaluating between forwards; the
    incidents it stored meanwhile."""
    for node in range(AGENTS):
        clock.now += seconds / AGENTS
        await engine.ingest(_forward(node))
        await engine.evaluate_once()
    return [i.kind for i in await engine.store.incidents()]


@pytest.mark.parametrize("agents_fit", [False, True])
async def test_ranks_heard_once_an_interval_are_not_failed(agents_fit: bool) -> None:
    """Each agent forwards every 4 s, as asked: its rank's last beat is up to 4 s old when the
    next forward comes, past the 1 s heartbeat timeout. The control: a service that takes
    every forward at 0.2 s (it asks nothing) fails them all."""
    clock = Clock()
    engine = _engine(clock, capacity=1e6 if agents_fit else CAPACITY)
    await _ingest_all(engine, AGENTS)
    found: list[IncidentKind] = []
    for _ in range(3):
        found = await _round(engine, clock, SPACED_S)
    if agents_fit:
        assert IncidentKind.FAIL_STOP in found
        return
    assert found == []
    assert {replica.state for replica in engine.replicas()} == {"healthy"}


async def test_a_rank_silent_past_the_interval_and_the_timeout_is_failed() -> None:
    clock = Clock()
    engine = _engine(clock)
    await _ingest_all(engine, AGENTS)
    silent = 7  # its agent is gone with its host: no forward from n7 any more
    for _ in range(4):
        for node in range(AGENTS):
            clock.now += SPACED_S / AGENTS
            if node != silent:
                await engine.ingest(_forward(node))
            await engine.evaluate_once()
    down = {replica.replica_id for replica in engine.replicas() if replica.state == "down"}
    assert down == {_rank(silent).replica_id}


@pytest.mark.parametrize("agents_fit", [False, True])
async def test_an_entry_record_one_interval_late_is_not_a_hang(agents_fit: bool) -> None:
    """n0's rank enters allreduce #5 and leaves it at once; n1's rank enters it too, but n1's
    agent forwards 3.5 s later (its interval), past the 2 s hang timeout. The control: with
    every agent forwarding at 0.2 s, a record that late means the rank never entered."""
    clock = Clock()
    engine = _engine(clock, capacity=1e6 if agents_fit else CAPACITY)
    await _ingest_all(engine, AGENTS)
    t = clock.now
    first = CollectiveRecord(rank=_rank(0), group="g", seq=5, op="allreduce", started_at=t)
    second = CollectiveRecord(rank=_rank(1), group="g", seq=5, op="allreduce", started_at=t)
    await engine.ingest(_forward(0, first))
    for _ in range(35):
        clock.now += 0.1
        await engine.ingest(_forward(0))
        await engine.evaluate_once()
    await engine.ingest(_forward(1, second))
    await engine.evaluate_once()
    hangs = [i for i in await engine.store.incidents() if i.kind == IncidentKind.HANG]
    if agents_fit:
        assert hangs
    else:
        assert hangs == []


async def test_agents_not_heard_for_long_are_forgotten_and_the_interval_shrinks_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    engine = _engine(clock)
    await _ingest_all(engine, AGENTS)
    assert engine.forward_interval_ms() == SPACED_S * 1000
    clock.now += NODE_FORGET_S / 2
    for node in (0, 1):  # two hosts go on; the others were retired
        await engine.ingest(_forward(node))
    clock.now += NODE_FORGET_S / 2 + 1
    await engine.evaluate_once()
    assert [v.node for v in engine.nodes()] == ["n0", "n1"]
    assert engine.forward_interval_ms() == 0 and engine.core.delivery_slack_s == 0.0
    # One comes back: what it sent meanwhile was lost, and its return says so.
    with caplog.at_level("INFO", logger="fthsdp.services.health.central"):
        await engine.ingest(_forward(5))
    assert "node agent n5 is heard again" in caplog.text
    assert len(engine.nodes()) == 3


async def test_the_nodes_tracked_are_bounded_least_recently_heard_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(central, "MAX_NODES", 3)
    clock = Clock()
    engine = _engine(clock)
    for node in (0, 1, 2, 0, 3, 4):  # n0 heard again before n3 and n4 arrive
        clock.now += 0.1
        await engine.ingest(_forward(node))
    assert [v.node for v in engine.nodes()] == ["n0", "n3", "n4"]
