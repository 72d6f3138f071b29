"""Deterministic fault injection for tests and the demo: a rank dies, or stalls, at a chosen point.

`FTHSDP_FAULTS` lists faults as `replica:rank:step:point[:seconds]` separated by commas, for
example `r1:0:12:exchange` (rank 0 of replica r1 dies as step 12's exchange starts) or
`r1:0:*:slow_fetch:3` (its next catch-up fetch takes 3 s longer) or `r1:1:20:hang` (rank 1 of r1
stops making progress at step 20 while its threads beat on). `step` may be `*` (the first
time the point is reached). Each fault fires once per job: a marker file in `FTHSDP_FAULTS_DIR`
records it, so the restarted replica does not die again."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POINTS = ("exchange", "fetch", "serve", "commit", "slow_fetch", "hang")
"""exchange: with the ring up, as the exchange starts (the peers are left mid-exchange);
fetch: while catching up; serve: right after publishing a snapshot for a recovering peer;
commit: after the vote, before the optimizer step; slow_fetch: the catch-up fetch is delayed by
the fault's seconds (the rank lives); hang: as the exchange starts, before the rank enters the
ring, its training thread blocks for good while its other threads (heartbeats, telemetry, the
watch) go on, so its ring peers wait on it: a rank stuck in a kernel or an unrecorded collective,
as a GPU or NCCL hang looks to the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One planned death or delay."""

    replica_id: str
    rank: int
    step: int | None
    point: str
    seconds: float = 0.0
    """For `slow_fetch`: how long the fetch is held back."""

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
        seconds = float(parts[4]) if len(parts) == 5 else 0.0
        if (parts[3] == "slow_fetch") != (seconds > 0) or not seconds <= 3600:
            raise ValueError(f"bad fault {entry!r}: seconds in (0, 3600] go with slow_fetch only")
        faults.append(
            Fault(
                replica_id=parts[0],
                rank=int(parts[1]),
                step=None if parts[2] == "*" else int(parts[2]),
                point=parts[3],
                seconds=seconds,
            )
        )
    return faults


class FaultPlan:
    """The faults that concern one rank."""

    def __init__(self, faults: list[Fault], marker_dir: Path | None) -> None:
        self._faults = faults
        self._marker_dir = marker_dir

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
