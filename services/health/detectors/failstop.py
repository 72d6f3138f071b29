"""Fail-stop detection: a rank whose heartbeats stop.

Used twice with the same code: by the node agent over its own ranks (ResiHP's first level, on the
ranks' own clock) and by `HealthCore` over every rank (the second level; the wire rebases beat
times onto the service clock). `check` walks every tracked rank, O(ranks) per call: at 100K ranks
that is a few milliseconds, cheaper than keeping a deadline heap current on every beat."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fthsdp.services.health.telemetry import Heartbeat, Incident, IncidentKind, RankId


@dataclass(slots=True)
class _Beat:
    host: str
    step: int
    at: float
    process: str
    reported: bool = False


class FailStopDetector:
    """Tracks the last beat of each rank; a rank silent for longer than `timeout_s` is reported
    once, and again only after it beats again and falls silent again."""

    __slots__ = ("_beats", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._beats: dict[RankId, _Beat] = {}

    def beat(self, hb: Heartbeat) -> float | None:
        """Record a sign of life. An older beat than the last one (reordered batch) is ignored.
        When the beat names a new process of a rank already tracked (it restarted), returns the
        old process's last beat time; None otherwise."""
        last = self._beats.get(hb.rank)
        if last is None:
            self._beats[hb.rank] = _Beat(hb.host, hb.step, hb.at, hb.process)
            return None
        if hb.at < last.at:
            return None
        restarted = last.at if hb.process and last.process and hb.process != last.process else None
        last.host, last.step, last.at, last.reported = (
            hb.host,
            hb.step if restarted is not None else max(last.step, hb.step),
            hb.at,
            False,
        )
        last.process = hb.process or last.process
        return restarted

    def leave(self, rank: RankId) -> None:
        """A clean exit: forget the rank, so its silence is never an incident."""
        self._beats.pop(rank, None)

    def silent(self, rank: RankId) -> bool:
        """Whether `rank` is currently reported as fail-stop."""
        beat = self._beats.get(rank)
        return beat is not None and beat.reported

    def last_beat(self, rank: RankId) -> Heartbeat | None:
        """The latest beat of `rank`, if it is tracked."""
        beat = self._beats.get(rank)
        if beat is None:
            return None
        return Heartbeat(
            rank=rank, host=beat.host, step=beat.step, at=beat.at, process=beat.process
        )

    def next_deadline(self) -> float | None:
        """When the earliest beating rank falls silent if it beats no more (None: none beats).
        A new beat only moves its rank's deadline later."""
        pending = [beat.at for beat in self._beats.values() if not beat.reported]
        return min(pending) + self.timeout_s if pending else None

    def tracked(self) -> list[RankId]:
        """Every tracked rank (beating or silent)."""
        return list(self._beats)

    def exited(self, rank: RankId, now: float, *, pid: int) -> Incident | None:
        """A fail-stop incident for `rank`, whose process `pid` was seen to exit at `now`
        (before its silence would have told); None if the rank is not tracked or is reported
        already. Reported once, as a silence is."""
        beat = self._beats.get(rank)
        if beat is None or beat.reported:
            return None
        beat.reported = True
        incident = _incident(rank, beat, now)
        return replace(
            incident,
            summary=(
                f"rank {rank.rank} of replica {rank.replica_id} on {beat.host}: its process "
                f"{pid} exited (last step {beat.step})"
            ),
            evidence=incident.evidence | {"exited_pid": pid},
        )

    def check(self, now: float) -> list[Incident]:
        """New fail-stop incidents at `now`: ranks silent for more than the timeout, and with
        each, its replica's other ranks silent for more than three quarters of it (a beating
        rank is a beat interval behind at most, a fifth of the timeout by default). Ranks that stop
        together (one killed, a sibling crashing in a collective with it) stop within a beat
        interval of each other, below what their last beats can order; and the first report
        tears the replica down, after which the others are no longer watched. So all of them
        are named, the dead one among them."""
        deadline = now - self.timeout_s
        found = []
        replicas = set()
        for rank, beat in self._beats.items():
            if beat.at < deadline and not beat.reported:
                beat.reported = True
                found.append(_incident(rank, beat, now))
                replicas.add(rank.replica_id)
        if replicas:
            nearly = now - 0.75 * self.timeout_s
            for rank, beat in self._beats.items():
                if rank.replica_id in replicas and beat.at < nearly and not beat.reported:
                    beat.reported = True
                    found.append(_incident(rank, beat, now))
        return found


def _incident(rank: RankId, beat: _Beat, now: float) -> Incident:
    silent = now - beat.at
    return Incident(
        kind=IncidentKind.FAIL_STOP,
        replica_id=rank.replica_id,
        rank=rank.rank,
        host=beat.host,
        detected_at=now,
        summary=(
            f"rank {rank.rank} of replica {rank.replica_id} on {beat.host} stopped "
            f"heartbeating {silent:.2f} s ago (last step {beat.step})"
        ),
        evidence={"last_beat_at": beat.at, "silent_s": silent, "last_step": beat.step},
    )
