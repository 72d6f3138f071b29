"""An incremental index of collective records: who is in which group, which collectives are open,
who entered and who left each, and which rank is currently inside which collective.

Both the hang detector (a wait-for graph over the open collectives) and the slow-rank detector
(arrival order of the completed ones) read it. Every record costs O(1) dict operations; a
collective is dropped as soon as every member of its group has left it, so memory follows the
collectives in flight, not the history. A completed collective leaves behind only its arrival
summary (`Arrival`), which the slow-rank detector drains.

Groups are bounded, because every record may name a new one: per rank
(`collective_groups_per_rank`; past it the rank's least recently recorded group loses it) and in
all (`collective_groups_total`; past it the least recently recorded group is forgotten). A group
that received no record for `collective_retention_s` is forgotten with everything it holds. Times
of receipt are the index's clock (the latest `expire(now)`), not the records' own times: a
sender's clock must not keep a group alive."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fthsdp.services.health.detectors.ages import AgeQueue, Key
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import CollectiveRecord, RankId

__all__ = ["Arrival", "CollectiveIndex", "Instance", "Key"]

log = logging.getLogger(__name__)

_DONE_MEMORY = 256  # completed seqs remembered per group, to drop late duplicate records


@dataclass(slots=True)
class Instance:
    """One open collective."""

    group: str
    seq: int
    op: str
    first_start: float
    """The earliest entry of any member (its age is what makes it a hang)."""
    entered: dict[RankId, float] = field(default_factory=dict)
    """Rank -> when it entered."""
    left: dict[RankId, float] = field(default_factory=dict)
    """Rank -> when it left."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """The arrival summary of a completed collective: who arrived last and by how much."""

    group: str
    seq: int
    last: RankId | None
    """The rank that spent the least time inside (it arrived last: the others waited for it);
    None when the group has fewer than two members."""
    lag_s: float
    """How much less time `last` spent inside than the next-shortest member: how long the others
    waited for it. Durations are measured on each rank's own clock, so skew between hosts
    does not enter."""
    replica_id: str | None
    """The replica when every member of the group belongs to it (an intra-replica group)."""


class CollectiveIndex:
    """See the module docstring. Mutated by `add`, `leave` and `expire`; read by the detectors."""

    __slots__ = (
        "_clock",
        "_done",
        "_forgotten",
        "_seen",
        "ages",
        "completed",
        "config",
        "dropped",
        "inside",
        "members",
        "open",
        "rank_groups",
    )

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.members: dict[str, set[RankId]] = {}
        """Group -> the ranks ever seen in it (minus those that left cleanly)."""
        self.open: dict[str, dict[int, Instance]] = {}
        """Group -> seq -> open collective."""
        self.ages = AgeQueue()
        """The open collectives by age (what the hang check looks at)."""
        self.inside: dict[RankId, Key] = {}
        """Rank -> the open collective it most recently entered and has not left."""
        self.rank_groups: dict[RankId, dict[str, None]] = {}
        """Rank -> its groups, in the order it joined them."""
        self.completed: list[Arrival] = []
        """Arrival summaries not yet drained by the slow-rank detector."""
        self.dropped: dict[str, int] = {"rank_bound": 0, "total_bound": 0, "idle": 0}
        """Groups dropped since the start, by why: "rank_bound" (a rank past
        collective_groups_per_rank left one, forgotten if that rank was its only member),
        "total_bound" (forgotten at collective_groups_total), "idle" (forgotten after
        collective_retention_s without a record)."""
        self._done: dict[str, dict[int, None]] = {}
        self._seen: OrderedDict[str, float] = OrderedDict()
        """Group -> when it last received a record, least recent first."""
        self._clock = -math.inf
        """The latest `expire` time: receipt times before the first one are stamped by it."""
        self._forgotten: list[str] = []
        """Groups forgotten since the last `drain_forgotten`."""

    def add(self, records: Iterable[CollectiveRecord]) -> None:
        """Index records; entry and exit may come as two records or as one."""
        for record in records:
            self._add(record)

    def _add(self, record: CollectiveRecord) -> None:
        group, seq, rank = record.group, record.seq, record.rank
        members = self.members.get(group)
        if members is None:
            members = self._new_group(group)
        # Most records cost one lookup for the bounds: the group is already stamped with the
        # current time (`_seen` is in time order, so it stays where it is).
        if self._seen.get(group) != self._clock:
            self._seen[group] = self._clock
            self._seen.move_to_end(group)
        if rank not in members:
            self._join(group, rank)
        if seq in self._done.get(group, ()):
            return  # a late record of a completed collective
        key = (group, seq)
        inst = self.open[group].get(seq)
        if inst is None:
            inst = self.open[group][seq] = Instance(group, seq, record.op, record.started_at)
            self.ages.opened(key, record.started_at)
        else:
            if record.started_at < inst.first_start:
                inst.first_start = record.started_at
                self.ages.earlier(key, record.started_at)
            if self.ages.settled or self.ages.idle:
                self.ages.touched(key)
        self._enter(inst, rank, record.started_at)
        if record.ended_at is not None:
            inst.left[rank] = record.ended_at
            if self.inside.get(rank) == key:
                del self.inside[rank]
        self._maybe_complete(inst)

    def _new_group(self, group: str) -> set[RankId]:
        while len(self.members) >= self.config.collective_groups_total:
            oldest = next(iter(self._seen))
            if not self.dropped["total_bound"]:
                log.warning(
                    "tracking collective_groups_total=%d collective groups: forgetting the "
                    "least recently recorded ones (logged once)",
                    self.config.collective_groups_total,
                    extra={"group": oldest},
                )
            self.dropped["total_bound"] += 1
            self._forget(oldest)
        self.open[group] = {}
        members = self.members[group] = set()
        return members

    def _join(self, group: str, rank: RankId) -> None:
        """The rank is a member of the group (past its bound, it leaves its least recently
        recorded one). Membership is learned from records, so the first collectives of a group
        may complete before all members were seen; their late records still teach it."""
        self.members[group].add(rank)
        groups = self.rank_groups.get(rank)
        if groups is None:
            groups = self.rank_groups[rank] = {}
        groups[group] = None
        while len(groups) > self.config.collective_groups_per_rank:
            # The first least recent in membership order: the oldest of a flood in one batch.
            self._over_rank_bound(rank, min(groups, key=self._seen.__getitem__))

    def _over_rank_bound(self, rank: RankId, group: str) -> None:
        if not self.dropped["rank_bound"]:
            log.warning(
                "rank %d of replica %s is in more than collective_groups_per_rank=%d groups: "
                "it leaves its least recently recorded ones (logged once)",
                rank.rank,
                rank.replica_id,
                self.config.collective_groups_per_rank,
                extra={"replica_id": rank.replica_id, "rank": rank.rank, "group": group},
            )
        self.dropped["rank_bound"] += 1
        if self.members[group] == {rank}:
            self._forget(group)  # nobody else is in it: nothing is left to complete
        else:
            self._leave_group(rank, group)

    def _enter(self, inst: Instance, rank: RankId, started_at: float) -> None:
        inst.entered.setdefault(rank, started_at)
        previous = self.inside.get(rank)
        key = (inst.group, inst.seq)
        if previous is not None and previous[0] == inst.group and previous[1] < inst.seq:
            # Collectives of a group are issued in order: entering a later one means the rank
            # left the earlier one even if that exit record was lost or is still in flight.
            earlier = self.open[inst.group].get(previous[1])
            if earlier is not None:
                earlier.left.setdefault(rank, started_at)
                self.ages.touched(previous)
                self._maybe_complete(earlier)
        self.inside[rank] = key

    def _maybe_complete(self, inst: Instance) -> None:
        if len(inst.left) < len(self.members[inst.group]):
            return
        del self.open[inst.group][inst.seq]
        self.ages.closed((inst.group, inst.seq))
        done = self._done.setdefault(inst.group, {})
        done[inst.seq] = None
        if len(done) > _DONE_MEMORY:
            del done[next(iter(done))]
        self.completed.append(_arrival(inst))

    def leave(self, rank: RankId) -> None:
        """A rank exits cleanly: it is no longer a member of any group, so no collective waits on
        it (and one that only it held open completes)."""
        self.inside.pop(rank, None)
        for group in list(self.rank_groups.get(rank, ())):
            self._leave_group(rank, group)
        self.rank_groups.pop(rank, None)

    def _leave_group(self, rank: RankId, group: str) -> None:
        """`rank` is no longer a member of `group`."""
        self._unlink(rank, group)
        self.members[group].discard(rank)
        for inst in list(self.open[group].values()):
            inst.entered.pop(rank, None)
            inst.left.pop(rank, None)
            self.ages.touched((group, inst.seq))
            self._maybe_complete(inst)

    def _unlink(self, rank: RankId, group: str) -> None:
        """Drops `group` from the rank's own indexes (its groups, where it is inside)."""
        groups = self.rank_groups.get(rank)
        if groups is not None:
            groups.pop(group, None)
            if not groups:
                del self.rank_groups[rank]
        where = self.inside.get(rank)
        if where is not None and where[0] == group:
            del self.inside[rank]

    def expire(self, now: float) -> None:
        """Forget open collectives older than the retention (groups of a dead quorum), and the
        groups that received no record for as long."""
        if self._clock == -math.inf:
            for group in self._seen:  # once: what came before the first evaluation
                self._seen[group] = now
        self._clock = max(self._clock, now)
        horizon = now - self.config.collective_retention_s
        self.ages.ripen(now - self.config.hang_timeout_s)
        for group, seq in self.ages.expired(horizon):
            inst = self.open[group].pop(seq)
            for rank in inst.entered:
                if self.inside.get(rank) == (group, seq):
                    del self.inside[rank]
        seen = self._seen
        while seen:
            group, at = next(iter(seen.items()))
            if at >= horizon:
                break
            self.dropped["idle"] += 1
            self._forget(group)

    def _forget(self, group: str) -> None:
        """The group and everything it holds (by now, dead collectives of an old quorum)."""
        for rank in self.members.pop(group):
            self._unlink(rank, group)
        for seq in self.open.pop(group):
            self.ages.closed((group, seq))
        self._done.pop(group, None)
        self._seen.pop(group, None)
        self._forgotten.append(group)

    def ripe(self, now: float) -> list[Instance]:
        """The open collectives that came of age (older than the hang timeout) and are neither
        settled nor idle: what one hang check resolves."""
        self.ages.ripen(now - self.config.hang_timeout_s)
        return [self.open[group][seq] for group, seq in self.ages.take_ripe()]

    def instances(self) -> Iterator[Instance]:
        """Every open collective."""
        for instances in self.open.values():
            yield from instances.values()

    def drain(self) -> list[Arrival]:
        """The arrival summaries since the last drain."""
        completed, self.completed = self.completed, []
        return completed

    def drain_forgotten(self) -> list[str]:
        """The groups forgotten since the last call."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten


def _arrival(inst: Instance) -> Arrival:
    """Who spent the least time inside, and the gap to the next-shortest."""
    first: tuple[float, RankId] | None = None
    second = float("inf")
    replicas = set()
    for rank, left_at in inst.left.items():
        replicas.add(rank.replica_id)
        inside = left_at - inst.entered.get(rank, left_at)
        if first is None or inside < first[0]:
            if first is not None:
                second = first[0]
            first = (inside, rank)
        elif inside < second:
            second = inside
    local = next(iter(replicas)) if len(replicas) == 1 else None
    if first is None or second == float("inf"):
        return Arrival(inst.group, inst.seq, None, 0.0, local)
    return Arrival(inst.group, inst.seq, first[1], second - first[0], local)
