"""Effective training time (ETT) of a job under failures: FT-HSDP against a synchronous full
restart, in closed form and by a discrete-event simulation. Pure: no torch, no I/O.

ETT is the share of the job's GPU-time that trains work which is kept. Failures arrive job-wide
as a Poisson process with mean interval M (the failure rate is λ = 1/M); a failure hits one
replica, uniformly at random.

Synchronous baseline. Every failure stops the whole job for a full restart R and rolls it back to
its last checkpoint, losing the work since then: on average L = M − C/(e^{C/M} − 1) ≈ C/2 of
training for a checkpoint every C (C is at least one step: the step in flight is always lost).
A failure during a restart queues another whole restart, so the job restarts a λR share of the
time (the busy share of an M/D/1 queue) and trains the rest, of which a λL share is rolled back:

    ETT_sync = (1 − R/M) · (1 − L/M)

Its first order, 1 − (R + L)/M, is the paper's arithmetic: R = 10 min, M = 18 min and a
negligible L give 1 − 10/18 = 44.4 %, the paper's 44 %. (Other readings miss it: charging the
restart only to training time, M/(M + R), gives 64 %; letting a failure cut a restart short so
that only the union of restart windows is lost, e^{−R/M}, gives 57 %.)

FT-HSDP. A failure stalls every replica for S = detection + ring rebuild + first-step penalty +
half a step (the step in flight is redone); the failed replica is out for D = detection + its own
restart + catch-up from a peer, counted from the failure, so the first S of it overlaps the
stall. For the remaining D − S the other N − 1 replicas train on: the job loses 1/N of its
throughput. Per failure that is S + max(D − S, 0)/N of whole-job time:

    ETT_ft = 1 − (S + max(D − S, 0)/N) / M

The paper's inputs (N = 12, M = 18 min, a 3 min stall, the failed replica back after the same
10 min a full restart takes) give 1 − (3 + 7/12)/18 = 80.1 %, the paper's 80 %. Charging the
failed replica's whole 10 min on top of the stall, 1 − (3 + 10/12)/18 = 78.7 %, double-counts the
3 min it is idle with everyone else and misses it.

The simulation draws the failures over a horizon and keeps every cost whole, as the formulas do:
a failure during a stall queues another stall (the rings are rebuilt again), one during a
replica's recovery queues another recovery of that replica, one during a synchronous restart
another restart. Replicas overlap freely (two or more down at once). The synchronous formula is
then exact in expectation; the FT-HSDP one is first order: a stall that falls while another
replica is recovering costs that replica's 1/N once, not twice as the formula counts it, so the
simulation runs higher by about (S/M)·(D − S)/(N·M): +0.5 pp at the paper's inputs, negligible
at fthsdp's sub-second stalls. The simulation follows (1 − S/M)·(1 − max(D − S, 0)/(N·M)) closely
(the stall and the other replicas' outages are independent), which is 80.6 % at the paper's
inputs; the first-order form is kept as the closed form because it is the paper's arithmetic,
and where S/M is large (a 3 min stall every 6 min) the simulated figure is the one to use.

FT-HSDP never needs a checkpoint here: a replica catches up from a live peer, and with N ≥ 2
every replica being down at once is negligible at these rates.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any


@dataclass(kw_only=True, slots=True, frozen=True)
class JobModel:
    """One training job and what a failure costs it, under either recovery."""

    gpus: int
    """GPUs in the job."""
    replicas: int
    """Replicas (FT-HSDP's unit of failure); each holds gpus / replicas GPUs."""
    failure_interval: timedelta
    """Mean time between failures of the whole job (any GPU or host in it)."""
    step_time: timedelta
    """One training step, fault-free."""
    detection: timedelta = timedelta(seconds=0.1)
    """FT-HSDP: from a failure until the survivors know of it."""
    ring_rebuild: timedelta = timedelta(seconds=0.1)
    """FT-HSDP: the survivors' stall to form new rings, on the shrink and the regrow together."""
    first_step_penalty: timedelta = timedelta(0)
    """FT-HSDP: extra time of the first step on new rings, beyond a normal step."""
    catch_up: timedelta = timedelta(seconds=7)
    """FT-HSDP: the restarted replica fetching the live state from a peer."""
    replica_restart: timedelta = timedelta(minutes=10)
    """FT-HSDP: the failed replica's own restart (new host, processes, initialisation)."""
    sync_restart: timedelta = timedelta(minutes=10)
    """Synchronous baseline: the whole job's restart per failure."""
    checkpoint_interval: timedelta = timedelta(0)
    """Synchronous baseline: training time between durable checkpoints; 0 (or anything under a
    step) means every step."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.gpus < self.replicas:
            raise ValueError(f"replicas ({self.replicas}) exceed gpus ({self.gpus})")
        if self.gpus % self.replicas:
            raise ValueError(f"gpus ({self.gpus}) do not divide into {self.replicas} replicas")
        for name in ("failure_interval", "step_time", "sync_restart"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "detection",
            "ring_rebuild",
            "first_step_penalty",
            "catch_up",
            "replica_restart",
        ):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.checkpoint_interval < timedelta(0):
            raise ValueError(
                f"checkpoint_interval must not be negative: {self.checkpoint_interval}"
            )

    @property
    def rate(self) -> float:
        """Failures per second, job-wide (λ)."""
        return 1.0 / self.failure_interval.total_seconds()

    @property
    def stall_s(self) -> float:
        """S: every replica's stall per failure, seconds."""
        return (
            self.detection + self.ring_rebuild + self.first_step_penalty + self.step_time / 2
        ).total_seconds()

    @property
    def recovery_s(self) -> float:
        """D: the failed replica's time out, from the failure, seconds."""
        return (self.detection + self.replica_restart + self.catch_up).total_seconds()

    @property
    def checkpoint_s(self) -> float:
        """C: the synchronous job's checkpoint period, at least a step, seconds."""
        return max(self.checkpoint_interval, self.step_time).total_seconds()

    @property
    def rollback_s(self) -> float:
        """L: training the synchronous job loses to a failure on average, seconds."""
        return expected_rollback_s(self.checkpoint_s, self.rate)


def expected_rollback_s(checkpoint_s: float, rate: float) -> float:
    """E[T mod C] for T ~ Exp(rate): the work since the last checkpoint when a failure ends a
    stretch of training that began at a checkpoint (≈ C/2 when C ≪ 1/rate)."""
    x = rate * checkpoint_s
    if x < 1e-4:  # the exact form cancels catastrophically here
        return checkpoint_s / 2 - rate * checkpoint_s**2 / 12
    return 1.0 / rate - checkpoint_s / math.expm1(x)


def failure_interval_from_mtbf(
    mtbf_hours_per_1000_hosts: float, *, gpus: int, gpus_per_host: int
) -> timedelta:
    """The job-wide failure interval of `gpus` GPUs on hosts of `gpus_per_host`, when 1,000
    hosts see a failure every `mtbf_hours_per_1000_hosts` hours (a partly used host counts)."""
    if mtbf_hours_per_1000_hosts <= 0 or gpus < 1 or gpus_per_host < 1:
        raise ValueError("the MTBF, GPUs and GPUs per host must be positive")
    hosts = math.ceil(gpus / gpus_per_host)
    return timedelta(hours=mtbf_hours_per_1000_hosts * 1000 / hosts)


def ett_ft_closed(m: JobModel) -> float:
    """ETT of FT-HSDP in closed form (see the module docstring)."""
    s, d = m.stall_s, m.recovery_s
    return max(0.0, 1.0 - m.rate * (s + max(d - s, 0.0) / m.replicas))


def ett_sync_closed(m: JobModel) -> float:
    """ETT of the synchronous baseline in closed form (see the module docstring)."""
    restarting = m.rate * m.sync_restart.total_seconds()
    return max(0.0, 1.0 - restarting) * (1.0 - m.rate * m.rollback_s)


def draw_failures(m: JobModel, horizon_s: float, rng: random.Random) -> list[tuple[float, int]]:
    """(time, replica) of every failure in [0, horizon_s): Poisson at the job-wide rate, each
    hitting a replica uniformly."""
    out: list[tuple[float, int]] = []
    t = rng.expovariate(m.rate)
    while t < horizon_s:
        out.append((t, rng.randrange(m.replicas)))
        t += rng.expovariate(m.rate)
    return out


def _queue(intervals: list[list[float]], t: float, cost: float) -> None:
    """Adds `cost` of busy time starting at t, or after the busy interval still open at t."""
    if intervals and intervals[-1][1] >= t:
        intervals[-1][1] += cost
    else:
        intervals.append([t, t + cost])


def _measure(intervals: Sequence[Sequence[float]], horizon_s: float) -> float:
    return sum(min(e, horizon_s) - s for s, e in intervals if s < horizon_s)


def _overlap(
    a: float, b: float, intervals: Sequence[Sequence[float]], starts: Sequence[float]
) -> float:
    """Length of [a, b] covered by sorted disjoint `intervals` (`starts` their starts)."""
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0.0
    while i < len(intervals) and intervals[i][0] < b:
        total += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
        i += 1
    return total


def simulate_ft(m: JobModel, failures: Sequence[tuple[float, int]], horizon_s: float) -> float:
    """ETT of FT-HSDP over [0, horizon_s) for the given failures."""
    stall: list[list[float]] = []
    down: list[list[list[float]]] = [[] for _ in range(m.replicas)]
    s, d = m.stall_s, m.recovery_s
    for t, replica in failures:
        _queue(stall, t, s)
        _queue(down[replica], t, d)
    stall = [iv for iv in stall if iv[0] < horizon_s]
    starts = [iv[0] for iv in stall]
    lost = _measure(stall, horizon_s)
    for intervals in down:
        for a, b in intervals:
            if a >= horizon_s:
                break
            b = min(b, horizon_s)
            # Only the replica's time outside a stall is its own loss: a stall costs every one.
            lost += (b - a - _overlap(a, b, stall, starts)) / m.replicas
    return max(0.0, 1.0 - lost / horizon_s)


def simulate_sync(m: JobModel, failures: Sequence[tuple[float, int]], horizon_s: float) -> float:
    """ETT of the synchronous baseline over [0, horizon_s) for the given failures."""
    restarts: list[list[float]] = []
    restart_s, checkpoint_s = m.sync_restart.total_seconds(), m.checkpoint_s
    rolled_back = 0.0
    for t, _ in failures:
        if not restarts or restarts[-1][1] < t:
            # Training since the last restart (a checkpoint) is lost back to its last checkpoint.
            began = restarts[-1][1] if restarts else 0.0
            rolled_back += math.fmod(t - began, checkpoint_s)
        _queue(restarts, t, restart_s)
    return max(0.0, 1.0 - (_measure(restarts, horizon_s) + rolled_back) / horizon_s)


@dataclass(kw_only=True, slots=True, frozen=True)
class Estimate:
    """ETT of both recoveries, closed form and simulated."""

    ft_closed: float
    """FT-HSDP, closed form (0..1)."""
    sync_closed: float
    """Synchronous baseline, closed form (0..1)."""
    ft_sim: float
    """FT-HSDP, mean over the simulated runs."""
    ft_sim_sd: float
    """FT-HSDP, standard deviation over the runs (0 with one run)."""
    sync_sim: float
    """Synchronous baseline, mean over the simulated runs."""
    sync_sim_sd: float
    """Synchronous baseline, standard deviation over the runs."""
    failures: int
    """Failures drawn, over all runs."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, rounded to 0.01 pp."""
        return {
            "ft_closed": round(self.ft_closed, 4),
            "ft_sim": round(self.ft_sim, 4),
            "ft_sim_sd": round(self.ft_sim_sd, 4),
            "sync_closed": round(self.sync_closed, 4),
            "sync_sim": round(self.sync_sim, 4),
            "sync_sim_sd": round(self.sync_sim_sd, 4),
            "failures": self.failures,
        }


def estimate(m: JobModel, *, horizon: timedelta, runs: int, seed: int) -> Estimate:
    """Both closed forms, and `runs` simulations of `horizon` each (seeds seed, seed + 1, …); both
    recoveries see the same failures in a run."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    horizon_s = horizon.total_seconds()
    if horizon_s <= 0:
        raise ValueError(f"horizon must be positive, got {horizon}")
    ft: list[float] = []
    sync: list[float] = []
    drawn = 0
    for run in range(runs):
        failures = draw_failures(m, horizon_s, random.Random(seed + run))
        drawn += len(failures)
        ft.append(simulate_ft(m, failures, horizon_s))
        sync.append(simulate_sync(m, failures, horizon_s))
    return Estimate(
        ft_closed=ett_ft_closed(m),
        sync_closed=ett_sync_closed(m),
        ft_sim=statistics.fmean(ft),
        ft_sim_sd=statistics.stdev(ft) if runs > 1 else 0.0,
        sync_sim=statistics.fmean(sync),
        sync_sim_sd=statistics.stdev(sync) if runs > 1 else 0.0,
        failures=drawn,
    )


PAPER = JobModel(
    gpus=98_304,
    replicas=12,
    failure_interval=timedelta(minutes=18),
    # The paper gives no step time; 2 s is typical at this scale and costs the ETT under 0.1 pp.
    step_time=timedelta(seconds=2),
    # The paper gives one 3 min stall per failure; all of it is put in the rebuild.
    detection=timedelta(0),
    ring_rebuild=timedelta(minutes=3),
    first_step_penalty=timedelta(0),
    catch_up=timedelta(0),
    replica_restart=timedelta(minutes=10),
    sync_restart=timedelta(minutes=10),
)
"""The FT-HSDP paper's setting: 12 replicas, a failure every 18 min, a 10 min synchronous
restart, a 3 min FT-HSDP stall. ETT 44 % synchronous, 80 % FT-HSDP."""

AT_100K = replace(
    PAPER,
    detection=timedelta(seconds=0.1),
    ring_rebuild=timedelta(seconds=0.1),
    catch_up=timedelta(seconds=7),
)
"""The paper's job (12 × 8192 GPUs, a failure every 18 min, 10 min restarts) with fthsdp's
measured detection and stall (0.1 s each) and a ~7 s catch-up."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ReportCosts:
    """What a demo `report.json` measured per replica failure (medians)."""

    detection: timedelta
    """From the kill until the survivors formed a quorum without the victim (`detection_s`)."""
    ring_rebuild: timedelta
    """The survivors' stall beyond detection (`survivor_stall_s` − `detection_s`, at least 0):
    the stall is a commit gap beyond the median step, so it holds detection, both rebuilds and
    the slower first step."""
    catch_up: timedelta
    """From detection until the victim committed again (`time_to_healthy_s` − `detection_s`):
    the demo's process restart and its catch-up together, so an upper bound on the catch-up."""
    failures: int
    """Replica failures the medians are over."""


def costs_from_report(report: Mapping[str, Any]) -> ReportCosts:
    """The medians of a demo report's replica failures (control-plane failures, which name no
    replica, and failures that never healed are left out). ValueError when none is left."""
    rows = [
        f
        for f in report.get("failures") or []
        if isinstance(f, Mapping)
        and f.get("replica") is not None
        and all(
            isinstance(f.get(k), int | float)
            for k in ("detection_s", "survivor_stall_s", "time_to_healthy_s")
        )
    ]
    if not rows:
        raise ValueError(
            "no replica failure with detection_s, survivor_stall_s and time_to_healthy_s"
        )
    detection = statistics.median(float(f["detection_s"]) for f in rows)
    stall = statistics.median(float(f["survivor_stall_s"]) for f in rows)
    healthy = statistics.median(float(f["time_to_healthy_s"]) for f in rows)
    return ReportCosts(
        detection=timedelta(seconds=detection),
        ring_rebuild=timedelta(seconds=max(0.0, stall - detection)),
        catch_up=timedelta(seconds=max(0.0, healthy - detection)),
        failures=len(rows),
    )
