"""Emulated ranks: the telemetry of an R x W job without compute, on a virtual clock.

The FT-HSDP paper tests its control plane at 100K GPUs by emulating training on CPUs; this does
the same for the health service. Each step, every rank of every replica:
  * computes for αN + βΣl² seconds (with noise), N a fixed token budget per rank and Σl² from the
    current data phase (variable-length documents: phases of short or long sequences);
  * joins `intra` collectives of its replica's group ("replica:<id>"), each completing when its
    last member arrived;
  * joins its cross-replica FTAR ring ("ftar:<quorum_id>:<rank>"), completing when rank i of
    every replica arrived;
  * reports a StepRecord (with the time it waited on the ring), a Heartbeat, and (per replica)
    a parameter Fingerprint.
Faults (`Fault`) are injected at a step: kill (the rank never enters its next collective and
stops beating), hang (same, but it keeps beating), slow rank (it arrives late by `delay_s` at each
intra collective), fail-slow (a replica's compute is `factor` times slower), SDC (a replica's
digest differs). A kill or hang blocks the job: later `step()` calls only advance the clock and
beat (`idle`). Records go to a sink `(now, records)`; `core_sink` feeds a HealthCore directly,
and the same records can be sent to the gRPC ingest."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    Heartbeat,
    Incident,
    RankId,
    StepRecord,
)

Record = Heartbeat | StepRecord | CollectiveRecord | Fingerprint
Sink = Callable[[float, Sequence[Record]], None]
"""Receives each batch of records with the virtual time at which it is delivered."""


class FaultKind(enum.StrEnum):
    """What the emulator can break."""

    KILL = "kill"
    HANG = "hang"
    SLOW_RANK = "slow_rank"
    FAIL_SLOW = "fail_slow"
    SDC = "sdc"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One injected fault, active from `step` on."""

    kind: FaultKind
    replica: int
    rank: int = 0
    """The culprit rank (kill, hang, slow rank); ignored for replica-wide faults."""
    step: int
    delay_s: float = 0.1
    """Slow rank: how late it arrives at each intra-replica collective."""
    factor: float = 1.5
    """Fail-slow: the replica's compute time multiplier."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """The emulated model and data: per-rank step time αN + βΣl² + fixed costs."""

    tokens: int = 16384
    """N: the per-rank token budget of a step (sequences are packed up to it)."""
    alpha_s: float = 2e-5
    """Seconds per token (MLP and projections)."""
    beta_s: float = 1e-8
    """Seconds per unit of Σl² (attention)."""
    noise: float = 0.01
    """Relative standard deviation of a rank's compute time."""
    variable: bool = True
    """Variable-length data: phases whose mean document length ranges over 256..8192 tokens
    (Σl² and so step time change by up to ~5x with no fault). False: a steady 2048."""
    rank_spread: float = 0.05
    """Relative spread of Σl² between the ranks of a step (a loader that balances Σl² across
    ranks, as long-context trainers do); the phases above vary it far more between steps."""
    mean_phase_steps: float = 60.0
    """Mean length of a data phase, in steps."""
    comm_s: float = 0.005
    """Time of an intra-replica collective once everyone arrived."""
    ring_s: float = 0.02
    """Time of the cross-replica exchange once everyone arrived."""
    optimizer_s: float = 0.03
    """Optimizer step after the exchange."""


