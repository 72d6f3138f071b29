"""The central health engine: feeds ingested telemetry into `HealthCore`, evaluates the detectors
on a timer, keeps incidents in the store, and applies the policies.

Policies (what an incident makes the service do besides recording it):
- fail-stop found here of a rank with no node agent (it beats straight to this service), hang,
  SDC: evict the replica through the quorum service, so the survivors form a new quorum without
  it, and with `HealthConfig.failure_action` "kill" ask for its teardown (its ranks exit, the
  agents kill its processes);
- fail-slow and slow-rank: evict or only report, per `DetectorConfig.fail_slow_policy`.
One fault is one incident. A node agent finds its ranks' fail-stops itself, reports them to the
quorum service and forwards the incident; the core sees the same rank fall silent at about the
same moment, often a little before the agent's incident arrives (the agent forwards after its
quorum report). So a fail-stop the core finds on a node whose agent is alive is held for
`AGENT_GRACE_S`: the agent's incident for the rank drops it, and so does the rank beating again;
otherwise it is stored and acted on. The held verdict is still in the state at once (the replica
shows "down").

A node agent this service no longer hears (its node states stopped) is either gone with its
host or cut from this service alone, and from here the two look the same: every rank behind it
falls silent. Its ranks' fail-stops are not stored (counted in
`fthsdp_health_failstops_unreachable_total`, logged once per lost agent), and the quorum service
decides: this service reports the replica on the condition that the quorum service has not
heard from it either (`UNHEARD_QUIET_S`), again every `UNHEARD_REPORT_EVERY_S` while the agent
stays silent. A dead or blackholed host stops asking for quorums and is evicted within about a
second; behind a link cut from here alone the replica keeps asking every step and stays (its
agent still reports its own ranks' deaths to the quorum service; its incidents reach this
service once the link is back). A held verdict whose agent falls silent within the grace goes
the same way.

An agent's fail-stop whose quorum report failed is evicted from here (the central service may
reach a quorum service the agent could not), for the incarnation the agent named: a replica
back as a newer incarnation meanwhile is not evicted with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from fthsdp.services.health.client_codec import NodeState, ReportBatch, restamp
from fthsdp.services.health.config import MAX_FORWARD_INTERVAL, HealthConfig
from fthsdp.services.health.core import CoreStats, HealthCore, ReplicaView
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.quorum_reporter import QuorumReporter
from fthsdp.services.health.store import TelemetryStore
from fthsdp.services.health.telemetry import Heartbeat, Incident, IncidentKind, RankId

log = logging.getLogger(__name__)

_ALWAYS_EVICT = frozenset({IncidentKind.FAIL_STOP, IncidentKind.HANG, IncidentKind.SDC})
_SLOW = frozenset({IncidentKind.FAIL_SLOW, IncidentKind.SLOW_RANK})

AGENT_GRACE_S = 2.0
"""How long a fail-stop found here waits for the live node agent's own incident of it: the
agent's quorum report (bounded by its deadline) plus one forward, with room for a loaded host."""
AGENT_TEARDOWN_MEMORY_S = 30.0
"""How long an agent's teardown of a replica on its node explains that replica's silent ranks
there: far beyond `AGENT_GRACE_S`, far below the time a replica runs between two failures."""
_NODE_CADENCES = 3.0
"""A node agent is alive while its last node state is at most this many of its forward
intervals old (and at least `_NODE_LIVE_MIN_S`)."""
_NODE_LIVE_MIN_S = 0.3
NODE_FORGET_S = 4 * MAX_FORWARD_INTERVAL.total_seconds()
"""A node agent not heard for this long is forgotten: it no longer counts toward the interval
the others are asked for (hosts retired, a job that shrank), and should it come back, its first
node state reads as a gap in its telemetry."""
MAX_NODES = 200_000
"""Node agents tracked at most (the least recently heard goes first): a bound, whatever sends."""
UNHEARD_QUIET_S = 0.5
"""A replica behind a node agent no longer heard is evicted only once the quorum service has not
heard from it for this long either (or three of its step intervals): a blackholed host is gone
within about a second, and a replica whose link to this service alone is cut keeps asking the
quorum service every step and stays."""
UNHEARD_REPORT_EVERY_S = 0.25
"""How often that conditional report is repeated while the agent stays silent."""
UNHEARD_REPORT_FOR_S = 60.0
"""How long it is repeated at most (after that, the quorum service's own timeouts decide)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeView:
    """A node agent as the central service last heard from it."""

    node: str
    ranks: int
    last_seen: float
    dropped: int
    interval_s: float | None = None
    """The agent's forward cadence as seen here (a moving average of the gaps between its node
    states, each counted at most at twice the average; None after the first)."""


def policy_for(incident: Incident, config: DetectorConfig) -> str:
    """ "evict" or "report": what the service does about an incident."""
    if incident.kind in _ALWAYS_EVICT:
        return "evict"
    if incident.kind in _SLOW and config.fail_slow_policy == "evict":
        return "evict"
    return "report"


class CentralEngine:
    """One job's health state; all methods run on one event loop (the core is not thread-safe)."""

    def __init__(
        self,
        config: HealthConfig,
        detectors: DetectorConfig,
        store: TelemetryStore,
        metrics: HealthMetrics,
        *,
        quorum: QuorumReporter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self.core = HealthCore(detectors)
        self.store = store
        self._metrics = metrics
        self._quorum = quorum
        self._clock = clock
        self._nodes: dict[str, NodeView] = {}
        """Node agents heard, least recently heard first."""
        self._forward_interval_ms = 0
        """What agents are asked to forward at (0: their own `forward_interval`)."""
        self._agent_failstops: set[RankId] = set()
        self._held: dict[RankId, tuple[float, Incident]] = {}
        """Fail-stops found here on a live agent's node -> (when they are acted on, incident)."""
        self._lost_agents: set[str] = set()
        """Nodes whose agent fell silent with ranks behind it (logged once until heard again)."""
        self._unheard: dict[str, _Unheard] = {}
        """Replicas with silent ranks behind a lost agent, reported conditionally until the
        agent is heard again, the quorum service no longer knows them, or for a while."""
        self._agent_teardowns: dict[tuple[str, str], float] = {}
        """(replica, node) pairs an agent tore down after a fail-stop it found, and when: the
        silence of that replica's other ranks on that node is explained, and reported by the
        agent for the right incarnation. A report from here would name no incarnation, and
        evict a warm spare that took over as the next one within the grace."""
        self._task: asyncio.Task[None] | None = None
        self._actions: set[asyncio.Task[None]] = set()
        self._store_failing = False
        self._counted: dict[str, int] = {}
        """The core's cumulative drop counts already added to the metrics."""

    @property
    def detectors(self) -> DetectorConfig:
        """The detector settings in force."""
        return self.core.config

    def reconfigure(self, detectors: DetectorConfig) -> None:
        """New detector settings from now on (the HTTP settings API)."""
        self.core.reconfigure(detectors)
        log.info("detector settings changed", extra={"settings": detectors.to_dict()})

    # ---- ingest -----------------------------------------------------------------------------

    async def ingest(self, batch: ReportBatch) -> None:
        """Feeds one validated batch (times already on this host's clock)."""
        core = self.core
        for hb in batch.heartbeats:
            core.heartbeat(hb)
        if batch.node is not None:
            self._node_state(batch.node)
        if batch.steps:
            core.steps(batch.steps)
        if batch.collectives:
            core.collectives(batch.collectives)
        for fp in batch.fingerprints:
            core.fingerprint(fp)
        for rank in batch.left:
            core.rank_left(rank)
            self._agent_failstops.discard(rank)
            self._held.pop(rank, None)
        self._count(batch)
        await self._keep_records(batch)
        if batch.incidents:
            await self._agent_incidents(batch.incidents)

    def _node_state(self, state: NodeState) -> None:
        now = self._clock()
        previous = self._nodes.get(state.node)
        if state.node in self._lost_agents or (
            previous is not None and state.dropped > previous.dropped
        ):
            # Records from this node were lost (its link to here was cut, or its agent dropped
            # batches): a rank's exit from a collective may be among them, and a rank that
            # left would be judged hung. Its ranks start afresh in every open collective.
            for entry in state.ranks:
                self.core.telemetry_gap(entry.rank)
        if state.node in self._lost_agents:
            self._lost_agents.discard(state.node)
            log.info("node agent %s is heard again", state.node, extra={"node": state.node})
        for entry in state.ranks:
            self._agent_failstops.discard(entry.rank)  # it beats again
            self._held.pop(entry.rank, None)
            self.core.heartbeat(
                Heartbeat(
                    rank=entry.rank,
                    host=state.node,
                    step=entry.step,
                    at=now - entry.silent_s,
                    process=entry.process,
                )
            )
        interval = None
        if previous is not None:
            gap = max(0.0, now - previous.last_seen)
            interval = gap
            if previous.interval_s is not None:
                # A gap past twice the cadence is an outage (a cut link, a stalled agent), not
                # the cadence: counted at twice it, so one forward after a cut does not keep the
                # agent "alive" for seconds, while a cadence that really grew is followed within
                # a dozen forwards.
                interval = 0.8 * previous.interval_s + 0.2 * min(gap, 2 * previous.interval_s)
        self._nodes.pop(state.node, None)  # to the end: least recently heard first
        if previous is None and len(self._nodes) >= MAX_NODES:
            self._forget(next(iter(self._nodes)))
        self._nodes[state.node] = NodeView(
            node=state.node,
            ranks=len(state.ranks),
            last_seen=now,
            dropped=state.dropped,
            interval_s=interval,
        )
        if previous is None:
            self._metrics.nodes.set(len(self._nodes))
            self._space_forwards()

    def _forget_silent_nodes(self, now: float) -> None:
        """Forgets the node agents not heard for `NODE_FORGET_S` (the oldest come first)."""
        forgot = 0
        while self._nodes:
            node, view = next(iter(self._nodes.items()))
            if now - view.last_seen <= NODE_FORGET_S:
                break
            self._forget(node)
            forgot += 1
        if forgot:
            log.info("forgot %d node agents not heard for %.0f s", forgot, NODE_FORGET_S)
            self._metrics.nodes.set(len(self._nodes))
            self._space_forwards()

    def _forget(self, node: str) -> None:
        del self._nodes[node]
        if len(self._lost_agents) < MAX_NODES:
            self._lost_agents.add(node)  # its return reads as a telemetry gap

    def forward_interval_ms(self) -> int:
        """The interval node agents are asked to forward at, in ms (0: their own)."""
        return self._forward_interval_ms

    def _space_forwards(self) -> None:
        """More agents than this service takes forwards in one agent interval
        (`HealthConfig.ingest_forwards_per_s`): they are asked to forward less often, and the
        detectors judge fail-stops and hangs one such interval late."""
        base = self._config.forward_interval.total_seconds()
        wanted = min(
            len(self._nodes) / self._config.ingest_forwards_per_s,
            MAX_FORWARD_INTERVAL.total_seconds(),
        )
        if wanted <= base:
            self._forward_interval_ms, self.core.delivery_slack_s = 0, 0.0
            return
        if self._forward_interval_ms == 0:
            log.info(
                "%d node agents: asking them to forward every %.1f s", len(self._nodes), wanted
            )
        self._forward_interval_ms = round(wanted * 1000)
        self.core.delivery_slack_s = wanted

    def _count(self, batch: ReportBatch) -> None:
        records = self._metrics.records
        for kind, items in (
            ("heartbeat", batch.heartbeats),
            ("step", batch.steps),
            ("collective", batch.collectives),
            ("fingerprint", batch.fingerprints),
            ("left", batch.left),
        ):
            if items:
                records.labels(kind=kind).inc(len(items))

    async def _keep_records(self, batch: ReportBatch) -> None:
        await self._guard_store(self.store.add_records("steps", batch.steps))
        await self._guard_store(self.store.add_records("collectives", batch.collectives))
        await self._guard_store(self.store.add_records("fingerprints", batch.fingerprints))

    async def _agent_incidents(self, incidents: tuple[Incident, ...]) -> None:
        for incident in incidents:
            if incident.kind == IncidentKind.FAIL_STOP and incident.rank is not None:
                rank = RankId(replica_id=incident.replica_id, rank=incident.rank)
                self._agent_failstops.add(rank)
                if incident.evidence.get("action") == "kill" and incident.host is not None:
                    self._agent_teardowns[(incident.replica_id, incident.host)] = self._clock()
            self._metrics.incidents.labels(kind=incident.kind.value).inc()
        await self._guard_store(self.store.add_incidents(incidents))
        for incident in incidents:
            if incident.kind in _ALWAYS_EVICT and incident.evidence.get("quorum") == "failed":
                self._evict(incident)

    async def _guard_store(self, operation: Awaitable[None]) -> None:
        """Runs a store write; a failing store is logged once per outage, never raised into
        ingest (telemetry must not be refused because Redis is down)."""
        try:
            await operation
        except Exception as exc:
            if not self._store_failing:
                log.warning("telemetry store write failed: %s", exc)
            self._store_failing = True
        else:
            if self._store_failing:
                log.info("telemetry store writes succeed again")
            self._store_failing = False

    # ---- evaluation -------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the evaluation timer."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="health-evaluate")

    async def stop(self) -> None:
        """Stops the timer and waits for pending evictions (bounded by their deadlines)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._actions:
            await asyncio.wait(self._actions, timeout=5)

    async def _run(self) -> None:
        interval = self._config.evaluate_interval.total_seconds()
        while True:
            try:
                await self.evaluate_once()
            except Exception:
                log.exception("detector evaluation failed")
            await asyncio.sleep(interval)

    async def evaluate_once(self) -> list[Incident]:
        """One evaluation: new incidents are stored and acted on; returns them."""
        now = self._clock()
        started = time.perf_counter()
        found = self.core.evaluate(now)
        self._metrics.evaluate_seconds.observe(time.perf_counter() - started)
        self._observe(self.core.stats())
        self._forget_silent_nodes(now)
        self._report_unheard(now)
        fresh = self._release_held(now) + [
            i for i in found if not self._already_reported(i) and not self._hold(i, now)
        ]
        if not fresh:
            return []
        detectors = self.core.config
        fresh = [restamp(i, evidence=self._verdict(i, detectors)) for i in fresh]
        for incident in fresh:
            self._metrics.incidents.labels(kind=incident.kind.value).inc()
            log.warning(
                "incident: %s",
                incident.summary,
                extra={"replica_id": incident.replica_id, "rank": incident.rank},
            )
        await self._guard_store(self.store.add_incidents(fresh))
        for incident in fresh:
            if incident.evidence["policy"] == "evict":
                self._evict(incident)
        return fresh

    def _observe(self, stats: CoreStats) -> None:
        """The core's sizes into the metrics."""
        metrics = self._metrics
        metrics.collective_groups.set(stats.groups)
        metrics.open_collectives.set(stats.open_collectives)
        for reason, total in stats.groups_dropped.items():
            self._count_up(metrics.groups_dropped.labels(reason=reason), reason, total)
        self._count_up(metrics.ranks_forgotten, "ranks", stats.ranks_forgotten)

    def _count_up(self, counter: Counter, name: str, total: int) -> None:
        """Adds to `counter` what a cumulative count of the core gained since the last call."""
        new = total - self._counted.get(name, 0)
        if new > 0:
            counter.inc(new)
            self._counted[name] = total

    def _verdict(self, incident: Incident, detectors: DetectorConfig) -> dict[str, str]:
        """What the service does about `incident`, for its evidence: evict or report, and for
        a dead, hung or corrupting rank whether its replica is torn down (`failure_action`)."""
        verdict = {"policy": policy_for(incident, detectors), "found_by": "central"}
        if self._tears_down(incident):
            verdict["action"] = "kill"
        elif incident.kind in _ALWAYS_EVICT:
            verdict["action"] = "report"
        return verdict

    def _tears_down(self, incident: Incident) -> bool:
        # A dead, hung or corrupting rank takes its replica down with it; a slow one is only
        # left out (it may recover, and it holds a valid state).
        return self._config.failure_action == "kill" and incident.kind in _ALWAYS_EVICT

    def _already_reported(self, incident: Incident) -> bool:
        if incident.kind != IncidentKind.FAIL_STOP or incident.rank is None:
            return False
        return RankId(replica_id=incident.replica_id, rank=incident.rank) in self._agent_failstops

    def _hold(self, incident: Incident, now: float) -> bool:
        """Whether a fail-stop found here is not acted on now: one on a live agent's node is
        held (that agent reports it); one behind an agent no longer heard is left to the quorum
        service (module docstring). A rank with no agent is this service's alone to watch."""
        if incident.kind != IncidentKind.FAIL_STOP or incident.rank is None:
            return False
        if incident.host is None or incident.host not in self._nodes:
            return False
        if not self._agent_alive(incident.host, now):
            self._unreachable(incident)
            return True
        rank = RankId(replica_id=incident.replica_id, rank=incident.rank)
        self._held[rank] = (now + AGENT_GRACE_S, incident)
        return True

    def _release_held(self, now: float) -> list[Incident]:
        """Held fail-stops that are news after all: no agent incident came within the grace;
        those the agent reported are dropped, and so are those whose agent fell silent (left to
        the quorum service)."""
        released = []
        self._agent_teardowns = {
            key: at
            for key, at in self._agent_teardowns.items()
            if now - at < AGENT_TEARDOWN_MEMORY_S
        }
        for rank, (due, incident) in list(self._held.items()):
            torn = (incident.replica_id, incident.host or "") in self._agent_teardowns
            if rank in self._agent_failstops or torn:
                del self._held[rank]
            elif not self._agent_alive(incident.host, now):
                del self._held[rank]
                self._unreachable(incident)
            elif now >= due:
                del self._held[rank]
                released.append(incident)
        return released

    def _unreachable(self, incident: Incident) -> None:
        """A fail-stop behind a node agent no longer heard: counted, not stored, and reported
        to the quorum service only on the condition that it does not hear the replica either
        (`_report_unheard`)."""
        self._metrics.failstops_unreachable.inc()
        node = incident.host or ""
        if self._quorum is not None and incident.replica_id not in self._unheard:
            self._unheard[incident.replica_id] = _Unheard(
                node=node,
                reason=f"{incident.kind.value}: {incident.summary} (its node agent is not heard)",
                teardown=self._tears_down(incident),
                until=self._clock() + UNHEARD_REPORT_FOR_S,
            )
        if node in self._lost_agents:
            return
        self._lost_agents.add(node)
        log.warning(
            "node agent %s is not heard (host loss, or its link to this service cut): whether "
            "its ranks live is left to the quorum service's heartbeats (first: replica %s)",
            node,
            incident.replica_id,
            extra={"node": node, "replica_id": incident.replica_id, "rank": incident.rank},
        )

    def _report_unheard(self, now: float) -> None:
        """Repeats each conditional report that is due (see `UNHEARD_QUIET_S`)."""
        quorum = self._quorum
        for replica_id, entry in list(self._unheard.items()):
            if now >= entry.until or self._agent_alive(entry.node, now):
                del self._unheard[replica_id]
            elif now >= entry.next_at and not entry.reporting and quorum is not None:
                entry.next_at = now + UNHEARD_REPORT_EVERY_S
                entry.reporting = True
                self._spawn(self._report_conditionally(quorum, replica_id, entry))

    async def _report_conditionally(
        self, quorum: QuorumReporter, replica_id: str, entry: _Unheard
    ) -> None:
        try:
            outcome = await quorum.report_failure(
                replica_id,
                entry.reason,
                reporter=f"fthsdp-health:{self._config.node}",
                teardown=entry.teardown,
                unless_heard_within=UNHEARD_QUIET_S,
            )
        finally:
            entry.reporting = False
        if outcome in ("evicted", "unknown_replica") and self._unheard.get(replica_id) is entry:
            del self._unheard[replica_id]

    def _spawn(self, action: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(action)
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    def _agent_alive(self, node: str | None, now: float) -> bool:
        view = self._nodes.get(node) if node is not None else None
        if view is None:
            return False
        # The cadence it was asked for counts from the start: its own average follows a raised
        # one only over a dozen forwards.
        cadence = max(view.interval_s or 0.0, self._forward_interval_ms / 1000)
        return now - view.last_seen <= max(_NODE_LIVE_MIN_S, _NODE_CADENCES * cadence)

    def _evict(self, incident: Incident) -> None:
        if self._quorum is None:
            return
        quorum = self._quorum
        reason = f"{incident.kind.value}: {incident.summary}"
        teardown = self._tears_down(incident)
        incarnation = _incarnation(incident)

        async def act() -> None:
            await quorum.report_failure(
                incident.replica_id,
                reason,
                reporter=f"fthsdp-health:{self._config.node}",
                teardown=teardown,
                incarnation=incarnation,
            )

        self._spawn(act())

    # ---- views ------------------------------------------------------------------------------

    def now(self) -> float:
        """The engine's clock (the time every stored record is on)."""
        return self._clock()

    def replicas(self) -> list[ReplicaView]:
        """Every known replica (the core's view)."""
        return self.core.replicas()

    def nodes(self) -> list[NodeView]:
        """Every node agent heard from, sorted by name."""
        return [self._nodes[name] for name in sorted(self._nodes)]


@dataclass(kw_only=True, slots=True)
class _Unheard:
    """A replica reported conditionally while its node agent is not heard."""

    node: str
    reason: str
    teardown: bool
    until: float
    """When the reports stop (the engine's clock)."""
    next_at: float = 0.0
    """When the next one is due."""
    reporting: bool = False
    """One is in flight (the next waits for its answer)."""


def _incarnation(incident: Incident) -> int | None:
    """The incarnation an agent's incident names (its evidence is untrusted JSON); None for
    this service's own verdicts, which cannot tell one incarnation from the next."""
    value = incident.evidence.get("incarnation")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
