"""Injected-fault trials and the culprit score of the health detectors: one implementation, used
by tests/unit/test_health_accuracy.py (floors asserted) and by bench.rca (a table per fault kind).

Each trial is an emulated job (bench.emulation) of 4-16 replicas x 2-8 ranks with variable-length
data, one fault of one kind at a random step on a random culprit, driven through HealthCore on a
virtual clock. An incident is correct when it names the injected replica and, when both the fault
and the incident name a rank, the same rank (a fail-slow incident on the replica a slow rank
slowed down is correct: that replica is slower)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from fthsdp.bench.emulation import EmulatedJob, Fault, FaultKind, core_sink, drive, replica_name
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Incident, IncidentKind

EXPECTED = {
    FaultKind.KILL: IncidentKind.FAIL_STOP,
    FaultKind.HANG: IncidentKind.HANG,
    FaultKind.SLOW_RANK: IncidentKind.SLOW_RANK,
    FaultKind.FAIL_SLOW: IncidentKind.FAIL_SLOW,
    FaultKind.SDC: IncidentKind.SDC,
}
"""The incident kind that names each fault kind's culprit."""
CONFIG = DetectorConfig(hang_timeout_s=5.0, fail_slow_warmup_steps=20)


@dataclass(frozen=True)
class Trial:
    """One injected fault and every incident raised while the job ran."""

    fault: Fault
    incidents: list[Incident]


def make_fault(kind: FaultKind, rng: random.Random, replicas: int, ranks: int) -> Fault:
    """A fault of `kind` on a random culprit, late enough for the detectors' warm-up."""
    replica, rank = rng.randrange(replicas), rng.randrange(ranks)
    if kind == FaultKind.FAIL_SLOW:
        step = rng.randint(CONFIG.fail_slow_warmup_steps + 2, CONFIG.fail_slow_warmup_steps + 10)
        return Fault(kind=kind, replica=replica, step=step, factor=rng.uniform(1.5, 2.5))
    if kind == FaultKind.SLOW_RANK:
        delay = rng.uniform(0.08, 0.3)
        return Fault(kind=kind, replica=replica, rank=rank, step=rng.randint(3, 8), delay_s=delay)
    return Fault(kind=kind, replica=replica, rank=rank, step=rng.randint(3, 10))


def run_trial(kind: FaultKind, seed: int) -> Trial:
    """One emulated job with one fault of `kind`, through HealthCore."""
    rng = random.Random(seed)
    replicas, ranks = rng.randint(4, 16), rng.randint(2, 8)
    fault = make_fault(kind, rng, replicas, ranks)
    core = HealthCore(CONFIG)
    job = EmulatedJob(
        replicas=replicas, ranks=ranks, sink=core_sink(core), seed=seed, faults=[fault]
    )
    # Long enough after the fault for every detector's window; blocked jobs idle 1 s per step.
    extra = {FaultKind.SLOW_RANK: 26, FaultKind.FAIL_SLOW: 12}.get(kind, 8)
    return Trial(fault, drive(job, core, fault.step + extra))


def run_trials(per_kind: int) -> list[Trial]:
    """`per_kind` trials of every fault kind (seeds 1000 * kind index + i: reproducible)."""
    return [
        run_trial(kind, seed=1000 * k + i)
        for k, kind in enumerate(EXPECTED)
        for i in range(per_kind)
    ]


def is_correct(incident: Incident, fault: Fault) -> bool:
    """Whether `incident` names the fault's culprit (see the module docstring)."""
    if incident.replica_id != replica_name(fault.replica):
        return False
    whole_replica = fault.kind in (FaultKind.FAIL_SLOW, FaultKind.SDC)
    return whole_replica or incident.rank is None or incident.rank == fault.rank


def named(trial: Trial) -> bool:
    """Whether an incident of the expected kind names the culprit (a recall hit)."""
    kind = EXPECTED[trial.fault.kind]
    return any(i.kind == kind and is_correct(i, trial.fault) for i in trial.incidents)


@dataclass(frozen=True, kw_only=True, slots=True)
class KindScore:
    """The culprit score of one fault kind."""

    kind: str
    injected: int
    """Trials (faults injected)."""
    named: int
    """Trials whose culprit an incident of the expected kind named."""
    missed: int
    """Trials whose culprit was not named (`injected - named`)."""
    incidents: int
    """Incidents of any kind raised in these trials."""
    wrong: int
    """Of them, incidents that named another replica or rank (false accusations)."""

    @property
    def precision(self) -> float:
        """Incidents that named the culprit over all incidents (1.0 when there were none)."""
        return 1.0 - self.wrong / self.incidents if self.incidents else 1.0

    @property
    def recall(self) -> float:
        """Trials whose culprit was named over trials."""
        return self.named / self.injected if self.injected else float("nan")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, with precision and recall."""
        return {
            "kind": self.kind,
            "injected": self.injected,
            "named": self.named,
            "wrong": self.wrong,
            "missed": self.missed,
            "incidents": self.incidents,
            "precision": self.precision,
            "recall": self.recall,
        }


def score(trials: Sequence[Trial]) -> list[KindScore]:
    """One score per fault kind present in `trials`, then the total (kind "all")."""
    rows = [_score(kind.value, [t for t in trials if t.fault.kind == kind]) for kind in EXPECTED]
    return [r for r in rows if r.injected] + [_score("all", trials)]


def _score(kind: str, trials: Sequence[Trial]) -> KindScore:
    hits = sum(named(t) for t in trials)
    incidents = sum(len(t.incidents) for t in trials)
    wrong = sum(not is_correct(i, t.fault) for t in trials for i in t.incidents)
    return KindScore(
        kind=kind,
        injected=len(trials),
        named=hits,
        missed=len(trials) - hits,
        incidents=incidents,
        wrong=wrong,
    )
