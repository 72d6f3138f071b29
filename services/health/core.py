"""Pure health logic: ingest telemetry, run the detectors, keep a per-replica view.

No I/O, no clock: `evaluate(now)` takes the time, and record times are on the same clock (the
wire rebases each batch onto the service's clock). Ingest is incremental (each record updates
small indexes; nothing rescans history), so `evaluate` costs O(collectives older than the hang
timeout and still judged + tracked ranks), which is what makes root-cause analysis of a hang at
100K ranks sub-second.

Incidents are raised on transitions: each detector reports a condition once, and again only after
it cleared and came back. `evaluate` returns what is new since its last call; incidents the
wire already holds are never repeated. A rank already reported fail-stop is not reported again as
the culprit of the hang its death causes (the fail-stop incident says it first and better), and a
rank that restarted (a heartbeat names a new process) leaves every collective its old process was
inside, so a death shorter than the heartbeat timeout is not mistaken for a hang either. A rank
named as the culprit of a hang still open is not named again for another collective: that is the
same hang seen from elsewhere.

Memory follows the live job: a rank that is gone (reported fail-stop, or never heartbeating) and
sent nothing for `collective_retention_s` (or the heartbeat timeout, if longer) is forgotten by
every detector, as if it had left; a replica goes with its last rank. Incidents are the wire's
to keep, and are not touched."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fthsdp.services.health.detectors.collectives import CollectiveIndex
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import FailSlowDetector, Judgement
from fthsdp.services.health.detectors.failstop import FailStopDetector
from fthsdp.services.health.detectors.hang import Hang, find_hangs
from fthsdp.services.health.detectors.links import LinkDetector
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

_SWEEPS_PER_HORIZON = 8
"""Gone ranks are looked for this often per retention: one is forgotten after 1 to 1 1/8
retentions of silence, for an O(ranks) walk every eighth of a retention: not every evaluation,
and not a time-ordered index touched by every record (measured: 30% of the ingest rate)."""


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
    fail_slow: Judgement = "warming_up"
    """What the fail-slow detector can say of it: "warming_up" (fitting its predictor, also
    after a restart), "recovering" (the job is: a replica down, restarting or warming up, or
    settling after that; silent), "no_peers" (no other replica judged over the same time: it
    cannot tell this one's slowdown from the machine's, and stays silent), "judging",
    "slow"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CoreStats:
    """Sizes of the core's state, for the metrics."""

    replicas: int
    """Replicas heard from and not forgotten."""
    groups: int
    """Collective groups tracked."""
    open_collectives: int
    """Open collectives tracked."""
    groups_dropped: Mapping[str, int]
    """Since the start, by why: "rank_bound" (a rank past collective_groups_per_rank left its
    least recent group), "total_bound" (collective_groups_total reached), "idle" (a group with
    no record for collective_retention_s)."""
    ranks_forgotten: int
    """Since the start: gone ranks forgotten after the retention."""
    hang_visits: int
    """Since the start: open collectives the hang check looked at (the ripe ones it was handed
    on each evaluation): what the evaluations cost, in collectives."""


@dataclass(slots=True)
class _Replica:
    ranks: dict[int, float] = field(default_factory=dict)
    """Rank -> when it last sent anything (the core's clock: the latest evaluation's time)."""
    last_step: int = -1
    last_seen: float | None = None
    down: set[int] = field(default_factory=set)
    """Ranks named by a fail-stop or hang incident (cleared when they beat or progress)."""
    suspect: set[IncidentKind] = field(default_factory=set)


