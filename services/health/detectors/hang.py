"""Hang root-cause analysis: a wait-for graph over the open collectives.

The method of the FT-HSDP paper (section 2.3): first a graph of collectives (which collective waits
on which), whose leaf is the collective that blocks the job; then inside the leaf, the ranks that
are waited for. Here an open collective C older than the hang timeout waits on each member of its
group that never entered it. Such a member m is either inside another open collective C' (then
C waits on C': follow the edge) or inside none (m is computing, or hung there: m is a culprit of
C, which is a leaf). When every member entered C and some left but others never did, those are
the culprits (they are stuck inside a collective the others finished). When every member is
inside and none left, the collective itself is stuck (the network): no rank can be named.

Cost: one pass over the ripe collectives (`CollectiveIndex.ripe`: older than the hang timeout,
neither part of a named hang nor found idle), each resolved once (memoised), each costing O(its
group's members); at 12 x 8192 ranks that is ~8K small rings plus one 8K-rank group. Young ones
are never visited (they wait in a heap by first entry), and neither are the ones the core settled
after naming their culprit, nor the idle ones (nobody inside), until a record changes them. So
when nothing changed, an evaluation costs only the old collectives still waiting on a young one
(for at most one hang timeout), not every open one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fthsdp.services.health.detectors.collectives import CollectiveIndex, Instance, Key
from fthsdp.services.health.telemetry import Incident, IncidentKind, RankId


@dataclass(slots=True)
class _Culprit:
    rank: RankId | None
    leaf: Instance
    reason: str
    """"never_entered", "never_left", "deadlock" or "collective_stuck"."""
    blocked: set[Key] = field(default_factory=set)
    """Stale collectives whose wait-for chain ends at this culprit."""


class _Graph:
    """One resolution pass: memoised culprits per collective."""

    def __init__(self, index: CollectiveIndex, now: float) -> None:
        self.index = index
        self.horizon = now - index.config.hang_timeout_s
        self.memo: dict[Key, list[tuple[RankId | None, Key, str]]] = {}
        self.stack: set[Key] = set()

    def resolve(self, inst: Instance) -> list[tuple[RankId | None, Key, str]]:
        """The culprits that `inst` ultimately waits on: (rank, leaf collective, reason)."""
        key = (inst.group, inst.seq)
        if key in self.memo:
            return self.memo[key]
        self.stack.add(key)
        found = self._resolve(inst, key)
        self.stack.discard(key)
        self.memo[key] = found
        return found

    def _resolve(self, inst: Instance, key: Key) -> list[tuple[RankId | None, Key, str]]:
        members = self.index.members[inst.group]
        missing = members - inst.entered.keys()
        if not missing:
            return self._inside_leaf(inst, key, members)
        found: list[tuple[RankId | None, Key, str]] = []
        for rank in sorted(missing, key=_order):
            where = self.index.inside.get(rank)
            if where is None:
                if inst.first_start <= self.horizon:  # a young leaf names nobody yet
                    found.append((rank, key, "never_entered"))
            elif where in self.stack:
                found.append((rank, key, "deadlock"))
            else:
                nxt = self.index.open[where[0]].get(where[1])
                if nxt is not None:
                    found.extend(self.resolve(nxt))
        return found

    def _inside_leaf(
        self, inst: Instance, key: Key, members: set[RankId]
    ) -> list[tuple[RankId | None, Key, str]]:
        if inst.first_start > self.horizon:
            return []
        stuck = sorted((r for r in inst.entered if r not in inst.left), key=_order)
        if inst.left:
            return [(rank, key, "never_left") for rank in stuck]
        return [(None, key, "collective_stuck")]


@dataclass(frozen=True, slots=True)
class Hang:
    """One culprit of the ripe collectives."""

    incident: Incident
    blocked: frozenset[Key]
    """The ripe collectives whose wait-for chain ends at this culprit (its leaf among them when
    the leaf is ripe): the core settles them once it judged the culprit."""


def find_hangs(index: CollectiveIndex, now: float) -> list[Hang]:
    """One hang per culprit of the ripe collectives (open longer than the hang timeout, see the
    module docstring). A ripe collective nobody is inside is set to rest (idle)."""
    graph = _Graph(index, now)
    culprits: dict[tuple[RankId | None, Key], _Culprit] = {}
    for inst in index.ripe(now):
        if inst.first_start > graph.horizon:
            continue  # the hang timeout was raised since it ripened
        if not _someone_waits(inst):
            index.ages.rest((inst.group, inst.seq))
            continue
        for rank, leaf_key, reason in graph.resolve(inst):
            leaf = index.open[leaf_key[0]][leaf_key[1]]
            culprit = culprits.setdefault((rank, leaf_key), _Culprit(rank, leaf, reason))
            culprit.blocked.add((inst.group, inst.seq))
    return [
        Hang(_incident(c, index, now), frozenset(c.blocked))
        for c in _best_per_rank(culprits.values())
    ]


def _someone_waits(inst: Instance) -> bool:
    """Whether a rank is inside the collective now. One that every entrant has left (they
    finished, or gave up and went on to a new ring after a failure) blocks nobody, whoever
    never entered it."""
    return any(rank not in inst.left for rank in inst.entered)


def _best_per_rank(culprits: Iterable[_Culprit]) -> list[_Culprit]:
    """One leaf per culprit rank: the one that blocks the most collectives (a rank that never
    entered its intra-replica collective also never entered its ring; the intra one is where
    its replica waits, and through it every ring waits, so that is the one to name)."""
    best: dict[RankId | Key | None, _Culprit] = {}
    merged: dict[RankId | Key | None, set[Key]] = {}
    for culprit in culprits:
        slot: RankId | Key | None = culprit.rank
        if culprit.rank is None:
            slot = (culprit.leaf.group, culprit.leaf.seq)
        merged.setdefault(slot, set()).update(culprit.blocked)
        held = best.get(slot)
        if held is None or _weight(culprit) > _weight(held):
            best[slot] = culprit
    for slot, culprit in best.items():
        culprit.blocked = merged[slot]
    return list(best.values())


def _weight(culprit: _Culprit) -> tuple[int, int]:
    return len(culprit.blocked), len(culprit.leaf.entered)


def _incident(culprit: _Culprit, index: CollectiveIndex, now: float) -> Incident:
    leaf = culprit.leaf
    age = now - leaf.first_start
    waiting = sum(len(index.open[g][s].entered) for g, s in culprit.blocked if s in index.open[g])
    members = len(index.members[leaf.group])
    evidence = {
        "group": leaf.group,
        "seq": leaf.seq,
        "op": leaf.op,
        "reason": culprit.reason,
        "open_since": leaf.first_start,
        "open_s": age,
        "members": members,
        "entered": len(leaf.entered),
        "left": len(leaf.left),
        "blocked_collectives": len(culprit.blocked),
        "waiting_ranks": waiting,
    }
    what = f"{leaf.op} #{leaf.seq} of group {leaf.group}"
    tail = f"open {age:.1f} s; {waiting} ranks in {len(culprit.blocked)} collectives wait on it"
    if culprit.rank is None:
        replicas = {r.replica_id for r in index.members[leaf.group]}
        return Incident(
            kind=IncidentKind.HANG,
            replica_id=next(iter(replicas)) if len(replicas) == 1 else "",
            detected_at=now,
            summary=f"all {members} members entered {what} and none left: the collective "
            f"itself is stuck ({tail})",
            evidence=evidence,
        )
    verb = {
        "never_entered": "never entered",
        "never_left": "never left (the others finished)",
        "deadlock": "waits in a cycle and never entered",
    }[culprit.reason]
    rank = culprit.rank
    return Incident(
        kind=IncidentKind.HANG,
        replica_id=rank.replica_id,
        rank=rank.rank,
        detected_at=now,
        summary=f"rank {rank.rank} of replica {rank.replica_id} {verb} {what} ({tail})",
        evidence=evidence,
    )


def _order(rank: RankId) -> tuple[str, int]:
    return rank.replica_id, rank.rank
