"""Slow links: a replica whose ring links carry its exchanges many times slower than the job's
other links do.

A slow link slows every replica alike, since they all meet in the ring. The fail-slow detector
cannot see it: it compares each replica's own time (waiting on the exchange subtracted) with
its peers', and no replica computes any slower. Links are judged instead by what the ranks
measure on them. Each ring exchange's exit carries the bytes a rank received from its left
neighbour and the time those payloads took to arrive once their header had (`InboundLink`):
about zero on a healthy link, whatever the sender's or receiver's speed, and nearly the whole
transfer behind a slow one.

A link is (sender replica -> receiver replica), every rank's ring merged; it is measured by the
median time per byte and per exchange over its last `fail_slow_persist_steps` exchanges. A host
whose network is slow slows both of its replica's ring links, the one in and the one out, and
leaves the links that do not touch it alone. So a replica is named when both of its links take
more than `slow_link_ratio` times the median time per byte of the links that do not touch it,
and at least `slow_link_min_busy_s` per exchange (below that, scheduling jitter on a healthy
link). Nobody is named for one slow direction alone: the sender's egress and the receiver's
ingress look the same. Nor in a ring of two replicas, where no link leaves both alone.

The incident is a fail-slow one (`fail_slow_policy` applies), with the links in its evidence. A
named replica is named again only after its links were healthy in between. Nothing is judged on
exchanges that ended while the job recovered (`hold`), when catch-up transfers share the links."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import CollectiveRecord, Incident, IncidentKind

__all__ = ["LinkDetector"]

STALE_S = 60.0
"""A link without an exchange for this long left the ring (a ring exchanges every step): it is
dropped, and no longer counts among the others."""

Link = tuple[str, str]
"""(sender replica, receiver replica)."""


@dataclass(slots=True)
class _Samples:
    """A link's most recent exchanges: (bytes, busy seconds) each."""

    window: deque[tuple[int, float]]
    last_at: float = -math.inf
    """When its latest exchange ended (the service's clock)."""


@dataclass(frozen=True, slots=True)
class _Measure:
    seconds_per_byte: float
    busy_s: float


@dataclass(slots=True)
class LinkDetector:
    """Judges ring links by the exchanges ranks report (see the module doc). Not thread-safe."""

    config: DetectorConfig
    _links: dict[Link, _Samples] = field(default_factory=dict)
    _named: set[str] = field(default_factory=set)
    _quiet_until: float = -math.inf

    def hold(self, until: float) -> None:
        """Judge no exchange that ends before `until` (the job is recovering)."""
        self._quiet_until = max(self._quiet_until, until)

    def forget(self, replica_id: str) -> None:
        """Drop the links of a replica that left or restarted."""
        for link in [link for link in self._links if replica_id in link]:
            del self._links[link]
        self._named.discard(replica_id)

    def suspect(self, replica_id: str) -> bool:
        """Whether the replica is named and its links are still slow."""
        return replica_id in self._named

    def add(self, records: Iterable[CollectiveRecord]) -> None:
        """Collective records; only exits of ring exchanges that carry an inbound link count."""
        window = self.config.fail_slow_persist_steps
        for record in records:
            inbound = record.inbound
            if inbound is None or record.ended_at is None or inbound.bytes <= 0:
                continue
            if record.ended_at < self._quiet_until:
                continue
            link = (inbound.sender_replica, record.rank.replica_id)
            if link[0] == link[1]:
                continue  # a ring never sends a replica's bytes to itself
            samples = self._links.get(link)
            if samples is None or samples.window.maxlen != window:
                old = samples.window if samples is not None else ()
                samples = self._links[link] = _Samples(deque(old, maxlen=window))
            samples.window.append((inbound.bytes, inbound.busy_s))
            samples.last_at = max(samples.last_at, record.ended_at)

    def check(self, now: float) -> list[Incident]:
        """Fail-slow incidents for replicas newly found behind slow links."""
        for link in [k for k, s in self._links.items() if s.last_at < now - STALE_S]:
            del self._links[link]
        measures = self._measures()
        culprits = {
            replica: verdict
            for replica in {r for link in measures for r in link}
            if (verdict := self._behind_slow_links(replica, measures)) is not None
        }
        self._named &= culprits.keys()
        found = []
        for replica in sorted(culprits.keys() - self._named):
            self._named.add(replica)
            found.append(self._incident(replica, *culprits[replica], now))
        return found

    def _measures(self) -> dict[Link, _Measure]:
        """Each link with a full window: its median time per byte and per exchange."""
        full = self.config.fail_slow_persist_steps
        return {
            link: _Measure(
                seconds_per_byte=median(busy / size for size, busy in s.window),
                busy_s=median(busy for _, busy in s.window),
            )
            for link, s in self._links.items()
            if len(s.window) >= full
        }

    def _behind_slow_links(
        self, replica: str, measures: dict[Link, _Measure]
    ) -> tuple[dict[Link, _Measure], float] | None:
        """The replica's links in and out and the other links' median time per byte, when both
        of its own are slow against that median; else None."""
        cfg = self.config
        mine = {link: m for link, m in measures.items() if replica in link}
        others = [m.seconds_per_byte for link, m in measures.items() if replica not in link]
        if (
            not others
            or not any(r == replica for _, r in mine)
            or not any(s == replica for s, _ in mine)
        ):
            return None
        baseline = median(others)
        for m in mine.values():
            if m.busy_s < cfg.slow_link_min_busy_s or m.seconds_per_byte <= (
                cfg.slow_link_ratio * baseline
            ):
                return None
        return mine, baseline

    def _incident(
        self, culprit: str, mine: dict[Link, _Measure], baseline: float, now: float
    ) -> Incident:
        links: dict[str, Any] = {
            f"{s}->{r}": {"mb_per_s": _mb_per_s(m.seconds_per_byte), "busy_s": m.busy_s}
            for (s, r), m in sorted(mine.items())
        }
        described = " and ".join(f"{k} at {v['mb_per_s']:.1f} MB/s" for k, v in links.items())
        return Incident(
            kind=IncidentKind.FAIL_SLOW,
            replica_id=culprit,
            detected_at=now,
            # A host too starved of CPU to move its bytes slows its links too: say both.
            summary=(
                f"replica {culprit} is fail-slow on its ring links ({described}; the job's "
                f"other links {_mb_per_s(baseline):.1f} MB/s): a slow network, or a host too "
                "starved to move its bytes"
            ),
            evidence={
                "source": "links",
                "links": links,
                "others_mb_per_s": _mb_per_s(baseline),
                "ratio": self.config.slow_link_ratio,
                "min_busy_s": self.config.slow_link_min_busy_s,
                "exchanges": self.config.fail_slow_persist_steps,
                "policy": self.config.fail_slow_policy,
            },
        )


def _mb_per_s(seconds_per_byte: float) -> float:
    """MB/s, capped (a payload already buffered may measure 0 s; evidence is JSON)."""
    return 1e-6 / max(seconds_per_byte, 1e-15)