class HealthCore:
    """Every detector over one job's telemetry. Not thread-safe: the wire calls it from one
    event loop (or under one lock)."""

    __slots__ = (
        "_clock",
        "_collectives",
        "_config",
        "_failslow",
        "_failstop",
        "_forgotten_ranks",
        "_hung_ranks",
        "_links",
        "_named",
        "_next_sweep",
        "_replicas",
        "_restarted_at",
        "_sdc",
        "_slowrank",
        "delivery_slack_s",
    )

    def __init__(self, config: DetectorConfig) -> None:
        self._config = config
        self.delivery_slack_s = 0.0
        """How late a rank's records may arrive (its node agent forwards them at an interval
        central set): fail-stops and hangs are judged as of that long ago, so a record still
        on its way never reads as a silence or as a collective not entered."""
        self._failstop = FailStopDetector(config.heartbeat_timeout_s)
        self._collectives = CollectiveIndex(config)
        self._slowrank = SlowRankDetector(self._collectives, config)
        self._failslow = FailSlowDetector(config)
        self._links = LinkDetector(config)
        self._sdc = SdcDetector(config)
        self._named: dict[tuple[str, int], set[RankId]] = {}
        """Open collectives (group, seq) whose culprit a past evaluation named -> the culprits
        whose verdict stands (a rank of -1: the collective itself is stuck). What such a
        collective shows later (members torn down, the others giving up at different moments)
        is the aftermath of that verdict, not a new hang. Kept current without a walk: the
        index names the ones that closed, and a verdict is cleared when the collective was
        judged again and the culprit not found."""
        self._hung_ranks: dict[RankId, int] = {}
        """Culprit rank -> in how many of `_named`'s standing verdicts."""
        self._replicas: dict[str, _Replica] = {}
        self._restarted_at: dict[RankId, float] = {}
        """Restarted rank -> its old process's last beat (records older than that are stale)."""
        self._clock = -math.inf
        """The latest `evaluate` time: what ingest stamps a rank's receipt time with."""
        self._next_sweep = -math.inf
        """When `_forget_gone` looks for gone ranks next."""
        self._forgotten_ranks = 0

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
        self._links.config = config
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
            # Its first steps (catch-up, a cold allocator) are not its speed: warm up again.
            self._failslow.forget(hb.rank.replica_id)
            self._links.forget(hb.rank.replica_id)
            self._hold(hb.at + self._config.fail_slow_settle_s)
        replica = self._replica(hb.rank)
        replica.last_step = max(replica.last_step, hb.step)
        replica.last_seen = hb.at if replica.last_seen is None else max(replica.last_seen, hb.at)
        if not self._failstop.silent(hb.rank) and not self._in_hang(hb.rank):
            replica.down.discard(hb.rank.rank)

    def steps(self, records: Sequence[StepRecord]) -> None:
        """Step records (any order, any mix of ranks); a restarted rank's old process's late
        ones are dropped, as in `collectives`."""
        fresh = []
        for record in records:
            cutoff = self._restarted_at.get(record.rank)
            if cutoff is not None and record.started_at <= cutoff:
                continue
            replica = self._replica(record.rank)
            replica.last_step = max(replica.last_step, record.step)
            fresh.append(record)
        self._failslow.add(fresh)

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
        self._links.add(fresh)

    def fingerprint(self, fp: Fingerprint) -> None:
        """A replica's parameter digest at a step."""
        self._sdc.add(fp)

    def telemetry_gap(self, rank: RankId) -> None:
        """Some of the rank's records were lost on the way (its node agent dropped them): it is
        taken out of every collective it is still open in, as a restarted rank is, since its
        exit may be what was lost. Its next records enter it again; a hang that began in the
        gap is found from those (its peers waiting on it in the next collective)."""
        self._collectives.leave(rank)

    def rank_left(self, rank: RankId) -> None:
        """A clean exit: the rank is forgotten by every detector; its silence is no incident."""
        self._hold(self._clock + self._config.fail_slow_settle_s)
        self._failstop.leave(rank)
        self._collectives.leave(rank)
        self._restarted_at.pop(rank, None)
        replica = self._replicas.get(rank.replica_id)
        if replica is None:
            return
        replica.ranks.pop(rank.rank, None)
        replica.down.discard(rank.rank)
        if not replica.ranks:
            del self._replicas[rank.replica_id]
            self._failslow.forget(rank.replica_id)
            self._links.forget(rank.replica_id)

    # ---- decisions ------------------------------------------------------------------------

    def evaluate(self, now: float) -> list[Incident]:
        """Incidents that became true since the last call, fail-stop first. A detector that
        fails is logged and skipped: it never takes another one's verdict with it."""
        self._clock = max(self._clock, now)
        found: list[Incident] = []
        judged = now - self.delivery_slack_s
        for name, check, at in (
            ("fail-stop", self._failstop.check, judged),
            ("hang", self._new_hangs, judged),
            ("slow-rank", self._slowrank.check, now),
            ("fail-slow", self._failslow.check, now),
            ("slow-link", self._links.check, now),
            ("sdc", self._sdc.check, now),
        ):
            try:
                found += check(at)
            except Exception:
                log.exception("the %s detector failed", name)
        self._mark(found)
        if any(replica.down for replica in self._replicas.values()):
            # The job recovers: nobody's speed is their own until it settled (FailSlowDetector).
            self._hold(now + self._config.fail_slow_settle_s)
        found = [self._with_host(incident) for incident in found]
        try:  # after the verdicts: a rank they name keeps its host and marks
            self._prune(now)
        except Exception:
            log.exception("pruning the detectors' state failed")
        return found

    def stats(self) -> CoreStats:
        """The sizes of the state, O(1)."""
        index = self._collectives
        return CoreStats(
            replicas=len(self._replicas),
            groups=len(index.members),
            open_collectives=len(index.ages),
            groups_dropped=dict(index.dropped),
            ranks_forgotten=self._forgotten_ranks,
            hang_visits=index.ages.visited,
        )

    def replicas(self) -> list[ReplicaView]:
        """Every known replica, sorted by id."""
        return [self._view(rid, rep) for rid, rep in sorted(self._replicas.items())]

    # ---- helpers --------------------------------------------------------------------------

    def _hold(self, until: float) -> None:
        """The job recovers until `until`: nobody's speed, nor any link's, is judged before."""
        self._failslow.hold(until)
        self._links.hold(until)

    def _replica(self, rank: RankId) -> _Replica:
        replica = self._replicas.get(rank.replica_id)
        if replica is None:
            replica = self._replicas[rank.replica_id] = _Replica()
        replica.ranks[rank.rank] = self._clock
        return replica

    def _prune(self, now: float) -> None:
        """What is dead: old collectives, idle groups (and their slow-rank windows), gone ranks."""
        self._collectives.expire(now)
        self._slowrank.forget_groups()
        self._forget_gone(now)

    def _forget_gone(self, now: float) -> None:
        """Ranks gone and silent past the retention are forgotten, as if they had left."""
        if now < self._next_sweep:
            return
        span = max(self._config.collective_retention_s, self._config.heartbeat_timeout_s)
        self._next_sweep = now + span / _SWEEPS_PER_HORIZON
        gone = []
        for replica_id, replica in self._replicas.items():
            for number, at in replica.ranks.items():
                if at == -math.inf:
                    replica.ranks[number] = now  # heard before the first evaluation
                elif at < now - span:
                    rank = RankId(replica_id=replica_id, rank=number)
                    if not self._beating(rank):
                        gone.append(rank)
        for rank in gone:
            self.rank_left(rank)
        self._forgotten_ranks += len(gone)

    def _beating(self, rank: RankId) -> bool:
        """Not reported fail-stop although silent by our clock: its beats are dated in the
        future by its own (the fail-stop detector decides, not this sweep)."""
        return self._failstop.last_beat(rank) is not None and not self._failstop.silent(rank)

    def _new_hangs(self, now: float) -> list[Incident]:
        """Hang culprits not yet reported, skipping ranks already reported as fail-stop or as
        the culprit of a hang still open. Every collective a judged culprit blocks is settled:
        the hang check does not resolve it again until a record changes it."""
        hangs = find_hangs(self._collectives, now)
        ages = self._collectives.ages
        for leaf in ages.drain_gone():
            for rank in self._named.pop(leaf, ()):
                self._unhang(rank)
        current = {_hang_key(hang.incident) for hang in hangs}
        for leaf in ages.taken:  # judged again: a verdict not found again is cleared
            standing = self._named.get(leaf)
            if not standing:
                continue
            for rank in [r for r in standing if (r, *leaf) not in current]:
                standing.discard(rank)
                self._unhang(rank)
        return [incident for hang in hangs if (incident := self._judge(hang)) is not None]

    def _judge(self, hang: Hang) -> Incident | None:
        """The hang's incident if it is news; settles what it blocks either way."""
        ages = self._collectives.ages
        for blocked in hang.blocked:
            ages.settle(blocked)
        incident = hang.incident
        rank, group, seq = _hang_key(incident)
        if (group, seq) in self._named:
            return None
        seen_elsewhere = rank in self._hung_ranks
        self._named[(group, seq)] = {rank}
        ages.watch((group, seq))
        if rank.rank >= 0:
            self._hung_ranks[rank] = self._hung_ranks.get(rank, 0) + 1
        if seen_elsewhere:
            return None  # the same culprit, seen from another collective it blocks
        if incident.rank is not None and self._failstop.silent(rank):
            return None
        return incident

    def _unhang(self, rank: RankId) -> None:
        count = self._hung_ranks.get(rank, 0)
        if count > 1:
            self._hung_ranks[rank] = count - 1
        else:
            self._hung_ranks.pop(rank, None)

    def _in_hang(self, rank: RankId) -> bool:
        return rank in self._hung_ranks

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
            fail_slow=self._failslow.judgement(replica_id),
        )

    def _active_suspicion(self, replica_id: str, replica: _Replica) -> bool:
        """Whether a slow-rank, fail-slow or SDC condition on the replica is still unresolved."""
        active = {
            IncidentKind.SLOW_RANK: self._slowrank.suspects(replica_id),
            IncidentKind.FAIL_SLOW: self._failslow.suspect(replica_id)
            or self._links.suspect(replica_id),
            IncidentKind.SDC: self._sdc.suspect(replica_id),
        }
        replica.suspect = {kind for kind in replica.suspect if active[kind]}
        return bool(replica.suspect)


def _hang_key(incident: Incident) -> tuple[RankId, str, int]:
    rank = RankId(
        replica_id=incident.replica_id, rank=-1 if incident.rank is None else incident.rank
    )
    return rank, str(incident.evidence.get("group", "")), int(incident.evidence.get("seq", -1))