class EmulatedJob:
    """An R x W job; see the module docstring."""

    def __init__(
        self,
        *,
        replicas: int,
        ranks: int,
        sink: Sink,
        seed: int = 0,
        workload: Workload | None = None,
        faults: Sequence[Fault] = (),
        intra: int = 2,
        start: float = 1000.0,
        quorum_id: int = 1,
        ranks_per_host: int = 8,
        first_replica: int = 0,
    ) -> None:
        """`first_replica`: index of this job's first replica name, so that several emulators
        (one per node agent) can report disjoint replicas of one job."""
        self.replicas, self.ranks, self.intra = replicas, ranks, intra
        self.sink = sink
        self.workload = workload or Workload()
        self.faults = tuple(faults)
        self.now = start
        self.step_number = 0
        self.blocked = False
        self.quorum_id = quorum_id
        self.names = [replica_name(first_replica + r) for r in range(replicas)]
        self._rng = np.random.default_rng(seed)
        self._phase_len, self._phase_left = 2048.0, 0
        self.ids = [
            RankId(replica_id=self.names[r], rank=i) for r in range(replicas) for i in range(ranks)
        ]
        self.hosts = [
            f"host-{first_replica + r:03d}-{i // ranks_per_host}"
            for r in range(replicas)
            for i in range(ranks)
        ]
        self._dead: set[int] = set()  # flat indices that stopped beating

    # ---- public -----------------------------------------------------------------------------

    def run(self, steps: int) -> None:
        """`steps` calls of `step`."""
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        """One training step (or, once blocked, one second of heartbeats)."""
        if self.blocked:
            self.idle(1.0)
            return
        n = self.step_number
        tokens, sq = self._workload()
        compute = self._compute(n, tokens, sq)
        records: list[Record] = []
        leave = self._intra(n, compute, records)
        if self.blocked:
            self._emit_blocked(leave, records)
            return
        self._finish(n, tokens, sq, leave, records)

    def idle(self, seconds: float, every_s: float = 0.25) -> None:
        """Advance the clock; every live rank beats every `every_s` (a hung rank too)."""
        end = self.now + seconds
        while self.now + every_s <= end + 1e-9:
            self.now += every_s
            beats = [self._beat(k, self.step_number - 1, self.now) for k in self._live()]
            self.sink(self.now, beats)
        self.now = end

    def culprit(self, fault: Fault) -> RankId:
        """The RankId a fault names."""
        return RankId(replica_id=self.names[fault.replica], rank=fault.rank)

    # ---- model ------------------------------------------------------------------------------

    def _workload(self) -> tuple[int, np.ndarray]:
        """N and per-rank Σl² for this step: packed documents of the phase's mean length."""
        w = self.workload
        if w.variable and self._phase_left <= 0:
            self._phase_len = float(2 ** self._rng.uniform(8, 13))
            self._phase_left = int(self._rng.geometric(1.0 / w.mean_phase_steps))
        self._phase_left -= 1
        shape = (self.replicas, self.ranks)
        length = self._phase_len * self._rng.lognormal(0.0, w.rank_spread, shape)
        return w.tokens, (w.tokens * np.minimum(length, w.tokens)).astype(np.int64)

    def _compute(self, n: int, tokens: int, sq: np.ndarray) -> np.ndarray:
        w = self.workload
        base = w.alpha_s * tokens + w.beta_s * sq
        noisy = base * (1.0 + w.noise * self._rng.standard_normal(sq.shape))
        for fault in self._active(n, FaultKind.FAIL_SLOW):
            noisy[fault.replica] *= fault.factor
        return np.maximum(noisy, 1e-4)

    def _active(self, n: int, kind: FaultKind) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.step <= n]

    def _jitter(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._rng.uniform(0.0, 0.002, shape)

    def _intra(self, n: int, compute: np.ndarray, records: list[Record]) -> np.ndarray:
        """The intra-replica collectives; returns when each rank left the last one (inf: never)."""
        w = self.workload
        start = np.full(self.replicas, self.now)
        leave = np.empty_like(compute)
        stopped = np.zeros(compute.shape, dtype=bool)
        for m in range(self.intra):
            arrive = start[:, None] + compute / self.intra + self._jitter(compute.shape)
            for fault in self._active(n, FaultKind.SLOW_RANK):
                arrive[fault.replica, fault.rank] += fault.delay_s
            for fault in self._stoppers(n, m):
                stopped[fault.replica, fault.rank] = True
                self.blocked = True
            arrive[stopped] = np.inf
            done = arrive.max(axis=1) + w.comm_s
            leave = done[:, None] + self._jitter(compute.shape)
            op = "allgather" if m % 2 == 0 else "reduce_scatter"
            self._collectives(
                records,
                arrive,
                leave,
                lambda r, i: f"replica:{self.names[r]}",
                n * self.intra + m,
                op,
            )
            start = leave.max(axis=1)
            if self.blocked:
                break
        return leave

    def _stoppers(self, n: int, m: int) -> list[Fault]:
        """Kill/hang faults that stop their rank before intra collective m of step n."""
        found = []
        for fault in self.faults:
            if fault.kind in (FaultKind.KILL, FaultKind.HANG) and fault.step == n and m == 0:
                found.append(fault)
                if fault.kind == FaultKind.KILL:
                    self._dead.add(fault.replica * self.ranks + fault.rank)
        return found

    def _collectives(
        self,
        records: list[Record],
        arrive: np.ndarray,
        leave: np.ndarray,
        group: Callable[[int, int], str],
        seq: int,
        op: str,
    ) -> None:
        """Records of one collective per group: entered (finite arrival), left if it completed."""
        for r in range(self.replicas):
            for i in range(self.ranks):
                entered = float(arrive[r, i])
                if entered == np.inf:
                    continue
                left = float(leave[r, i])
                records.append(
                    CollectiveRecord(
                        rank=self.ids[r * self.ranks + i],
                        group=group(r, i),
                        seq=seq,
                        op=op,
                        started_at=entered,
                        ended_at=None if left == np.inf else left,
                    )
                )

    def _ring(
        self, n: int, leave: np.ndarray, records: list[Record]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The cross-replica exchange: arrival and completion per rank."""
        arrive = leave + self._jitter(leave.shape)
        done = arrive.max(axis=0) + self.workload.ring_s
        exit_ = np.broadcast_to(done, leave.shape) + self._jitter(leave.shape)
        qid = self.quorum_id
        self._collectives(records, arrive, exit_, lambda r, i: f"ftar:{qid}:{i}", n, "allreduce")
        return arrive, exit_

    def _finish(
        self, n: int, tokens: int, sq: np.ndarray, leave: np.ndarray, records: list[Record]
    ) -> None:
        arrive, exit_ = self._ring(n, leave, records)
        wait = arrive.max(axis=0)[None, :] - arrive
        end = exit_ + self.workload.optimizer_s
        for k, rank in enumerate(self.ids):
            r, i = divmod(k, self.ranks)
            records.append(
                StepRecord(
                    rank=rank,
                    step=n,
                    started_at=self.now,
                    duration_s=float(end[r, i]) - self.now,
                    tokens=tokens,
                    sum_seq_len_sq=int(sq[r, i]),
                    exchange_wait_s=float(wait[r, i]),
                )
            )
            records.append(self._beat(k, n, float(end[r, i])))
        sdc = {f.replica for f in self._active(n, FaultKind.SDC)}
        for r in range(self.replicas):
            digest = f"bad-{r}-{n}" if r in sdc else f"good-{n}"
            records.append(Fingerprint(replica_id=self.names[r], step=n, digest=digest))
        self.now = float(end.max())
        self.step_number += 1
        self.sink(self.now, records)

    def _emit_blocked(self, leave: np.ndarray, records: list[Record]) -> None:
        """The step of a kill/hang: the stopped replica's ranks block inside its collective, the
        other replicas finish theirs and block in the rings (they wait for the stopped replica)."""
        finite = np.isfinite(leave)
        ok = finite.all(axis=1)
        arrive = np.where(ok[:, None], leave + self._jitter(leave.shape), np.inf)
        qid = self.quorum_id
        exit_ = np.full(leave.shape, np.inf)
        self._collectives(
            records, arrive, exit_, lambda r, i: f"ftar:{qid}:{i}", self.step_number, "allreduce"
        )
        times = [rec.started_at for rec in records if isinstance(rec, CollectiveRecord)]
        self.now = max(times, default=self.now)
        # The node agents keep beating for blocked (and hung) ranks; only killed ones fall silent.
        records += [self._beat(k, self.step_number - 1, self.now) for k in self._live()]
        self.sink(self.now, records)

    def _live(self) -> list[int]:
        return [k for k in range(len(self.ids)) if k not in self._dead]

    def _beat(self, k: int, step: int, at: float) -> Heartbeat:
        return Heartbeat(rank=self.ids[k], host=self.hosts[k], step=step, at=at)


def replica_name(r: int) -> str:
    """The replica id of replica index `r`."""
    return f"replica-{r:03d}"


def core_sink(core: HealthCore) -> Sink:
    """A sink that feeds `core` directly (no wire)."""

    def sink(now: float, records: Sequence[Record]) -> None:
        steps = [rec for rec in records if isinstance(rec, StepRecord)]
        collectives = [rec for rec in records if isinstance(rec, CollectiveRecord)]
        core.collectives(collectives)
        core.steps(steps)
        for rec in records:
            if isinstance(rec, Heartbeat):
                core.heartbeat(rec)
            elif isinstance(rec, Fingerprint):
                core.fingerprint(rec)

    return sink


def drive(job: EmulatedJob, core: HealthCore, steps: int) -> list[Incident]:
    """Run `steps` steps (or idle seconds once blocked), evaluating after each; all incidents."""
    found: list[Incident] = []
    for _ in range(steps):
        job.step()
        found += core.evaluate(job.now)
    return found
