"""An incremental index of collective records: who is in which group, which collectives are open,
who entered and who left each, and which rank is currently inside which collective.

Both the hang detector (a wait-for graph over the open collectives) and the slow-rank detector
(arrival order of the completed ones) read it. Every record costs O(1) dict operations; a
collective is dropped as soon as every member of its group has left it, so memory follows the
collectives in flight, not the history. A completed collective leaves behind only its arrival
summary (`Arrival`), which the slow-rank detector drains."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import CollectiveRecord, RankId

Key = tuple[str, int]
"""(group, seq): one collective."""

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

    __slots__ = ("_done", "completed", "config", "inside", "members", "open", "rank_groups")

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.members: dict[str, set[RankId]] = {}
        """Group -> the ranks ever seen in it (minus those that left cleanly)."""
        self.open: dict[str, dict[int, Instance]] = {}
        """Group -> seq -> open collective."""
        self.inside: dict[RankId, Key] = {}
        """Rank -> the open collective it most recently entered and has not left."""
        self.rank_groups: dict[RankId, set[str]] = {}
        self.completed: list[Arrival] = []
        """Arrival summaries not yet drained by the slow-rank detector."""
        self._done: dict[str, dict[int, None]] = {}

    def add(self, records: Iterable[CollectiveRecord]) -> None:
        """Index records; entry and exit may come as two records or as one."""
        for record in records:
            self._add(record)

    def _add(self, record: CollectiveRecord) -> None:
        group, seq, rank = record.group, record.seq, record.rank
        members = self.members.get(group)
        if members is None:
            members = self.members[group] = set()
            self.open[group] = {}
        if rank not in members:
            # Membership is learned from records, so the first collectives of a group may
            # complete before all members were seen; their late records still teach it.
            members.add(rank)
            self.rank_groups.setdefault(rank, set()).add(group)
        if seq in self._done.get(group, ()):
            return  # a late record of a completed collective
        inst = self.open[group].get(seq)
        if inst is None:
            inst = self.open[group][seq] = Instance(group, seq, record.op, record.started_at)
        elif record.started_at < inst.first_start:
            inst.first_start = record.started_at
        self._enter(inst, rank, record.started_at)
        if record.ended_at is not None:
            inst.left[rank] = record.ended_at
            if self.inside.get(rank) == (group, seq):
                del self.inside[rank]
        self._maybe_complete(inst)

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
                self._maybe_complete(earlier)
        self.inside[rank] = key

    def _maybe_complete(self, inst: Instance) -> None:
        if len(inst.left) < len(self.members[inst.group]):
            return
        del self.open[inst.group][inst.seq]
        done = self._done.setdefault(inst.group, {})
        done[inst.seq] = None
        if len(done) > _DONE_MEMORY:
            del done[next(iter(done))]
        self.completed.append(_arrival(inst))

    def leave(self, rank: RankId) -> None:
        """A rank exits cleanly: it is no longer a member of any group, so no collective waits on
        it (and one that only it held open completes)."""
        self.inside.pop(rank, None)
        for group in self.rank_groups.pop(rank, set()):
            self.members[group].discard(rank)
            for inst in list(self.open[group].values()):
                inst.entered.pop(rank, None)
                inst.left.pop(rank, None)
                self._maybe_complete(inst)

    def expire(self, now: float) -> None:
        """Forget open collectives older than the retention (groups of a dead quorum)."""
        horizon = now - self.config.collective_retention_s
        for group, instances in self.open.items():
            stale = [seq for seq, inst in instances.items() if inst.first_start < horizon]
            for seq in stale:
                inst = instances.pop(seq)
                for rank in inst.entered:
                    if self.inside.get(rank) == (group, seq):
                        del self.inside[rank]

    def instances(self) -> Iterator[Instance]:
        """Every open collective."""
        for instances in self.open.values():
            yield from instances.values()

    def drain(self) -> list[Arrival]:
        """The arrival summaries since the last drain."""
        completed, self.completed = self.completed, []
        return completed


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
