"""Real processes as emulated ranks (`health_rank.py`, reporting through `TelemetryClient` to a
real node agent that forwards to a real central service), with real faults.

What each fault looks like:
- SIGKILL: the process and its heartbeat thread are gone -> the agent's fail-stop detector names
  the rank after `heartbeat_timeout`.
- SIGSTOP: also fail-stop, not hang. The heartbeats come from a thread of the stopped process,
  so they stop too; the agent cannot tell a stopped process from a dead one, and for the job it
  does not matter (both leave the replica's collectives waiting forever). A hang incident is for
  a rank that keeps beating but makes no progress inside a collective.
- slowed steps: the fail-slow detector (workload-aware predictor fitted during warm-up) names the
  replica once its step time stays above the prediction by the margin.
- a flipped fingerprint: the SDC detector names the replica whose digest differs from the
  majority."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.health.telemetry import Incident, IncidentKind
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint
from tests.integration.conftest import QuorumServerFactory, eventually
from tests.integration.health_support import health_nodes

ROOT = Path(__file__).resolve().parents[2]
_RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
async def spawn(token: str) -> AsyncIterator[Spawn]:
    """Starts rank processes; kills (and reaps) every one at the end."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(agent: str, replica: str, *extra: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "tests.integration.health_rank", "--agent", agent]
        argv += ["--replica", replica, *extra]
        env = {**os.environ, "FTHSDP_TOKEN": token}
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=10)


async def _stack(
    make: object, detectors: DetectorConfig | None = None
) -> tuple[HealthProcess, HealthProcess]:
    central = await make(detectors=detectors, http_port=None)  # type: ignore[operator]
    agent = await make(  # type: ignore[operator]
        mode="agent",
        central=central.grpc_address,
        http_port=None,
        heartbeat_timeout=timedelta(milliseconds=400),
    )
    return central, agent


async def _incident_naming(
    central: HealthProcess, kinds: set[IncidentKind], replica_id: str, seconds: float = 20.0
) -> Incident:
    assert central.engine is not None
    store = central.engine.store
    found: list[Incident] = []

    async def named() -> bool:
        found[:] = [
            i
            for i in await store.incidents(limit=1000)
            if i.kind in kinds and i.replica_id == replica_id
        ]
        return bool(found)

    await eventually(named, seconds)
    return found[0]


async def _all_running(agent: HealthProcess, count: int) -> None:
    """`count` ranks beat with progress, each again since all of them were first seen (so every
    rank was beating by every other's latest beat: one incarnation, as a teardown judges it)."""
    assert agent.agent is not None
    node = agent.agent

    async def running() -> bool:
        return len([r for r in node.node_state().ranks if r.step >= 1]) == count

    await eventually(running, 30.0)
    first = {r.rank: r.step for r in node.node_state().ranks}

    async def beaten_again() -> bool:
        return all(r.step > first.get(r.rank, r.step) for r in node.node_state().ranks)

    await eventually(beaten_again, 30.0)


async def test_killed_and_stopped_ranks_are_named_as_fail_stop(spawn: Spawn, token: str) -> None:
    async with health_nodes(token) as make:
        central, agent = await _stack(make)
        ranks = {r: spawn(agent.grpc_address, r) for r in ("r0", "r1", "r2")}
        await _all_running(agent, 3)

        ranks["r0"].kill()
        killed = await _incident_naming(central, {IncidentKind.FAIL_STOP}, "r0")
        assert killed.rank == 0 and killed.evidence["found_by"] == "agent:testhost"

        ranks["r1"].send_signal(signal.SIGSTOP)
        stopped = await _incident_naming(central, {IncidentKind.FAIL_STOP}, "r1")
        assert stopped.rank == 0

        assert central.engine is not None
        named = {i.replica_id for i in await central.engine.store.incidents(limit=1000)}
        assert "r2" not in named  # the healthy rank is never blamed


async def test_slowed_steps_and_a_flipped_fingerprint_name_their_replicas(
    spawn: Spawn, token: str
) -> None:
    detectors = DetectorConfig(
        fail_slow_warmup_steps=8, fail_slow_persist_steps=3, sdc_min_replicas=3
    )
    async with health_nodes(token) as make:
        central, agent = await _stack(make, detectors)
        spawn(agent.grpc_address, "r0")
        spawn(agent.grpc_address, "r1")
        spawn(agent.grpc_address, "r2", "--slow-after", "15", "--slow-factor", "4")
        spawn(agent.grpc_address, "r3", "--flip-after", "10")
        await _all_running(agent, 4)

        sdc = await _incident_naming(central, {IncidentKind.SDC}, "r3")
        assert sdc.evidence  # the digests behind the verdict
        slow = await _incident_naming(
            central, {IncidentKind.FAIL_SLOW, IncidentKind.SLOW_RANK}, "r2"
        )
        assert slow.summary
        assert central.engine is not None
        corrupt = {
            i.replica_id
            for i in await central.engine.store.incidents(kind=IncidentKind.SDC, limit=1000)
        }
        assert corrupt == {"r3"}


# ---- teardown: a dead or hung rank's replica is killed on its host (issue: a hung rank) -----


