"""The node agent: the first of the two heartbeat levels.

Every rank on a host reports to the agent on 127.0.0.1. The agent runs `FailStopDetector` over
its ranks' heartbeats when the earliest of them would fall silent (`next_check_in`) and watches
their processes (`ExitWatch`); a rank whose process exited, or silent for `heartbeat_timeout`,
is reported to the quorum service at once (so the survivors' next quorum leaves its replica
out: kill -> new quorum within one RPC where the exit is seen, heartbeat_timeout + one RPC for
a silence, a hang or a process out of the agent's sight), and the incident goes to the
central service with the outcome of the report. The agent follows the quorum service's events
about its own host's replicas (a stream filtered to them, its snapshot naming their
incarnations): joins say which incarnation the silent rank belonged to, and the report (and the
incident's evidence, for a central service that evicts when the report failed) names that one
only. An agent cut from the central service goes on reporting its ranks to the quorum service;
the central service leaves their liveness to it meanwhile.

With `failure_action` "kill" the report asks for a teardown, and a replica the stream shows
evicted with a teardown (by this agent, another one, or the central service's hang verdict) has
its processes on this host killed, by the pids its ranks registered (`teardown`), so its
process manager restarts it now rather than after a collective timeout.
A rank this agent finds silent has its replica torn down here whatever the quorum service
answers: one already evicted by the service's own heartbeat timeout was evicted without one.

Everything else (step, collective and fingerprint records, clean departures) is buffered and
forwarded to the central service every `forward_interval` with the node's compact state (its
ranks, their steps and silence), so the central load grows with nodes, not ranks. Losing the
central service never blocks the agent: a forward has a deadline, failed batches are dropped and
counted (incidents excepted: they are kept and retried), the buffer is bounded, and retries back
off, jittered: up to a few seconds while central is out of reach, further while it is reachable
but too busy to answer (`forward_pacing`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from fthsdp.protos import health_pb2_grpc as pb_grpc
from fthsdp.services.common.process_ref import ProcessRef
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import (
    NodeRank,
    NodeState,
    ReportBatch,
    batch_to_pb,
    restamp,
)
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.detectors.failstop import FailStopDetector
from fthsdp.services.health.exit_watch import ExitWatch
from fthsdp.services.health.forward_pacing import (
    CHANNEL_OPTIONS,
    ForwardPacing,
    reached_busy_central,
)
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.quorum_reporter import QuorumReporter
from fthsdp.services.health.teardown import kill
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    Incident,
    RankId,
    StepRecord,
)
from fthsdp.services.quorum.client import MAX_WATCHED_REPLICAS, MembershipEvent

log = logging.getLogger(__name__)

_MAX_HELD_INCIDENTS = 1000
_MAX_TRACKED_REPLICAS = 4096
"""Replicas whose joins the agent remembers (the oldest goes first): a bound, whatever the job."""
_JOINS_KEPT = 4


class NodeAgent:
    """One host's agent; all methods run on one event loop."""

    def __init__(
        self,
        config: HealthConfig,
        token: Token,
        metrics: HealthMetrics,
        *,
        quorum: QuorumReporter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._token = token
        self._metrics = metrics
        self._quorum = quorum
        self._clock = clock
        self._detector = FailStopDetector(config.heartbeat_timeout.total_seconds())
        self._pids: dict[RankId, ProcessRef] = {}
        """The process each local rank registered in its latest heartbeat."""
        self._exits = ExitWatch(self._process_exited)
        """Those processes' exits, seen as they happen (where the platform allows)."""
        self._since: dict[RankId, float] = {}
        """When each local rank's current process's first beat arrived (this agent's clock:
        arrival order is the real order, where beat times rebased per batch may swap)."""
        self._heard: dict[RankId, float] = {}
        """When each local rank's latest beat arrived (this agent's clock)."""
        self._joins: dict[str, deque[tuple[float, int]]] = {}
        """Per replica, its latest incarnations' joins as the event stream told them (this
        agent's clock): which incarnation a rank silent since a given time belonged to. Reset
        when a new stream starts, to the incarnations its snapshot names (a join made while no
        stream was up is unknown)."""
        self._local: dict[str, None] = {}
        """The replicas whose ranks beat here, oldest first (at most `MAX_WATCHED_REPLICAS`):
        the event stream is filtered to them."""
        self._local_changed = asyncio.Event()
        self.watched: frozenset[str] = frozenset()
        """The replicas the live event stream follows (empty: none up yet)."""
        self._records: deque[Any] = deque()
        self._incidents: deque[Incident] = deque(maxlen=_MAX_HELD_INCIDENTS)
        self._dropped = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._reports: set[asyncio.Task[None]] = set()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.HealthServiceStub | None = None
        self.forwarded = 0
        """Batches the central service accepted."""
        self._pacing = ForwardPacing(config.forward_interval.total_seconds())
        """The forward interval the central service asked for in its last answer (0: none; a
        central service with more agents than it takes forwards spaces them out)."""
        self._send_now = asyncio.Event()
        """An incident or a full batch of records waits: it goes now, not at the next interval
        (which central may have spaced out for node states)."""

    @property
    def dropped(self) -> int:
        """Records dropped on the way to the central service (full buffer or failed forward)."""
        return self._dropped

    # ---- ingest from local ranks ------------------------------------------------------------

    def forward_interval_ms(self) -> int:
        """Local ranks send at their own interval."""
        return 0

    async def ingest(self, batch: ReportBatch) -> None:
        """Takes one validated batch from a local rank."""
        arrived = self._clock()
        for beat in batch.heartbeats:
            # This agent's node name is the host everywhere (its node state, the central
            # service's verdicts): a rank's own idea of its host name may differ.
            hb = dataclasses.replace(beat, host=self._config.node)
            self._detector.beat(hb)
            self._heard_replica(hb.rank.replica_id)
            if hb.pid:
                ref = ProcessRef(hb.pid, hb.pid_start)
                if self._pids.get(hb.rank) != ref:
                    self._since[hb.rank] = arrived
                    self._exits.watch(hb.rank, ref)
                self._pids[hb.rank] = ref
            self._heard[hb.rank] = arrived
        for rank in batch.left:
            self._detector.leave(rank)
            self._exits.forget(rank)
            self._pids.pop(rank, None)
            self._since.pop(rank, None)
            self._heard.pop(rank, None)
        self._buffer(batch.steps)
        self._buffer(batch.collectives)
        self._buffer(batch.fingerprints)
        self._buffer(batch.left)
        self._incidents.extend(batch.incidents)
        self._metrics.ranks.set(len(self._detector.tracked()))

    def _buffer(self, records: tuple[Any, ...]) -> None:
        if not records:
            return
        room = self._config.max_buffered_records - len(self._records)
        if room < len(records):
            # Keep the newest: the oldest telemetry is the least useful to the detectors.
            excess = len(records) - max(room, 0)
            for _ in range(min(excess, len(self._records))):
                self._records.popleft()
            self._drop(excess)
        self._records.extend(records[-self._config.max_buffered_records :])
        self._send_if_full()

    def _send_if_full(self) -> None:
        """A full batch of records goes now: a spaced-out interval is for node states."""
        if len(self._records) >= self._config.max_batch_records:
            self._send_now.set()

    def _drop(self, count: int) -> None:
        self._dropped += count
        self._metrics.dropped.inc(count)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the check loop and, with a central address, the forward loop."""
        if self._tasks:
            return
        self._tasks.append(asyncio.create_task(self._check_loop(), name="agent-check"))
        if self._quorum is not None:
            self._tasks.append(asyncio.create_task(self._watch_loop(), name="agent-watch"))
        if self._config.central is not None:
            self._channel = grpc.aio.insecure_channel(self._config.central, options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.HealthServiceStub(self._channel)
            self._tasks.append(asyncio.create_task(self._forward_loop(), name="agent-forward"))

    async def stop(self) -> None:
        """Stops the loops, lets pending quorum reports finish, flushes once, closes."""
        self._exits.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._reports:
            await asyncio.wait(self._reports, timeout=5)
        if self._stub is not None:
            with contextlib.suppress(Exception):
                await self._forward_once()
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    # ---- fail-stop: local detection, immediate report ---------------------------------------

    async def _check_loop(self) -> None:
        while True:
            try:
                self.check_once()
            except Exception:
                log.exception("agent check failed")
            await asyncio.sleep(self.next_check_in())

    def next_check_in(self) -> float:
        """Seconds to the next fail-stop check: when the earliest rank falls silent if it beats
        no more (a silence is seen as it happens, and a node of beating ranks is checked about
        once a timeout, not 20 times a second), but no sooner than `check_interval` and no later
        than a quarter of the timeout (a first beat may carry a time that is already old)."""
        floor = self._config.check_interval.total_seconds()
        ceiling = max(floor, self._detector.timeout_s / 4)
        deadline = self._detector.next_deadline()
        if deadline is None:
            return ceiling
        return min(max(deadline - self._clock(), floor), ceiling)

    def check_once(self) -> list[Incident]:
        """One fail-stop check; each new incident starts its quorum report at once."""
        found = self._detector.check(self._clock())
        for incident in found:
            self._start_report(incident)
        self._metrics.ranks.set(len(self._detector.tracked()))
        return found

    def _process_exited(self, rank: RankId, ref: ProcessRef) -> None:
        """A local rank's process ended: reported now, as its silence would be later. (Only
        its current process is watched: a clean leave, a newer process and a teardown each
        replace or end the watch first.)"""
        incident = self._detector.exited(rank, self._clock(), pid=ref.pid)
        if incident is not None:
            self._start_report(incident)

    def _start_report(self, incident: Incident) -> None:
        """Logs and counts a fail-stop incident and starts its quorum report at once."""
        log.warning("incident: %s", incident.summary, extra={"replica_id": incident.replica_id})
        self._metrics.incidents.labels(kind=incident.kind.value).inc()
        heard = None
        if incident.rank is not None:
            heard = self._heard.get(RankId(replica_id=incident.replica_id, rank=incident.rank))
        task = asyncio.create_task(self._report(incident, heard))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    @property
    def _kills(self) -> bool:
        return self._config.failure_action == "kill"

    async def _report(self, incident: Incident, last_heard: float | None) -> None:
        """Reports a rank found silent (its last beat arrived at `last_heard`) and, with
        `failure_action` "kill", tears its replica's incarnation down here."""
        evidence: dict[str, Any] = {
            "found_by": f"agent:{self._config.node}",
            "policy": "evict",
            "action": self._config.failure_action,
        }
        if self._quorum is not None:
            reason = f"fail_stop: {incident.summary}"
            # Only the incarnation the silent rank belonged to: a warm spare may have taken over
            # as the next one before the heartbeat timeout ran out, and must not go with it.
            incarnation = self._incarnation_at(incident.replica_id, last_heard)
            if incarnation is not None:
                # The central service evicts for us when this report failed: the same one only.
                evidence["incarnation"] = incarnation
            outcome = await self._quorum.report_failure(
                incident.replica_id,
                reason,
                reporter=f"fthsdp-health-agent:{self._config.node}",
                teardown=self._kills,
                incarnation=incarnation,
            )
            last_beat = float(incident.evidence.get("last_beat_at", incident.detected_at))
            if self._kills:
                # Whatever the answer: the quorum service may have evicted the replica already
                # by its own heartbeat timeout, which asks for no teardown ("already_gone"), or
                # be unreachable, and a stopped rank here would then stay stopped for good. And
                # not only through the event stream, which may be reconnecting right now.
                await self.teardown(incident.replica_id, started_by=last_heard)
            latency = self._clock() - last_beat
            if outcome == "evicted":
                self._metrics.detection_seconds.observe(latency)
            evidence |= {"quorum": outcome, "silence_to_report_s": round(latency, 4)}
        else:
            evidence["quorum"] = "not_configured"
        self._incidents.append(restamp(incident, evidence=evidence))
        self._send_now.set()

    # ---- teardown ---------------------------------------------------------------------------

    def _heard_replica(self, replica_id: str) -> None:
        if replica_id in self._local:
            return
        if len(self._local) >= MAX_WATCHED_REPLICAS:
            self._local.pop(next(iter(self._local)))
        self._local[replica_id] = None
        self._local_changed.set()

    async def _watch_loop(self) -> None:
        """Follows the quorum service's events about this host's replicas, from the first one
        heard here. A new replica here opens a new stream (filtered to it too), and the old one
        ends once the new one's snapshot arrived, so no event falls between the two."""
        old: asyncio.Task[None] | None = None
        try:
            while True:
                await self._local_changed.wait()
                self._local_changed.clear()
                live = asyncio.Event()
                new = asyncio.create_task(self._follow(frozenset(self._local), live))
                if old is not None:
                    up = asyncio.create_task(live.wait())
                    await asyncio.wait((up, new), return_when=asyncio.FIRST_COMPLETED)
                    up.cancel()
                    await _cancelled(old)
                old = new
        finally:
            if old is not None:
                await _cancelled(old)

    async def _follow(self, replicas: frozenset[str], live: asyncio.Event) -> None:
        """One stream's events: joins name the incarnation a report is for (whatever the
        failure action), teardowns are carried out under "kill"."""
        assert self._quorum is not None

        def resynced(snapshot: MembershipEvent) -> None:
            # Incarnations registered before the stream: known since before anything heard.
            self._joins.clear()
            for replica_id, incarnation in zip(
                snapshot.members, snapshot.incarnations, strict=False
            ):
                self._joined(replica_id, incarnation, at=-math.inf)
            self.watched = replicas
            live.set()

        teardowns = self._quorum.teardowns(
            replicas=replicas, on_join=self._joined, on_resync=resynced
        )
        async with contextlib.aclosing(teardowns):  # its stream ends with this task
            async for replica_id in teardowns:
                if not self._kills:
                    continue
                try:
                    # Shielded: a newer stream replacing this one must not stop a kill halfway.
                    await asyncio.shield(self.teardown(replica_id))
                except Exception:
                    log.exception("teardown of %s failed", replica_id)

    def _joined(self, replica_id: str, incarnation: int, at: float | None = None) -> None:
        joins = self._joins.get(replica_id)
        if joins is None:
            if len(self._joins) >= _MAX_TRACKED_REPLICAS:
                self._joins.pop(next(iter(self._joins)))
            joins = self._joins[replica_id] = deque(maxlen=_JOINS_KEPT)
        joins.append((self._clock() if at is None else at, incarnation))

    def _incarnation_at(self, replica_id: str, heard: float | None) -> int | None:
        """The incarnation of `replica_id` that had joined by `heard` (a silent rank's last beat:
        its process belonged to that one), or None if this agent did not see it join."""
        if heard is None:
            return None
        joined = [inc for at, inc in self._joins.get(replica_id, ()) if at <= heard]
        return joined[-1] if joined else None

    async def teardown(self, replica_id: str, *, started_by: float | None = None) -> list[int]:
        """Kills the local processes of `replica_id` (SIGTERM, then SIGKILL after the grace)
        and stops tracking its ranks, so their silence is no new incident here (the central
        service still sees them go, and shows the replica down); returns the pids signalled. A
        no-op for a replica with no rank here (or one torn down already).

        With `started_by` (when the silent rank's last beat arrived), only processes that were
        beating by then go: the silent one's incarnation. A rank whose process first beat later
        is the next incarnation already (a warm spare takes over within the heartbeat
        timeout). A sibling that first beat only after the silent rank's last beat (it died
        while its replica was still starting) is spared too; the teardown event of the
        eviction asked for takes it, or its process manager does."""
        ranks = [
            r
            for r in self._detector.tracked()
            if r.replica_id == replica_id
            and (started_by is None or self._since.get(r, started_by) <= started_by)
        ]
        refs = [self._pids.pop(r) for r in ranks if r in self._pids]
        for rank in ranks:
            self._detector.leave(rank)
            self._exits.forget(rank)
            self._since.pop(rank, None)
            self._heard.pop(rank, None)
        if not ranks:
            return []
        pids = await kill(refs, self._config.kill_grace.total_seconds())
        self._metrics.teardown_kills.inc(len(pids))
        self._metrics.ranks.set(len(self._detector.tracked()))
        log.warning(
            "replica %s torn down: killed pids %s of its %d local ranks",
            replica_id,
            pids,
            len(ranks),
            extra={"replica_id": replica_id, "pids": pids},
        )
        return pids

    # ---- forwarding -------------------------------------------------------------------------

    async def _forward_loop(self) -> None:
        failed, delay = False, self._pacing.interval_s
        while True:
            if failed:
                await asyncio.sleep(delay)  # incidents and a backlog wait out the backoff too
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._send_now.wait(), delay)
            self._send_now.clear()
            try:
                failed, delay = await self._forward_once()
            except Exception:
                log.exception("agent forward failed unexpectedly")
                failed, delay = True, self._pacing.failed(busy=False)
            if not failed:
                self._send_if_full()

    def node_state(self) -> NodeState:
        """This node's compact state: every beating rank (silent ones are already incidents)."""
        now = self._clock()
        ranks = []
        for rank in self._detector.tracked():
            beat = self._detector.last_beat(rank)
            if beat is None or self._detector.silent(rank):
                continue
            ranks.append(
                NodeRank(
                    rank=rank,
                    step=beat.step,
                    silent_s=max(0.0, now - beat.at),
                    process=beat.process,
                )
            )
        return NodeState(node=self._config.node, ranks=tuple(ranks), dropped=self._dropped)

    def _take_batch(self) -> ReportBatch:
        room = self._config.max_batch_records
        incidents = tuple(self._incidents.popleft() for _ in range(min(room, len(self._incidents))))
        room -= len(incidents)
        taken = [self._records.popleft() for _ in range(min(room, len(self._records)))]
        return ReportBatch(
            source=f"agent:{self._config.node}",
            host=self._config.node,
            steps=tuple(r for r in taken if isinstance(r, StepRecord)),
            collectives=tuple(r for r in taken if isinstance(r, CollectiveRecord)),
            fingerprints=tuple(r for r in taken if isinstance(r, Fingerprint)),
            left=tuple(r for r in taken if isinstance(r, RankId)),
            incidents=incidents,
            node=self.node_state(),
        )

    async def _forward_once(self) -> tuple[bool, float]:
        """Sends one batch: (failed, the delay before the next forward). A failed one's records
        are dropped and its incidents kept."""
        if self._stub is None or self._channel is None:
            return True, self._pacing.failed(busy=False)
        stub: Any = self._stub  # the generated stubs type only the blocking call
        batch = self._take_batch()
        request = batch_to_pb(batch, sent_at=self._clock())
        try:
            response = await stub.Report(
                request,
                timeout=self._config.forward_timeout.total_seconds(),
                metadata=(("authorization", self._token.header()),),
            )
        except grpc.RpcError as err:
            self._metrics.forwards.labels(outcome="failed").inc()
            self._incidents.extendleft(reversed(batch.incidents))
            self._drop(batch.size() - len(batch.incidents))
            busy = reached_busy_central(err, self._channel)
            log.debug("forward to the central service failed (%s)", "busy" if busy else "no reach")
            return True, self._pacing.failed(busy)
        self._metrics.forwards.labels(outcome="ok").inc()
        self.forwarded += 1
        return False, self._pacing.answered(response.forward_interval_ms)

    @property
    def asked_interval_s(self) -> float:
        """The interval central's last answer asked this agent to forward at (0: none)."""
        return self._pacing.asked_s


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancels `task` and waits for it to end."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
