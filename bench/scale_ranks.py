"""The emulated ranks of a `bench.scale` client process: each replica's leader holds one Watch
stream, and its ranks hear each event through the replica's relay tree (as the worker's
RingWatch and notice_relay: an eviction of a member of its ring aborts a rank's exchange, its own
replica's teardown ends it), `depth x Settings.relay_hop_s` after the leader (the hop measured on
the real relay code, bench.scale_relay); each rank's plan comes from its leader's broadcast (its
ring neighbours); and the replicas' state the leaders share with their ranks."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import grpc

from fthsdp.bench.emulation import replica_name
from fthsdp.bench.scale_agents import Plans
from fthsdp.bench.scale_model import Shape, endpoint, ring_neighbours
from fthsdp.bench.scale_relay import depth
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.client import (
    CHANNEL_OPTIONS,
    AsyncQuorumClient,
    MembershipEvent,
    Quorum,
    QuorumError,
)

NAN = float("nan")


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """How the clients emulate a job (defaults: the worker's and agent's own settings)."""

    streams_per_channel: int = 64
    relay_hop_s: float = 0.0
    """One hop of the relay tree inside a replica (measured by the orchestrator)."""
    leaders_per_channel: int = 64
    agents_per_channel: int = 16
    open_batch: int = 128
    """Leaders that join (and open their Watch stream) at once: a job's leaders start over
    seconds, not all in one instant, and each beats only until its stream holds it."""
    heartbeat_interval_s: float = 0.2
    exchange_timeout_s: float = 30.0
    watch_retry_s: float = 0.2
    rank_beat_s: float = 0.2
    forward_interval_s: float = HealthConfig().forward_interval.total_seconds()
    forward_timeout_s: float = 1.0
    agent_streams: str = "filtered"
    """The node agents' quorum event streams (`scale_agent_streams.AGENT_STREAM_MODES`)."""
    partial_step_s: float = 0.5
    """A survivor holding a quorum of only some survivors trains a step on it (this long) before
    its leader asks again (an emulated step is otherwise instant)."""


class Replica:
    """One emulated replica: its leader's state and its ranks' view."""

    def __init__(self, index: int, shape: Shape, client: AsyncQuorumClient) -> None:
        w = shape.ranks
        self.index, self.name, self.client = index, replica_name(index), client
        self.incarnation = 0
        self.held = 0
        """The incarnation its leader's Watch stream keeps alive (0: none)."""
        self.step = 0
        self.alive = False
        """Its leader takes part (joined, not torn down)."""
        self.torn_down = False
        """Its ranks exited on its teardown: its hosts' agents have no rank left to forward."""
        self.last_call = 0.0
        self.rank_alive = [True] * w
        self.live = False
        """Its leader's stream delivered its snapshot (its ranks' relays hold it from then)."""
        self.aborted = [NAN] * w
        self.ring_at = [NAN] * w
        self.neighbours: list[tuple[str, str] | None] = [None] * w
        self.ring: frozenset[str] = frozenset()
        self.sent: bytes | None = None
        self.encoded: tuple[Quorum, bytes] | None = None
        """Its leader's last quorum and payload (a steady one is re-stamped, not encoded)."""
        self.quorum_id = 0
        self.armed = False
        self.pending = 0
        self.vote = asyncio.Event()
        self.leader_at = NAN
        self.first_at = NAN
        self.epochs = 0
        self.voted_at = NAN
        self.via_timeout = 0
        self.errors: list[str] = []

    def rank_is_alive(self, i: int) -> bool:
        return self.rank_alive[i]

    def current_step(self) -> int:
        return self.step