async def _teardown_stack(
    make: object, quorum: str, token: str, **agent: object
) -> tuple[HealthProcess, HealthProcess, AsyncQuorumClient]:
    """Central + agent reporting to the quorum service at `quorum`, where r0 and r1 joined."""
    central = await make(http_port=None, quorum=(quorum,))  # type: ignore[operator]
    node = await make(  # type: ignore[operator]
        mode="agent",
        central=central.grpc_address,
        quorum=(quorum,),
        http_port=None,
        heartbeat_timeout=timedelta(milliseconds=400),
        **agent,
    )
    client = AsyncQuorumClient(quorum, token)
    for replica in ("r0", "r1"):
        await client.join(replica, [_RANK, _RANK])
    return central, node, client


async def _exit_codes(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    """The exit codes once every one of `processes` has ended (fails after 20 s)."""

    async def ended() -> bool:
        return all(p.poll() is not None for p in processes)

    await eventually(ended, 20.0)
    return [p.returncode for p in processes]


async def test_a_stopped_rank_has_its_replicas_processes_killed_by_its_agent(
    spawn: Spawn, token: str, make_quorum_server: QuorumServerFactory
) -> None:
    """The agent names the stopped rank, evicts its replica for a teardown and kills that
    replica's processes on the host (the stopped one at once), and nothing else."""
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    async with health_nodes(token) as make:
        central, agent, client = await _teardown_stack(make, quorum.address, token)
        try:
            healthy = spawn(agent.grpc_address, "r0")
            r1 = [spawn(agent.grpc_address, "r1", "--rank", str(rank)) for rank in (0, 1)]
            await _all_running(agent, 3)

            r1[1].send_signal(signal.SIGSTOP)
            assert await _exit_codes(r1) == [-signal.SIGTERM, -signal.SIGKILL]
            assert healthy.poll() is None
            found = await _incident_naming(central, {IncidentKind.FAIL_STOP}, "r1")
            assert found.rank == 1
            assert (found.evidence["quorum"], found.evidence["action"]) == ("evicted", "kill")
            # Counted once the kill returns (through the report or the event stream, first
            # come; the other finds nothing left to kill).
            kills = agent.metrics.teardown_kills._value
            await eventually(lambda: _now(kills.get() == 2))
        finally:
            await client.close()


async def test_a_stopped_rank_is_killed_even_when_its_replica_was_evicted_already(
    spawn: Spawn, token: str, make_quorum_server: QuorumServerFactory
) -> None:
    """The quorum service's own heartbeat timeout may evict the replica first, with no teardown
    asked (a slow replica rejoins by itself): the agent's report then finds it gone, and the
    agent still kills the stopped rank's replica, else it would stay stopped for good."""
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    async with health_nodes(token) as make:
        central, agent, client = await _teardown_stack(make, quorum.address, token)
        try:
            r1 = [spawn(agent.grpc_address, "r1", "--rank", str(rank)) for rank in (0, 1)]
            await _all_running(agent, 2)
            assert await client.report_failure("r1", "silent", reporter="quorum-heartbeat")

            r1[1].send_signal(signal.SIGSTOP)
            assert await _exit_codes(r1) == [-signal.SIGTERM, -signal.SIGKILL]
            found = await _incident_naming(central, {IncidentKind.FAIL_STOP}, "r1")
            assert (found.evidence["quorum"], found.evidence["action"]) == ("already_gone", "kill")
        finally:
            await client.close()


async def test_a_teardown_asked_by_anyone_else_reaches_the_agent_through_the_event_stream(
    spawn: Spawn, token: str, make_quorum_server: QuorumServerFactory
) -> None:
    """A teardown the agent did not ask for itself (the central service's hang verdict, an
    operator) kills the replica's local processes; a plain eviction kills nothing."""
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    async with health_nodes(token) as make:
        _, agent, client = await _teardown_stack(make, quorum.address, token)
        try:
            r0 = spawn(agent.grpc_address, "r0")
            r1 = [spawn(agent.grpc_address, "r1", "--rank", str(rank)) for rank in (0, 1)]
            await _all_running(agent, 3)
            assert agent.agent is not None
            node_agent = agent.agent
            await eventually(lambda: _now(node_agent.watched == {"r0", "r1"}))

            # In this order on the one stream: r0's plain eviction is handled before r1's.
            assert await client.report_failure("r0", "slow", reporter="operator")
            assert await client.report_failure("r1", "hang", reporter="operator", teardown=True)
            assert await _exit_codes(r1) == [-signal.SIGTERM, -signal.SIGTERM]
            assert r0.poll() is None
        finally:
            await client.close()


async def test_under_the_report_policy_the_incident_is_kept_and_nothing_is_killed(
    spawn: Spawn, token: str, make_quorum_server: QuorumServerFactory
) -> None:
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    async with health_nodes(token) as make:
        central, agent, client = await _teardown_stack(
            make, quorum.address, token, failure_action="report"
        )
        try:
            r1 = [spawn(agent.grpc_address, "r1", "--rank", str(rank)) for rank in (0, 1)]
            await _all_running(agent, 2)

            r1[1].send_signal(signal.SIGSTOP)
            found = await _incident_naming(central, {IncidentKind.FAIL_STOP}, "r1")
            # The incident is written after the report (and, under `kill`, after the kill).
            assert (found.evidence["quorum"], found.evidence["action"]) == ("evicted", "report")
            assert [p.poll() for p in r1] == [None, None]
            assert agent.metrics.teardown_kills._value.get() == 0
        finally:
            await client.close()


async def _now(value: bool) -> bool:
    return value
