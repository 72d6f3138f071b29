"""Deterministic fault injection for tests and the demo: a rank dies, or stalls, at a chosen point.

`FTHSDP_FAULTS` lists faults as `replica:rank:step:point[:seconds]` separated by commas, for
example `r1:0:12:exchange` (rank 0 of replica r1 dies as step 12's exchange starts) or
`r1:0:*:slow_fetch:3` (its next catch-up fetch takes 3 s longer) or `r1:1:20:hang` (rank 1 of r1
stops making progress at step 20 while its threads beat on) or `r1:0:40:slow:10` (from step 40
on, for 10 s, rank 0 of r1 is a straggler: `SLOW_DELAY_S` late to every exchange). `step` may be
`*` (the first time the point is reached). Each fault fires once per job: a marker file in
`FTHSDP_FAULTS_DIR` records it, so the restarted replica does not die again."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POINTS = ("exchange", "fetch", "serve", "commit", "slow_fetch", "hang", "slow")
"""exchange: with the ring up, as the exchange starts (the peers are left mid-exchange);
fetch: while catching up; serve: right after publishing a snapshot for a recovering peer;
commit: after the vote, before the optimizer step; slow_fetch: the catch-up fetch is delayed by
the fault's seconds (the rank lives); hang: as the exchange starts, before the rank enters the
ring, its training thread blocks for good while its other threads (heartbeats, telemetry, the
watch) go on, so its ring peers wait on it: a rank stuck in a kernel or an unrecorded collective,
as a GPU or NCCL hang looks to the host; slow: from its step on, for the fault's seconds
(`SLOW_DEFAULT_S` when not given), the rank sleeps `SLOW_DELAY_S` before every cross-replica
exchange, as its own time (a straggler: a throttled GPU, a noisy neighbour), while it lives."""

SLOW_DELAY_S = 0.08
"""How late a `slow` rank is to each exchange. The slow-rank detector counts a rank as last only
when its peers waited at least `slow_rank_min_lag_s` (30 ms) for it; 80 ms clears that with room
for jitter on a loaded host, and stays small next to the demo's steps (tens of ms) times the 20
collectives the detector needs, so a 10 s slow period is long enough to be named."""
SLOW_DEFAULT_S = 10.0
"""How long a `slow` fault lasts when its spec gives no seconds."""
_SECONDS_POINTS = ("slow_fetch", "slow")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One planned death or delay."""

    replica_id: str
    rank: int
    step: int | None
    point: str
    seconds: float = 0.0
    """For `slow_fetch`: how long the fetch is held back; for `slow`: how long the rank stays
    slow."""

    @property
    def marker(self) -> str:
        step = "any" if self.step is None else str(self.step)
        return f"fault-{self.replica_id}-{self.rank}-{step}-{self.point}"


def parse_faults(spec: str) -> list[Fault]:
    """Parses `FTHSDP_FAULTS`; raises ValueError with the offending entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) not in (4, 5) or parts[3] not in POINTS:
            raise ValueError(
                f"bad fault {entry!r}: want replica:rank:step:point[:seconds], point in {POINTS}"
            )
        point = parts[3]
        default = SLOW_DEFAULT_S if point == "slow" else 0.0
        seconds = float(parts[4]) if len(parts) == 5 else default
        if (point in _SECONDS_POINTS) != (seconds > 0) or not seconds <= 3600:
            raise ValueError(
                f"bad fault {entry!r}: seconds in (0, 3600] go with {'/'.join(_SECONDS_POINTS)} "
                "only (and slow_fetch needs them)"
            )
        faults.append(
            Fault(
                replica_id=parts[0],
                rank=int(parts[1]),
                step=None if parts[2] == "*" else int(parts[2]),
                point=point,
                seconds=seconds,
            )
        )
    return faults


class FaultPlan:
    """The faults that concern one rank."""

    def __init__(self, faults: list[Fault], marker_dir: Path | None) -> None:
        self._faults = faults
        self._marker_dir = marker_dir
        self._slow_until = -math.inf
        """Monotonic time until which a fired `slow` fault holds this rank back."""

    @classmethod
    def from_env(cls, replica_id: str, rank: int, env: dict[str, str] | None = None) -> FaultPlan:
        environ = os.environ if env is None else env
        mine = [
            f
            for f in parse_faults(environ.get("FTHSDP_FAULTS", ""))
            if f.replica_id == replica_id and f.rank == rank
        ]
        directory = environ.get("FTHSDP_FAULTS_DIR")
        return cls(mine, Path(directory) if directory else None)

    def _due(self, point: str, step: int) -> Fault | None:
        """The planned fault at this point and step that has not fired yet (marking it fired)."""
        for fault in self._faults:
            if fault.point != point or fault.step not in (None, step):
                continue
            if self._marker_dir is not None:
                marker = self._marker_dir / fault.marker
                if marker.exists():
                    continue
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            return fault
        return None

    def hit(self, point: str, step: int) -> None:
        """Dies with SIGKILL if a fault is planned here and has not fired yet in this job."""
        if self._due(point, step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def hang(self, step: int) -> None:
        """Blocks the calling thread for good if a `hang` fault is due at this step."""
        if self._due("hang", step) is not None:
            threading.Event().wait()

    def delay(self, point: str, step: int) -> None:
        """Sleeps for a planned delay at this point (once per job)."""
        fault = self._due(point, step)
        if fault is not None:
            time.sleep(fault.seconds)

    def slow_delay(self, step: int, now: float) -> float:
        """How long to hold this rank back before the exchange of `step` at monotonic `now`:
        `SLOW_DELAY_S` from the step a `slow` fault is due at, for its seconds; else 0."""
        fault = self._due("slow", step)
        if fault is not None:
            self._slow_until = now + fault.seconds
        return SLOW_DELAY_S if now < self._slow_until else 0.0

    def slow(self, step: int) -> None:
        """Sleeps `slow_delay` (a straggler's lateness, counted as this rank's own time)."""
        delay = self.slow_delay(step, time.monotonic())
        if delay:
            time.sleep(delay)