class Ranks:
    """Every rank of a client process's replicas: their streams and their plans."""

    def __init__(self, target: str, token: str, shape: Shape, settings: Settings) -> None:
        self._target, self._token, self.shape, self.settings = target, token, shape, settings
        self.plans = Plans()
        self.watchers: list[AsyncQuorumClient] = []
        self.channels: list[grpc.aio.Channel] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.counters = {
            "events": 0,
            "event_bytes": 0,
            "relay_frames": 0,
            "stream_errors": 0,
            "streams_live": 0,
        }
        self._depth = [depth(i) for i in range(shape.ranks)]
        self.foreign_evictions: list[str] = []
        """Evictions of replicas of ours that nobody killed (a missed heartbeat), as seen by
        their rank 0."""
        self.first_seen: dict[str, float] = {}
        """Replica id -> when a rank here first heard of its eviction."""
        self._sizes: dict[tuple[Any, ...], int] = {}
        self.closing = False

    def prepare(self, leaders: int) -> None:
        """The channels the leaders' streams share (`streams_per_channel` a channel)."""
        s = self.settings
        self.channels = [
            grpc.aio.insecure_channel(
                self._target, options=[*CHANNEL_OPTIONS, ("grpc.channel_id", 100_000 + i)]
            )
            for i in range(max(1, leaders // s.streams_per_channel))
        ]
        self.watchers = [
            AsyncQuorumClient(self._target, self._token, channel=c) for c in self.channels
        ]

    def open_stream(self, rep: Replica) -> None:
        """Opens the leader's Watch stream (as its RingWatch starts right after its join)."""
        watcher = self.watchers[len(self.tasks) % len(self.watchers)]
        self.tasks.append(asyncio.create_task(self._leader(rep, watcher)))

    async def wait_live(self, count: int, until: float) -> None:
        """Until `count` streams delivered their snapshot, or `until`."""
        while self.counters["streams_live"] < count and time.monotonic() < until:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.closing = True
        for watcher in self.watchers:
            await watcher.close()
        for task in self.tasks:
            task.cancel()
        for channel in self.channels:
            await channel.close(None)

    async def _leader(self, rep: Replica, watcher: AsyncQuorumClient) -> None:
        """The leader's RingWatch: follows its stream, reopens it after a failure."""
        while not self.closing and rep.rank_alive[0]:
            incarnation = rep.incarnation
            stream = watcher.watch(holder=(rep.name, incarnation), without_joins=True)
            try:
                async for event in stream:
                    if event.kind == "snapshot":  # it names the incarnation it keeps alive
                        rep.held = incarnation if event.incarnation == incarnation else 0
                    self._on_event(rep, event)
                    del event  # a 1,536-member event is ~100 KB: hold none per replica
                    if not rep.rank_alive[0]:
                        break
            except (QuorumError, grpc.RpcError):
                self.counters["stream_errors"] += 1
            rep.held = 0
            stream.cancel()
            if not self.closing and rep.rank_alive[0]:
                await asyncio.sleep(self.settings.watch_retry_s)

    def _on_event(self, rep: Replica, event: MembershipEvent) -> None:
        """The leader got `event`: each rank gets it `depth x hop` later through the relays."""
        now = time.monotonic()
        self.counters["events"] += 1
        self.counters["event_bytes"] += self._event_bytes(event)
        self.counters["relay_frames"] += sum(rep.rank_alive) - 1
        if not rep.live:
            rep.live = True
            self.counters["streams_live"] += 1
        if event.kind not in ("evicted", "left") or event.replica_id is None:
            return
        self.first_seen.setdefault(event.replica_id, now)
        if event.replica_id == rep.name:
            if event.teardown:  # its ranks exit (Manager._torn_down)
                rep.rank_alive = [False] * self.shape.ranks
                rep.alive = False
                rep.torn_down = True
            else:
                self.foreign_evictions.append(f"{rep.name}: {event.reason}")
            return
        if rep.armed and event.replica_id in rep.ring:
            hop = self.settings.relay_hop_s
            for i in range(self.shape.ranks):
                if rep.rank_alive[i] and math.isnan(rep.aborted[i]):
                    self.abort(rep, i, now + self._depth[i] * hop)

    def abort(self, rep: Replica, i: int, at: float) -> None:
        """Rank `i` aborts its exchange at `at`; the replica votes no once all its ranks have."""
        rep.aborted[i] = at
        rep.pending -= 1
        if rep.pending == 0:
            rep.voted_at = max(t for t in rep.aborted if not math.isnan(t))
            rep.vote.set()

    def _event_bytes(self, event: MembershipEvent) -> int:
        key = (event.kind, event.replica_id, event.quorum_id, len(event.members), event.reason)
        size = self._sizes.get(key)
        if size is None:
            if len(self._sizes) > 256:
                self._sizes.clear()
            size = self._sizes[key] = codec.event_to_pb(event).ByteSize()
        return size

    def deliver(self, rep: Replica, quorum: Quorum, arrived: float | None = None) -> bool:
        """The leader's broadcast and every rank's plan: in the steady state only max_step
        moves; otherwise each live rank derives its ring neighbours. True if the ring changed.

        With `arrived` (when the leader got `quorum`), its ranks hold the ring at `arrived` plus
        the CPU time this plan work took here: each leader does it on its own host in a job,
        while here the leaders of a process take turns."""
        cpu = time.thread_time()
        payload = self.plans.payload(quorum, rep.name, rep.encoded)
        rep.encoded = (quorum, payload)
        if self.plans.steady(rep.sent, payload) is not None:
            return False
        order, members = self.plans.members(payload, rep.name)
        rep.sent, rep.quorum_id = payload, quorum.quorum_id
        rep.ring = frozenset(order)
        position = order[rep.name]
        before, after = (
            members[position - 1]["ranks"],
            members[(position + 1) % len(members)]["ranks"],
        )
        at = time.monotonic() if arrived is None else arrived + time.thread_time() - cpu
        for i in range(self.shape.ranks):
            if rep.rank_alive[i]:
                rep.neighbours[i] = (before[i][0], after[i][0])
                rep.ring_at[i] = at
        return True

    def outcome(self, rep: Replica, ring: list[int], detail: bool) -> dict[str, Any]:
        ranks = [i for i in range(self.shape.ranks) if rep.rank_alive[i]]
        before, after = ring_neighbours(ring, rep.index) if rep.index in ring else (-1, -1)
        wrong = sum(
            1
            for i in ranks
            if before < 0
            or rep.neighbours[i]
            != (endpoint(self.shape, before, i).ftar, endpoint(self.shape, after, i).ftar)
        )
        return {
            "leader_at": None if math.isnan(rep.leader_at) else rep.leader_at,
            "voted_at": None if math.isnan(rep.voted_at) else rep.voted_at,
            "first_at": None if math.isnan(rep.first_at) else rep.first_at,
            "epochs": rep.epochs,
            "quorum_id": rep.quorum_id,
            "ring": sorted(rep.ring),
            "ranks": len(ranks),
            "aborted": _times(rep.aborted, ranks),
            "ring_at": _times(rep.ring_at, ranks),
            "via_timeout": rep.via_timeout,
            "errors": rep.errors,
            "wrong_neighbours": wrong,
            "neighbours": [rep.neighbours[i] for i in ranks] if detail else None,
        }


def _times(values: list[float], ranks: list[int]) -> list[float | None]:
    return [None if math.isnan(values[i]) else values[i] for i in ranks]
