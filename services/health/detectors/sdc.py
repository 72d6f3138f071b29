"""Silent-data-corruption detection: healthy replicas are bitwise identical (I1), so at any step
their parameter fingerprints agree; a replica whose digest differs from a strict majority is
corrupt.

A step is judged only once `sdc_min_replicas` (>= 3) replicas reported it: with two, a mismatch
has no majority and naming either would be a coin toss. With no strict majority (2 vs 2) nobody
is named either. A corrupt replica is reported once, and again only after one of its
fingerprints agreed with the majority (it healed) and a later one disagrees.

Digests are compared per (step, quorum): after the job rolled back to a durable checkpoint, a
step is trained again in a newer quorum, with other members, and its new digests say nothing
about the old ones (comparing them named a healthy replica corrupt, and tore it down)."""

from __future__ import annotations

from collections import Counter

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Fingerprint, Incident, IncidentKind


class SdcDetector:
    """Fingerprints of the most recent steps; incidents on transitions."""

    __slots__ = ("_dirty", "_reported", "_steps", "config")

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self._steps: dict[tuple[int, int], dict[str, str]] = {}
        """(step, quorum id) -> replica -> digest."""
        self._dirty: set[tuple[int, int]] = set()
        self._reported: set[str] = set()

    def add(self, fp: Fingerprint) -> None:
        """A replica's digest at a step (a later one for the same step replaces it)."""
        newest = max((step for step, _ in self._steps), default=None)
        if newest is not None and fp.step <= newest - self.config.sdc_window_steps:
            return  # older than anything still judged
        key = (fp.step, fp.quorum_id)
        self._steps.setdefault(key, {})[fp.replica_id] = fp.digest
        self._dirty.add(key)
        while len(self._steps) > self.config.sdc_window_steps:
            oldest = min(self._steps)
            del self._steps[oldest]
            self._dirty.discard(oldest)

    def suspect(self, replica_id: str) -> bool:
        """Whether the replica's latest judged fingerprint disagreed with the majority."""
        return replica_id in self._reported

    def check(self, now: float) -> list[Incident]:
        """New SDC incidents from the steps that received fingerprints since the last call."""
        found = []
        for key in sorted(self._dirty):
            digests = self._steps[key]
            if len(digests) < self.config.sdc_min_replicas:
                continue  # keep it dirty: more replicas may report it
            self._dirty.discard(key)
            found += self._judge(key[0], digests, now)
        return found

    def _judge(self, step: int, digests: dict[str, str], now: float) -> list[Incident]:
        majority, agree = Counter(digests.values()).most_common(1)[0]
        if 2 * agree <= len(digests):
            return []  # no strict majority: nobody can be named
        found = []
        for replica_id, digest in sorted(digests.items()):
            if digest == majority:
                self._reported.discard(replica_id)
            elif replica_id not in self._reported:
                self._reported.add(replica_id)
                found.append(_incident(replica_id, step, digest, majority, agree, digests, now))
        return found


def _incident(
    replica_id: str,
    step: int,
    digest: str,
    majority: str,
    agree: int,
    digests: dict[str, str],
    now: float,
) -> Incident:
    return Incident(
        kind=IncidentKind.SDC,
        replica_id=replica_id,
        detected_at=now,
        summary=(
            f"replica {replica_id}'s parameter fingerprint at step {step} differs from the one "
            f"{agree} of {len(digests)} replicas agree on: silent data corruption"
        ),
        evidence={
            "step": step,
            "digest": digest,
            "majority_digest": majority,
            "agreeing": agree,
            "reporting": len(digests),
            "disagreeing": sorted(r for r, d in digests.items() if d != majority),
        },
    )
