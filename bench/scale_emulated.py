"""One client process of `bench.scale`: the emulated leaders and ranks of some replicas, as
asyncio tasks talking to the real services with the real clients and the bearer token.

What each emulated party does is what the worker does (worker/quorum_link.py, plan_channel.py,
ring_watch.py), without torch:
* a replica leader joins with every rank's endpoints, asks for each step's quorum (a shared
  connection per `leaders_per_channel` leaders, as hosts would), beats when idle (`Heartbeats`,
  on a thread of its own, as the worker's), and turns each answer into the plan it broadcasts
  (`worker.plan`);
* each leader keeps one Watch stream, and its ranks hear every event through the replica's relay
  tree, one measured hop per level (bench.scale_ranks, as RingWatch and notice_relay); an
  eviction of a member of its ring aborts a rank's exchange, and a replica whose ranks all
  aborted votes no, so its leader asks again with `commit_failed`; a rank holds its new ring once
  it has derived its neighbours from the leader's broadcast;
* a replica whose leader has no stream aborts only at the exchange timeout (30 s,
  ManagerConfig's default).
The in-replica broadcast itself is not emulated (it needs torch): ranks read the payload the
leader produced. Work every real leader or rank does on its own host in parallel (encoding or
decoding the same plan) runs once per process here; `Plans` keeps its measured time.

The orchestrator drives phases over a pipe: `setup`, `rounds`, `arm` and `follow` (a failure),
`ingest`, `stop`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import grpc

from fthsdp.bench.emulation import replica_name
from fthsdp.bench.scale_agent_streams import AgentStreams
from fthsdp.bench.scale_agents import (
    CountingCache,
    Heartbeats,
    SideLoop,
    forward_node_states,
    node_state_request,
)
from fthsdp.bench.scale_model import Shape, Victim, endpoints, host_of, ring_order
from fthsdp.bench.scale_ranks import NAN, Ranks, Replica, Settings
from fthsdp.services.common import logs
from fthsdp.services.quorum.client import (
    CHANNEL_OPTIONS,
    AsyncQuorumClient,
    Quorum,
    QuorumError,
    StaleIncarnationError,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientPlan:
    """One client process's share of the job."""

    index: int
    quorum: str
    central: str
    token: str = field(repr=False)
    shape: Shape
    replicas: tuple[int, ...]
    settings: Settings = field(default_factory=Settings)


