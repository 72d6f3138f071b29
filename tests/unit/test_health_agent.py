"""The node agent with a fake clock and a recording quorum link: a silent rank is reported at
once and only once under the agent's node name, clean exits are no incident, the node state
leaves silent ranks out, and the buffer for the central service is bounded."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from fthsdp.services.common.process_ref import ProcessRef
from fthsdp.services.common.tokens import Token
from fthsdp.services.health import agent as agent_module
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.client_codec import ReportBatch, batch_from_pb, batch_to_pb
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.telemetry import Heartbeat, RankId, StepRecord


class FakeQuorum:
    def __init__(self, outcome: str = "evicted") -> None:
        self.outcome = outcome
        self.reports: list[tuple[str, str]] = []
        self.teardowns: list[bool] = []
        self.incarnations: list[int | None] = []

    async def report_failure(
        self,
        replica_id: str,
        reason: str,
        *,
        reporter: str,
        teardown: bool = False,
        incarnation: int | None = None,
    ) -> str:
        self.reports.append((replica_id, reporter))
        self.teardowns.append(teardown)
        self.incarnations.append(incarnation)
        return self.outcome


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _agent(**overrides: object) -> tuple[NodeAgent, FakeQuorum, Clock]:
    config = HealthConfig(
        mode="agent", node="n1", heartbeat_timeout=timedelta(milliseconds=500), **overrides
    )  # type: ignore[arg-type]
    quorum, clock = FakeQuorum(), Clock()
    agent = NodeAgent(config, Token("t" * 20), HealthMetrics(), quorum=quorum, clock=clock)  # type: ignore[arg-type]
    return agent, quorum, clock


def _beats(clock: Clock, *replicas: str, step: int = 1) -> ReportBatch:
    return ReportBatch(
        source="x",
        host="n1",
        heartbeats=tuple(
            # A rank names its host as it sees it; the agent's node name is what counts.
            Heartbeat(rank=RankId(replica_id=r, rank=0), host="vm", step=step, at=clock.now)
            for r in replicas
        ),
    )


async def test_a_silent_rank_is_reported_at_once_and_once() -> None:
    agent, quorum, clock = _agent()
    await agent.ingest(_beats(clock, "r0", "r1"))
    clock.now += 0.3
    await agent.ingest(_beats(clock, "r0"))
    assert agent.check_once() == []
    clock.now += 0.3  # r1 silent for 0.6 s > 0.5 s
    (found,) = agent.check_once()
    assert (found.kind.value, found.replica_id, found.rank, found.host) == (
        "fail_stop",
        "r1",
        0,
        "n1",
    )
    deadline = time.monotonic() + 5
    while not quorum.reports:  # the report runs as a task on this loop
        assert time.monotonic() < deadline, "the failure was never reported"
        await asyncio.sleep(0.001)
    assert quorum.reports == [("r1", "fthsdp-health-agent:n1")]
    assert quorum.teardowns == [True]  # the default action: kill
    assert agent.check_once() == []  # reported once
    assert [r.rank.replica_id for r in agent.node_state().ranks] == ["r0"]
    held = agent._take_batch().incidents
    assert held[0].evidence["quorum"] == "evicted"


async def test_the_next_check_comes_when_the_earliest_rank_would_fall_silent() -> None:
    """Timeout 0.5 s, check_interval 50 ms: a check at each silence's deadline, spaced between
    the interval and a quarter of the timeout (125 ms), instead of every 50 ms."""
    agent, _, clock = _agent()
    assert agent.next_check_in() == pytest.approx(0.125)  # no rank: the ceiling
    await agent.ingest(_beats(clock, "r0", "r1"))
    clock.now += 0.3
    await agent.ingest(_beats(clock, "r0"))
    assert agent.next_check_in() == pytest.approx(0.125)  # r1's deadline is 0.2 s away
    clock.now += 0.12
    assert agent.next_check_in() == pytest.approx(0.08)  # r1's, exactly
    clock.now += 0.07
    assert agent.next_check_in() == pytest.approx(0.05)  # 10 ms left: no sooner than 50 ms
    clock.now += 0.05
    assert [i.replica_id for i in agent.check_once()] == ["r1"]
    # r1 is reported: r0 (heard 0.24 s ago) is the next to watch, 0.26 s away.
    assert agent.next_check_in() == pytest.approx(0.125)


async def test_a_clean_exit_is_no_incident() -> None:
    agent, quorum, clock = _agent()
    await agent.ingest(_beats(clock, "r0"))
    await agent.ingest(ReportBatch(source="x", host="n1", left=(RankId(replica_id="r0", rank=0),)))
    clock.now += 10
    assert agent.check_once() == []
    assert quorum.reports == []


async def test_the_buffer_keeps_the_newest_records_and_counts_drops() -> None:
    agent, _, _ = _agent(max_batch_records=10, max_buffered_records=20)
    rank = RankId(replica_id="r0", rank=0)
    steps = tuple(
        StepRecord(rank=rank, step=n, started_at=1.0, duration_s=0.1, tokens=1, sum_seq_len_sq=1)
        for n in range(50)
    )
    await agent.ingest(ReportBatch(source="x", host="n1", steps=steps))
    assert agent.dropped == 30
    first = agent._take_batch()
    assert [s.step for s in first.steps] == list(range(30, 40))
    assert first.node is not None and first.node.dropped == 30


async def test_the_node_state_names_each_ranks_process_through_the_wire() -> None:
    """The central service tells a restarted rank from a quiet one by the process its agent
    last heard from; that name survives the agent's node state and its encoding."""
    agent, _, clock = _agent()
    rank = RankId(replica_id="r0", rank=0)
    beat = Heartbeat(rank=rank, host="n1", step=3, at=clock.now, process="p-2")
    await agent.ingest(ReportBatch(source="x", host="n1", heartbeats=(beat,)))
    batch = ReportBatch(source="a", host="n1", heartbeats=(beat,), node=agent.node_state())
    decoded = batch_from_pb(batch_to_pb(batch, sent_at=clock.now), now=clock.now)
    assert decoded.node is not None
    assert [(r.rank, r.process) for r in decoded.node.ranks] == [(rank, "p-2")]
    assert [h.process for h in decoded.heartbeats] == ["p-2"]


