"""Slow-rank detection: per-collective arrival analysis (FT-HSDP section 2.3).

In every completed collective, the rank that spent the least time inside arrived last: the
others waited for it. A rank that arrives last, by more than a minimum lag, in most of the last K
collectives of its group is a straggler. Durations are each rank's own clock, so host clock skew
never enters.

Attribution across groups: a slow rank r of replica R arrives last in R's intra-replica group,
and then the whole of R arrives last in every cross-replica ring, so ring analysis alone would
name every rank of R. Per replica, therefore: a candidate from an intra-replica group wins; else
a single candidate rank is named; else (several of R's ranks each last in their own ring, none
last inside R) the replica as a whole is late and is named without a rank."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from statistics import median

from fthsdp.services.health.detectors.collectives import Arrival, CollectiveIndex
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Incident, IncidentKind, RankId


@dataclass(frozen=True, slots=True)
class _Candidate:
    rank: RankId
    group: str
    last_count: int
    window: int
    lag_s: float
    local: bool


class SlowRankDetector:
    """Sliding windows of last arrivers per group; incidents on transitions."""

    __slots__ = ("_candidates", "_config", "_index", "_local", "_reported", "_windows")

    def __init__(self, index: CollectiveIndex, config: DetectorConfig) -> None:
        self._index = index
        self._config = config
        self._windows: dict[str, deque[tuple[RankId | None, float]]] = {}
        self._local: dict[str, str | None] = {}
        self._candidates: dict[str, _Candidate] = {}
        self._reported: set[tuple[str, int | None]] = set()

    def reconfigure(self, config: DetectorConfig) -> None:
        """New window sizes keep the most recent arrivals."""
        self._config = config
        for group, window in self._windows.items():
            self._windows[group] = deque(window, maxlen=config.slow_rank_window)

    def suspects(self, replica_id: str) -> bool:
        """Whether a slow-rank condition on the replica is still active."""
        return any(rid == replica_id for rid, _ in self._reported)

    def forget_groups(self) -> None:
        """Drops the windows of the groups the index forgot."""
        for group in self._index.drain_forgotten():
            self._windows.pop(group, None)
            self._local.pop(group, None)
            self._candidates.pop(group, None)

    def check(self, now: float) -> list[Incident]:
        """New slow-rank incidents from the collectives completed since the last call."""
        self.forget_groups()
        touched = self._absorb(self._index.drain())
        for group in touched:
            self._judge(group)
        active = self._attribute()
        fresh = {key: cands for key, cands in active.items() if key not in self._reported}
        self._reported = set(active)  # a cleared condition may be reported again
        return [_incident(key, cands, now) for key, cands in fresh.items()]

    def _absorb(self, arrivals: list[Arrival]) -> set[str]:
        touched = set()
        for arrival in arrivals:
            if arrival.group not in self._index.members:
                continue  # completed as its group was forgotten: nothing to judge it with
            window = self._windows.get(arrival.group)
            if window is None:
                window = self._windows[arrival.group] = deque(maxlen=self._config.slow_rank_window)
            late = arrival.last if arrival.lag_s >= self._config.slow_rank_min_lag_s else None
            window.append((late, arrival.lag_s))
            self._local[arrival.group] = arrival.replica_id
            touched.add(arrival.group)
        return touched

    def _judge(self, group: str) -> None:
        """The group's candidate, if one rank is last often enough."""
        window = self._windows[group]
        self._candidates.pop(group, None)
        if len(window) < self._config.slow_rank_min_samples:
            return
        counts = Counter(rank for rank, _ in window if rank is not None)
        if not counts:
            return
        rank, count = counts.most_common(1)[0]
        if count < self._config.slow_rank_min_fraction * len(window):
            return
        lag = median(lag for r, lag in window if r == rank)
        local = self._local.get(group) is not None
        self._candidates[group] = _Candidate(rank, group, count, len(window), lag, local)

    def _attribute(self) -> dict[tuple[str, int | None], list[_Candidate]]:
        """Culprit (replica, rank or None) -> the candidates that point at it."""
        by_replica: dict[str, list[_Candidate]] = {}
        for cand in self._candidates.values():
            by_replica.setdefault(cand.rank.replica_id, []).append(cand)
        out: dict[tuple[str, int | None], list[_Candidate]] = {}
        for replica_id, cands in by_replica.items():
            local = [c for c in cands if c.local]
            ranks = {c.rank.rank for c in cands}
            if local:
                for cand in local:
                    out.setdefault((replica_id, cand.rank.rank), []).append(cand)
            elif len(ranks) == 1:
                out[(replica_id, ranks.pop())] = cands
            else:
                out[(replica_id, None)] = cands
        return out


def _incident(key: tuple[str, int | None], cands: list[_Candidate], now: float) -> Incident:
    replica_id, rank = key
    cands = sorted(cands, key=lambda c: c.group)
    lag = median(c.lag_s for c in cands)
    head = cands[0]
    evidence = {
        "groups": [c.group for c in cands],
        "last_count": [c.last_count for c in cands],
        "window": head.window,
        "median_lag_s": lag,
    }
    if rank is None:
        summary = (
            f"replica {replica_id} arrives last in {len(cands)} cross-replica groups "
            f"(by {lag * 1000:.0f} ms median); no single rank inside it is last"
        )
    else:
        summary = (
            f"rank {rank} of replica {replica_id} arrived last in {head.last_count} of the "
            f"last {head.window} collectives of {head.group} (others waited {lag * 1000:.0f} ms)"
        )
    return Incident(
        kind=IncidentKind.SLOW_RANK,
        replica_id=replica_id,
        rank=rank,
        detected_at=now,
        summary=summary,
        evidence=evidence,
    )