class Emulator:
    """The leaders and ranks of `plan.replicas` (see the module doc)."""

    def __init__(self, plan: ClientPlan) -> None:
        self.plan, self.shape, s = plan, plan.shape, plan.settings
        target = plan.quorum
        self.cache = CountingCache()
        self.ranks = Ranks(target, plan.token, self.shape, s)
        leaders = [
            grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, ("grpc.channel_id", i)])
            for i in range(max(1, len(plan.replicas) // s.leaders_per_channel))
        ]
        self._channels = list(leaders)
        self.replicas = {
            r: Replica(
                r,
                self.shape,
                AsyncQuorumClient(
                    target, plan.token, channel=leaders[k % len(leaders)], decode_cache=self.cache
                ),
            )
            for k, r in enumerate(plan.replicas)
        }
        self.agents = AgentStreams(target, plan.token, s.agent_streams)
        self.side = SideLoop(f"scale-heartbeats-{plan.index}")
        self.beats = Heartbeats()
        self._beating: concurrent.futures.Future[None] | None = None
        self.next_step = 0

    # ---- setup --------------------------------------------------------------------------------

    async def setup(self, deadline_s: float) -> dict[str, Any]:
        """Leaders join (each beats from then on, as a worker's heartbeat thread starts with its
        link) and open their Watch stream, a batch at a time."""
        started = time.monotonic()
        s = self.plan.settings
        self._beating = asyncio.run_coroutine_threadsafe(
            self.beats.run(self.plan.quorum, self.plan.token, list(self.replicas.values()),
                           s.heartbeat_interval_s, s.leaders_per_channel),
            self.side.loop,
        )  # fmt: skip
        errors: list[str] = []

        async def join(rep: Replica) -> None:  # a job's replicas start together
            try:
                rep.incarnation = await rep.client.join(rep.name, endpoints(self.shape, rep.index))
            except QuorumError as exc:
                errors.append(f"{rep.name}: {exc}")
                return
            rep.last_call = time.monotonic()
            rep.alive = True

        # A batch at a time, each leader opening its stream as soon as it joined (as the
        # worker's RingWatch does); at most two batches are between their join and a live
        # stream, beating meanwhile: all of a big job's leaders beating at once (1,536 x 5 a
        # second) would take more than the service can answer, and it would evict them.
        end = started + deadline_s
        reps = list(self.replicas.values())
        self.ranks.prepare(len(reps))
        opened = 0
        for first in range(0, len(reps), s.open_batch):
            batch = reps[first : first + s.open_batch]
            await asyncio.gather(*(join(rep) for rep in batch))
            for rep in batch:
                if rep.alive:
                    self.ranks.open_stream(rep)
                    opened += 1
            await self.ranks.wait_live(opened - s.open_batch, min(end, time.monotonic() + 5.0))
        joined_s = time.monotonic() - started
        total = sum(rep.alive for rep in self.replicas.values())
        await self.ranks.wait_live(total, end)
        hosts = [(rep.name, self.shape.hosts_per_replica) for rep in self.replicas.values()]
        agents = await self.agents.open(hosts, end)
        # This process holds tens of thousands of ranks' objects, a real rank's process a few:
        # keep the collector from walking them (it inflated the plan work measured here ~10x).
        gc.freeze()
        return {
            "joined": sum(rep.alive for rep in self.replicas.values()),
            "join_errors": errors,
            "join_s": joined_s,
            "streams_total": total,
            "streams_live": self.ranks.counters["streams_live"],
            **agents,
            "setup_s": time.monotonic() - started,
        }

    # ---- steady rounds ------------------------------------------------------------------------

    async def rounds(self, count: int, deadline_s: float, phase: str) -> dict[str, Any]:
        """`count` consecutive steps: each leader asks for the next step as soon as it has its
        plan for this one (the first round of a job lists every member, with the endpoints
        each leader needs)."""
        self.cache.phase = phase
        self.ranks.foreign_evictions.clear()
        alive = [rep for rep in self.replicas.values() if rep.alive]
        first, self.next_step = self.next_step, self.next_step + count
        end = time.monotonic() + deadline_s

        async def lead(rep: Replica) -> list[tuple[float, float]]:
            times = []
            for step in range(first, first + count):
                sent = time.monotonic()
                try:
                    quorum = await self._quorum(rep, step, end)
                except (QuorumError, TimeoutError) as exc:
                    rep.errors.append(f"step {step}: {exc}")
                    break
                times.append((sent, time.monotonic()))
                self.ranks.deliver(rep, quorum)
            return times

        per_leader = await asyncio.gather(*(lead(rep) for rep in alive))
        steps = min((len(t) for t in per_leader), default=0)
        return {
            "steps": [
                (max(t[s][0] for t in per_leader), max(t[s][1] for t in per_leader))
                for s in range(steps)
            ],
            "leaders": len(alive),
            "errors": [e for rep in alive for e in rep.errors],
            "foreign_evictions": list(self.ranks.foreign_evictions),
            "bytes": self.cache.bytes.get(phase, 0),
            "responses": self.cache.responses.get(phase, 0),
        }

    async def _quorum(
        self, rep: Replica, step: int, end: float, commit_failed: bool = False
    ) -> Quorum:
        """One quorum request; after an eviction the leader joins again (QuorumLink.request)."""
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline")
            try:
                rep.last_call = time.monotonic()
                quorum = await rep.client.quorum(
                    rep.name, rep.incarnation, step, commit_failed=commit_failed,
                    timeout=timedelta(seconds=remaining),
                )  # fmt: skip
            except StaleIncarnationError:
                if not rep.alive:
                    raise
                rep.incarnation = await rep.client.join(rep.name, endpoints(self.shape, rep.index))
                rep.errors.append(f"step {step}: rejoined")
                continue
            rep.last_call = time.monotonic()
            rep.step = step
            return quorum

    # ---- one failure --------------------------------------------------------------------------

    async def arm(self, victim: Victim, number: int) -> str:
        """Before the victim's rank dies: every surviving replica of ours is in the exchange of
        its current step, which an eviction of a ring member (or the exchange timeout) aborts."""
        self.cache.phase = f"failure-{number}"
        self.ranks.first_seen.pop(victim.replica_id, None)
        self.ranks.foreign_evictions.clear()
        self.agents.arm()
        if victim.rank == 0 and victim.replica in self.replicas:  # the leader itself dies
            self.replicas[victim.replica].alive = False
        for rep in self.replicas.values():
            rep.armed = False
            if not rep.alive or rep.index == victim.replica:
                continue
            rep.armed, rep.pending = True, sum(rep.rank_alive)
            rep.aborted = [NAN] * self.shape.ranks
            rep.ring_at = [NAN] * self.shape.ranks
            rep.vote.clear()
            rep.leader_at = rep.voted_at = rep.first_at = NAN
            rep.via_timeout = rep.epochs = 0
            rep.errors = []
        return "armed"

    async def follow(
        self,
        victim: Victim,
        death: float,
        deadline_s: float,
        survivors: list[int],
        detail: bool = False,
    ) -> dict[str, Any]:
        """After the death: follows our surviving replicas until each rank holds its new ring
        or the deadline passes. `survivors`: the replicas the new ring must hold (each rank's
        neighbours are checked against it); `detail`: also every rank's neighbours."""
        end = death + deadline_s
        mine = [rep for rep in self.replicas.values() if rep.armed]
        timeout_at = death + self.plan.settings.exchange_timeout_s
        expected = frozenset(replica_name(r) for r in survivors)
        deliveries: list[tuple[Replica, Quorum, float]] = []
        await asyncio.gather(
            *(self._recover(rep, victim, expected, timeout_at, end, deliveries) for rep in mine)
        )
        # The plan work after the leaders had their quorums, so that one leader's does not
        # delay another's answer (each is its own host in a job); stamped from each arrival.
        for rep, quorum, arrived in deliveries:
            self.ranks.deliver(rep, quorum, arrived)
        ring = ring_order(survivors)
        if victim.replica in self.replicas and self.agents.mode != "off":
            # Its agents may hear of it after the survivors hold their ring.
            while (
                len(self.agents.heard(victim.replica_id)) < self.shape.hosts_per_replica
                and time.monotonic() < end
            ):
                await asyncio.sleep(0.01)
        return {
            "agents_heard": self.agents.heard(victim.replica_id),
            "agent_messages": self.agents.messages,
            "first_seen": self.ranks.first_seen.get(victim.replica_id),
            "replicas": {rep.index: self.ranks.outcome(rep, ring, detail) for rep in mine},
            "foreign_evictions": list(self.ranks.foreign_evictions),
        }

    async def _recover(
        self,
        rep: Replica,
        victim: Victim,
        expected: frozenset[str],
        timeout_at: float,
        end: float,
        deliveries: list[tuple[Replica, Quorum, float]],
    ) -> None:
        """The survivor's path: its vote fails once all its ranks aborted (or timed out), its
        leader asks again with `commit_failed`, and then goes on stepping (an exchange on a
        partial ring commits) until it holds the quorum of every survivor (`expected`): a round
        that formed at the join timeout before every survivor had voted leaves the late ones
        for the next step's round, as it would in a job."""
        try:
            await asyncio.wait_for(rep.vote.wait(), max(0.0, timeout_at - time.monotonic()))
            # Its deepest rank hears of the eviction a few relay hops after the leader.
            await asyncio.sleep(max(0.0, rep.voted_at - time.monotonic()))
        except TimeoutError:  # the ranks without a stream: the exchange timeout
            now = time.monotonic()
            for i in range(self.shape.ranks):
                if rep.rank_alive[i] and math.isnan(rep.aborted[i]):
                    rep.via_timeout += 1
                    self.ranks.abort(rep, i, now)
        step, failed = rep.step, True
        while time.monotonic() < end:
            try:
                quorum = await self._quorum(rep, step, end, commit_failed=failed)
            except (QuorumError, TimeoutError) as exc:
                rep.errors.append(str(exc))
                return
            members = frozenset(m.replica_id for m in quorum.members)
            if victim.replica_id in members:
                continue  # formed before the eviction: its ring fails again
            now = time.monotonic()
            if math.isnan(rep.first_at):
                rep.first_at = now
            rep.epochs += 1
            deliveries.append((rep, quorum, now))
            if members == expected:
                rep.leader_at = now
                rep.armed = False
                return
            await asyncio.sleep(self.plan.settings.partial_step_s)
            step, failed = step + 1, False

    # ---- health ingest ------------------------------------------------------------------------

    async def ingest(self, seconds: float) -> dict[str, Any]:
        """Every node agent of the replicas not torn down forwards its node state at the agent's
        cadence (whether or not the quorum service admitted the replica)."""
        s, shape = self.plan.settings, self.shape
        requests = []
        for rep in self.replicas.values():
            if rep.torn_down:
                continue
            for h in range(shape.hosts_per_replica):
                ranks = range(
                    h * shape.ranks_per_host, min((h + 1) * shape.ranks_per_host, shape.ranks)
                )
                data = node_state_request(
                    host_of(rep.index, ranks[0], shape.ranks_per_host), rep.name, ranks, rep.step
                )
                requests.append((data, len(ranks)))
        return await forward_node_states(
            self.plan.central, self.plan.token, requests, seconds=seconds,
            interval_s=s.forward_interval_s, per_channel=s.agents_per_channel,
            timeout_s=s.forward_timeout_s,
        )  # fmt: skip

    # ---- lifecycle ----------------------------------------------------------------------------

    async def stop(self) -> dict[str, Any]:
        self.beats.stopping = True
        if self._beating is not None:
            await asyncio.wrap_future(self._beating)
        await self.ranks.close()
        await self.agents.close()
        self.side.close()
        for channel in self._channels:
            await channel.close(None)
        return {
            **self.ranks.counters,
            "heartbeats": self.beats.sent,
            "heartbeat_failures": self.beats.failed,
            "heartbeat_errors": self.beats.errors,
            "plan_work": self.ranks.plans.summary(),
            "quorum_bytes": dict(self.cache.bytes),
            "quorum_responses": dict(self.cache.responses),
            "cpu_s": time.process_time(),
        }


def run_client(conn: Connection, plan: ClientPlan) -> None:
    """Client process body: answers the orchestrator's commands until `stop`."""
    logs.configure("ERROR")
    asyncio.run(_serve(conn, plan))


async def _serve(conn: Connection, plan: ClientPlan) -> None:
    emulator = Emulator(plan)
    loop = asyncio.get_running_loop()
    commands: dict[str, Callable[..., Any]] = {
        "setup": emulator.setup,
        "rounds": emulator.rounds,
        "arm": emulator.arm,
        "follow": emulator.follow,
        "ingest": emulator.ingest,
    }
    conn.send("ready")
    while True:
        seq, command, kwargs = await loop.run_in_executor(None, conn.recv)
        if command == "stop":
            conn.send((seq, await emulator.stop()))
            return
        try:
            conn.send((seq, await commands[command](**kwargs)))
        except Exception as exc:  # reported, not raised: the harness must finish
            conn.send((seq, {"error": f"{type(exc).__name__}: {exc}"}))
