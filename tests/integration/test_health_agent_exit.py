"""The node agent sees a local rank's process exit: real child processes, SIGKILL, pidfds.

The agent's heartbeat timeout here is a minute, so a report can only come from the exit."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from fthsdp.services.common.process_ref import ProcessRef, process_start, this_process
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.client_codec import ReportBatch
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.exit_watch import ExitWatch
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.telemetry import Heartbeat, RankId
from tests.unit.test_health_agent import FakeQuorum

pytestmark = pytest.mark.skipif(
    not hasattr(__import__("os"), "pidfd_open"), reason="needs os.pidfd_open (Linux)"
)


Spawn = Callable[[], "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts long sleeps as stand-ins for rank processes; kills what is left after."""
    started: list[subprocess.Popen[bytes]] = []

    def run() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "600"])
        started.append(proc)
        return proc

    yield run
    for proc in started:
        proc.kill()
        proc.wait()


def _ref(proc: subprocess.Popen[bytes]) -> ProcessRef:
    start = process_start(proc.pid)
    assert start is not None
    return ProcessRef(proc.pid, start)


def _agent() -> tuple[NodeAgent, FakeQuorum]:
    """An agent not started: its exit watch needs only the running loop (no quorum stream)."""
    config = HealthConfig(mode="agent", node="n1", heartbeat_timeout=timedelta(seconds=60))
    quorum = FakeQuorum()
    agent = NodeAgent(config, Token("t" * 20), HealthMetrics(), quorum=quorum)  # type: ignore[arg-type]
    return agent, quorum


def _beat(replica: str, ref: ProcessRef) -> ReportBatch:
    beat = Heartbeat(
        rank=RankId(replica_id=replica, rank=0),
        host="n1",
        step=7,
        at=time.time(),
        pid=ref.pid,
        pid_start=ref.start,
    )
    return ReportBatch(source="x", host="n1", heartbeats=(beat,))


async def _reported(quorum: FakeQuorum, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(quorum.reports) < count:
        assert time.monotonic() < deadline, f"reports: {quorum.reports}"
        await asyncio.sleep(0.01)


async def test_a_killed_rank_is_reported_when_its_process_exits(spawn: Spawn) -> None:
    agent, quorum = _agent()
    try:
        proc = spawn()
        await agent.ingest(_beat("r0", _ref(proc)))
        proc.kill()
        # Reported well inside the 60 s heartbeat timeout: the exit said it, not the silence.
        await _reported(quorum, 1)
        assert quorum.reports == [("r0", "fthsdp-health-agent:n1")]
        assert quorum.teardowns == [True]
        (incident,) = [i for i in agent._take_batch().incidents if i.replica_id == "r0"]
        assert f"its process {proc.pid} exited" in incident.summary
        assert incident.evidence["exited_pid"] == proc.pid
    finally:
        await agent.stop()


async def test_a_clean_leave_and_a_replaced_process_are_not_reported(spawn: Spawn) -> None:
    """r0 leaves cleanly, then its process ends; r1's first process is replaced by a second
    (a restart) before it ends. Neither is a failure. Then r2's process is killed: its report
    is the only one."""
    agent, quorum = _agent()
    try:
        leaver, first, second, victim = spawn(), spawn(), spawn(), spawn()
        await agent.ingest(_beat("r0", _ref(leaver)))
        await agent.ingest(_beat("r1", _ref(first)))
        await agent.ingest(_beat("r2", _ref(victim)))
        await agent.ingest(
            ReportBatch(source="x", host="n1", left=(RankId(replica_id="r0", rank=0),))
        )
        await agent.ingest(_beat("r1", _ref(second)))
        for proc in (leaver, first):
            proc.kill()
            proc.wait()
        # Their exits are readable before the victim dies: a wrong report of either would be
        # handled no later than the victim's.
        victim.kill()
        await _reported(quorum, 1)
        assert [replica for replica, _ in quorum.reports] == ["r2"]
    finally:
        await agent.stop()


async def test_only_processes_the_agent_may_signal_are_watched(spawn: Spawn) -> None:
    """Its own process, a pid whose start time does not match (reused), and a gone pid are left
    to the heartbeat timeout; a child of its user is watched until forgotten."""
    exits: list[RankId] = []
    watch = ExitWatch(lambda rank, _ref: exits.append(rank))
    rank = RankId(replica_id="r0", rank=0)
    try:
        assert not watch.watch(rank, this_process())
        proc = spawn()
        ref = _ref(proc)
        assert not watch.watch(rank, ProcessRef(ref.pid, ref.start + 1))
        assert watch.watch(rank, ref) and len(watch) == 1
        assert watch.watch(rank, ref) and len(watch) == 1  # the same process: kept
        watch.forget(rank)
        assert len(watch) == 0
        proc.kill()
        proc.wait()
        assert not watch.watch(rank, ref)
    finally:
        watch.close()
    assert exits == []
