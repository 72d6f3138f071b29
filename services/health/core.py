"""Pure health logic: ingest telemetry, run the detectors, keep a per-replica view.

No I/O, no clock: `evaluate(now)` takes the time, and record times are on the same clock (the
wire rebases each batch onto the service's clock). Ingest is incremental (each record updates
small indexes; nothing rescans history), so `evaluate` costs O(open collectives + tracked ranks),
which is what makes root-cause analysis of a hang at 100K ranks sub-second.

Incidents are raised on transitions: each detector reports a condition once, and again only after
it cleared and came back. `evaluate` returns what is new since its last call; incidents the
wire already holds are never repeated. A rank already reported fail-stop is not reported again as
the culprit of the hang its death causes (the fail-stop incident says it first and better), and a
rank that restarted (a heartbeat names a new process) leaves every collective its old process was
inside, so a death shorter than the heartbeat timeout is not mistaken for a hang either."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from fthsdp.services.health.detectors.collectives import CollectiveIndex
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import FailSlowDetector
from fthsdp.services.health.detectors.failstop import FailStopDetector
from fthsdp.services.health.detectors.hang import find_hangs
from fthsdp.services.health.detectors.sdc import SdcDetector
from fthsdp.services.health.detectors.slowrank import SlowRankDetector
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    Heartbeat,
    Incident,
    IncidentKind,
    RankId,
    StepRecord,
)

ReplicaState = Literal["healthy", "suspect", "down"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaView:
    """What the dashboard and the HTTP API show for one replica."""

    replica_id: str
    ranks: int
    """How many of its ranks are known (heartbeats or telemetry seen, not left)."""
    hosts: tuple[str, ...]
    """Hosts its ranks beat from, sorted."""
    last_step: int
    """The highest step any of its ranks reported (-1 before the first)."""
    state: ReplicaState
    """"down": a rank is fail-stop or the culprit of a hang; "suspect": an unresolved slow-rank,
    fail-slow or SDC incident names it; "healthy" otherwise."""
    last_seen: float | None
    """The latest heartbeat of any of its ranks (None when only telemetry was seen)."""


@dataclass(slots=True)
class _Replica:
    ranks: set[int] = field(default_factory=set)
    last_step: int = -1
    last_seen: float | None = None
    down: set[int] = field(default_factory=set)
    """Ranks named by a fail-stop or hang incident (cleared when they beat or progress)."""
    suspect: set[IncidentKind] = field(default_factory=set)


class HealthCore:
    """Every detector over one job's telemetry. Not thread-safe: the wire calls it from one
    event loop (or under one lock)."""

    __slots__ = (
        "_collectives",
        "_config",
        "_failslow",
        "_failstop",
        "_hang_reported",
        "_hung_collectives",
        "_replicas",
        "_restarted_at",
        "_sdc",
        "_slowrank",
    )

    def __init__(self, config: DetectorConfig) -> None:
        self._config = config
        self._failstop = FailStopDetector(config.heartbeat_timeout_s)
        self._collectives = CollectiveIndex(config)
        self._slowrank = SlowRankDetector(self._collectives, config)
        self._failslow = FailSlowDetector(config)
        self._sdc = SdcDetector(config)
        self._hang_reported: set[tuple[RankId, str, int]] = set()
        self._hung_collectives: set[tuple[str, int]] = set()
        """Open collectives (group, seq) whose culprit a past evaluation named: what they show
        later (members torn down, the others giving up at different moments) is the aftermath
        of that verdict, not a new hang."""
        self._replicas: dict[str, _Replica] = {}
        self._restarted_at: dict[RankId, float] = {}
        """Restarted rank -> its old process's last beat (records older than that are stale)."""

    @property
    def config(self) -> DetectorConfig:
        """The settings in force."""
        return self._config

    def reconfigure(self, config: DetectorConfig) -> None:
        """New settings from now on; what was learned (fits, windows, open collectives) is kept."""
        self._config = config
        self._failstop.timeout_s = config.heartbeat_timeout_s
        self._collectives.config = config
        self._slowrank.reconfigure(config)
        self._failslow.reconfigure(config)
        self._sdc.config = config

    # ---- ingest ---------------------------------------------------------------------------

    def heartbeat(self, hb: Heartbeat) -> None:
        """A rank's heartbeat (also clears its fail-stop mark once it beats again). From a new
        process of the rank, it also closes whatever the old process had entered: a dead
        process waits for nothing and holds nobody up, so it is never the culprit of a hang
        (its death is the fail-stop detector's to report, or the supervisor's)."""
        old_process_last_beat = self._failstop.beat(hb)
        if old_process_last_beat is not None:
            self._collectives.leave(hb.rank)
            self._restarted_at[hb.rank] = old_process_last_beat
        replica = self._replica(hb.rank)
        replica.last_step = max(replica.last_step, hb.step)
        replica.last_seen = hb.at if replica.last_seen is None else max(replica.last_seen, hb.at)
        if not self._failstop.silent(hb.rank) and not self._in_hang(hb.rank):
            replica.down.discard(hb.rank.rank)

    def steps(self, records: Sequence[StepRecord]) -> None:
        """Step records (any order, any mix of ranks)."""
        for record in records:
            replica = self._replica(record.rank)
            replica.last_step = max(replica.last_step, record.step)
        self._failslow.add(records)

    def collectives(self, records: Sequence[CollectiveRecord]) -> None:
        """Collective records: an entry (ended_at None) then an exit, or one record for both.
        Records a restarted rank's old process made before its last heartbeat, arriving late
        (a node agent's backlog), are dropped: that process is gone."""
        fresh = []
        for record in records:
            cutoff = self._restarted_at.get(record.rank)
            if cutoff is not None and record.started_at <= cutoff:
                continue
            self._replica(record.rank)
            fresh.append(record)
        self._collectives.add(fresh)

    def fingerprint(self, fp: Fingerprint) -> None:
        """A replica's parameter digest at a step."""
        self._sdc.add(fp)

    def rank_left(self, rank: RankId) -> None:
        """A clean exit: the rank is forgotten by every detector; its silence is no incident."""
        self._failstop.leave(rank)
        self._collectives.leave(rank)
        self._restarted_at.pop(rank, None)
        replica = self._replicas.get(rank.replica_id)
        if replica is None:
            return
        replica.ranks.discard(rank.rank)
        replica.down.discard(rank.rank)
        if not replica.ranks:
            del self._replicas[rank.replica_id]
            self._failslow.forget(rank.replica_id)

    # ---- decisions ------------------------------------------------------------------------

    def evaluate(self, now: float) -> list[Incident]:
        """Incidents that became true since the last call, fail-stop first. A detector that
        fails is logged and skipped: it never takes another one's verdict with it."""
        found: list[Incident] = []
        for name, check in (
            ("fail-stop", self._failstop.check),
            ("hang", self._new_hangs),
            ("slow-rank", self._slowrank.check),
            ("fail-slow", self._failslow.check),
            ("sdc", self._sdc.check),
        ):
            try:
                found += check(now)
            except Exception:
                log.exception("the %s detector failed", name)
        self._collectives.expire(now)
        self._mark(found)
        return [self._with_host(incident) for incident in found]

    def replicas(self) -> list[ReplicaView]:
        """Every known replica, sorted by id."""
        return [self._view(rid, rep) for rid, rep in sorted(self._replicas.items())]

    # ---- helpers --------------------------------------------------------------------------

    def _replica(self, rank: RankId) -> _Replica:
        replica = self._replicas.get(rank.replica_id)
        if replica is None:
            replica = self._replicas[rank.replica_id] = _Replica()
        replica.ranks.add(rank.rank)
        return replica

    def _new_hangs(self, now: float) -> list[Incident]:
        """Hang culprits not yet reported, skipping ranks already reported as fail-stop."""
        current = find_hangs(self._collectives, now)
        keys = {_hang_key(i) for i in current}
        self._hang_reported &= keys  # a resolved hang may be reported again if it recurs
        still_open = self._collectives.open
        named = {c for c in self._hung_collectives if c[1] in still_open.get(c[0], ())}
        self._hung_collectives = set(named)
        fresh = []
        for incident in current:
            key = _hang_key(incident)
            if key in self._hang_reported or key[1:] in named:
                continue
            self._hang_reported.add(key)
            self._hung_collectives.add(key[1:])
            if incident.rank is not None and self._failstop.silent(
                RankId(replica_id=incident.replica_id, rank=incident.rank)
            ):
                continue
            fresh.append(incident)
        return fresh

    def _in_hang(self, rank: RankId) -> bool:
        return any(key[0] == rank for key in self._hang_reported)

    def _mark(self, incidents: list[Incident]) -> None:
        for incident in incidents:
            replica = self._replicas.get(incident.replica_id)
            if replica is None:
                continue
            if incident.kind in (IncidentKind.FAIL_STOP, IncidentKind.HANG):
                if incident.rank is not None:
                    replica.down.add(incident.rank)
            else:
                replica.suspect.add(incident.kind)

    def _with_host(self, incident: Incident) -> Incident:
        """The culprit's host from its last heartbeat, when the detector could not know it."""
        if incident.host is not None or incident.rank is None:
            return incident
        beat = self._failstop.last_beat(RankId(replica_id=incident.replica_id, rank=incident.rank))
        if beat is None:
            return incident
        return Incident(
            kind=incident.kind,
            replica_id=incident.replica_id,
            rank=incident.rank,
            host=beat.host,
            detected_at=incident.detected_at,
            summary=incident.summary,
            evidence=incident.evidence,
        )

    def _view(self, replica_id: str, replica: _Replica) -> ReplicaView:
        hosts = set()
        for rank in replica.ranks:
            beat = self._failstop.last_beat(RankId(replica_id=replica_id, rank=rank))
            if beat is not None:
                hosts.add(beat.host)
        suspect = self._active_suspicion(replica_id, replica)
        state: ReplicaState = "down" if replica.down else "suspect" if suspect else "healthy"
        return ReplicaView(
            replica_id=replica_id,
            ranks=len(replica.ranks),
            hosts=tuple(sorted(hosts)),
            last_step=replica.last_step,
            state=state,
            last_seen=replica.last_seen,
        )

    def _active_suspicion(self, replica_id: str, replica: _Replica) -> bool:
        """Whether a slow-rank, fail-slow or SDC condition on the replica is still unresolved."""
        active = {
            IncidentKind.SLOW_RANK: self._slowrank.suspects(replica_id),
            IncidentKind.FAIL_SLOW: self._failslow.suspect(replica_id),
            IncidentKind.SDC: self._sdc.suspect(replica_id),
        }
        replica.suspect = {kind for kind in replica.suspect if active[kind]}
        return bool(replica.suspect)


def _hang_key(incident: Incident) -> tuple[RankId, str, int]:
    rank = RankId(
        replica_id=incident.replica_id, rank=-1 if incident.rank is None else incident.rank
    )
    return rank, str(incident.evidence.get("group", "")), int(incident.evidence.get("seq", -1))