async def test_a_silent_ranks_teardown_spares_the_next_incarnation_whatever_the_quorum_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 of r1 goes silent; rank 0 is a new process by then (a spare took over), and the
    quorum service had evicted r1 already by its own heartbeat timeout. The agent still kills
    the silent incarnation's process, and only that one."""
    killed: list[list[ProcessRef]] = []

    async def record(refs: list[ProcessRef], grace_s: float) -> list[int]:
        killed.append(list(refs))
        return [ref.pid for ref in refs]

    monkeypatch.setattr(agent_module, "kill", record)
    agent, quorum, clock = _agent()
    quorum.outcome = "already_gone"

    def beat(rank: int, pid: int) -> Heartbeat:
        return Heartbeat(
            rank=RankId(replica_id="r1", rank=rank), host="n1", step=5, at=clock.now, pid=pid
        )

    await agent.ingest(ReportBatch(source="x", host="n1", heartbeats=(beat(0, 100), beat(1, 101))))
    clock.now += 0.3
    await agent.ingest(ReportBatch(source="x", host="n1", heartbeats=(beat(0, 200),)))
    clock.now += 0.3  # rank 1 silent for 0.6 s > 0.5 s
    (found,) = agent.check_once()
    assert found.rank == 1
    deadline = time.monotonic() + 5
    while not killed:  # the report, then the kill, run as a task on this loop
        assert time.monotonic() < deadline, "the silent rank was never killed"
        await asyncio.sleep(0.001)
    assert killed == [[ProcessRef(101, 0)]]
    assert [r.rank.rank for r in agent.node_state().ranks] == [0]  # the new process is kept


async def test_a_silent_ranks_teardown_takes_its_siblings_by_arrival_not_by_beat_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beat times are rebased per batch, so a sibling's first beat can be dated after the
    silent rank's last one although it arrived first: it is the same incarnation, and goes."""
    killed: list[list[ProcessRef]] = []

    async def record(refs: list[ProcessRef], grace_s: float) -> list[int]:
        killed.append(list(refs))
        return [ref.pid for ref in refs]

    monkeypatch.setattr(agent_module, "kill", record)
    agent, _, clock = _agent()

    def beat(rank: int, pid: int, skew_s: float = 0.0) -> ReportBatch:
        hb = Heartbeat(
            rank=RankId(replica_id="r1", rank=rank),
            host="n1",
            step=5,
            at=clock.now + skew_s,
            pid=pid,
        )
        return ReportBatch(source="x", host="n1", heartbeats=(hb,))

    await agent.ingest(beat(0, 100, skew_s=0.2))  # dated 0.2 s ahead by its batch's rebase
    clock.now += 0.01
    await agent.ingest(beat(1, 101))  # rank 1's last beat
    for _ in range(3):
        clock.now += 0.2
        await agent.ingest(beat(0, 100, skew_s=0.2))
    (found,) = agent.check_once()
    assert found.rank == 1
    deadline = time.monotonic() + 5
    while not killed:
        assert time.monotonic() < deadline, "the silent rank was never killed"
        await asyncio.sleep(0.001)
    assert sorted(ref.pid for ref in killed[0]) == [100, 101]


async def _reported(agent: NodeAgent, quorum: FakeQuorum) -> None:
    assert len(agent.check_once()) == 1
    deadline = time.monotonic() + 5
    while not quorum.reports:  # the report runs as a task on this loop
        assert time.monotonic() < deadline, "the silent rank was never reported"
        await asyncio.sleep(0.001)


async def test_a_silent_rank_is_reported_as_the_incarnation_it_belonged_to() -> None:
    """r1's incarnation 1 joined, its rank beat, then fell silent; incarnation 2 (a warm spare
    taking over) joined before the heartbeat timeout ran out. The report names incarnation 1,
    so the quorum service does not evict the replica's new incarnation for the old one's death."""
    agent, quorum, clock = _agent()
    agent._joined("r1", 1)
    clock.now += 0.1
    await agent.ingest(_beats(clock, "r1"))
    clock.now += 0.2
    agent._joined("r1", 2)
    clock.now += 0.4  # silent for 0.6 s > 0.5 s
    await _reported(agent, quorum)
    assert quorum.incarnations == [1]


async def test_without_a_join_seen_since_the_stream_started_the_report_names_none() -> None:
    """A join this agent did not see (it happened while its event stream was down) leaves the
    incarnation unknown: the report evicts whatever incarnation is current, as before."""
    agent, quorum, clock = _agent()
    agent._joined("r1", 1)
    agent._joins.clear()  # what a new stream's snapshot does (on_resync)
    await agent.ingest(_beats(clock, "r1"))
    clock.now += 0.6
    await _reported(agent, quorum)
    assert quorum.incarnations == [None]
