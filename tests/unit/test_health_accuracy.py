"""Culprit precision and recall of the health detectors over 200 injected faults (the trials
come from bench.faults, which bench.rca also scores).

Each trial is an emulated job (bench.emulation) of 4-16 replicas x 2-8 ranks with variable-length
data, one fault of one kind at a random step on a random culprit, driven through HealthCore on a
virtual clock. An incident is correct when it names the injected replica and, when both the fault
and the incident name a rank, the same rank. Recall of a kind: the trials of that kind where an
incident of the matching kind is correct. Precision of an incident kind: its correct incidents
over all its incidents, in every trial (a fail-slow incident on the replica a slow rank slowed
down is correct: that replica is slower). The benign workload (step time varying ~5x with Σl²)
must raise nothing with the predictor, while the plain change-point detector does raise alarms."""

from __future__ import annotations

from collections import defaultdict

import pytest

from fthsdp.bench.emulation import EmulatedJob, FaultKind, Workload, core_sink, drive
from fthsdp.bench.faults import EXPECTED, Trial, is_correct, named, run_trials
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Incident, IncidentKind

TRIALS_PER_KIND = 40
RECALL_FLOOR = {
    FaultKind.KILL: 1.0,
    FaultKind.HANG: 1.0,
    FaultKind.SDC: 1.0,
    FaultKind.SLOW_RANK: 0.95,
    FaultKind.FAIL_SLOW: 0.95,
}
PRECISION_FLOOR = 0.95


@pytest.fixture(scope="module")
def trials() -> list[Trial]:
    return run_trials(TRIALS_PER_KIND)


def test_two_hundred_faults_were_injected(trials: list[Trial]) -> None:
    assert len(trials) >= 200
    assert {t.fault.kind for t in trials} == set(EXPECTED)


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_recall_of_the_culprit(trials: list[Trial], kind: FaultKind) -> None:
    mine = [t for t in trials if t.fault.kind == kind]
    hits = [t for t in mine if named(t)]
    misses = [(t.fault, [i.summary for i in t.incidents]) for t in mine if t not in hits]
    assert len(hits) / len(mine) >= RECALL_FLOOR[kind], misses


def test_precision_of_every_incident_kind(trials: list[Trial]) -> None:
    counts: dict[IncidentKind, list[int]] = defaultdict(lambda: [0, 0])
    wrong = []
    for trial in trials:
        for incident in trial.incidents:
            counts[incident.kind][1] += 1
            if is_correct(incident, trial.fault):
                counts[incident.kind][0] += 1
            else:
                wrong.append((trial.fault, incident.summary))
    precision = {kind: good / total for kind, (good, total) in counts.items()}
    assert set(precision) >= set(EXPECTED.values())
    assert min(precision.values()) >= PRECISION_FLOOR, (precision, wrong)


def test_exact_culprits_for_kill_hang_and_sdc(trials: list[Trial]) -> None:
    """No wrong culprit at all for the fault kinds whose evidence is unambiguous."""
    for trial in trials:
        if trial.fault.kind in (FaultKind.KILL, FaultKind.HANG, FaultKind.SDC):
            assert all(is_correct(i, trial.fault) for i in trial.incidents), trial


def _benign(use_predictor: bool, seed: int, steps: int) -> list[Incident]:
    config = DetectorConfig(fail_slow_warmup_steps=30, fail_slow_use_predictor=use_predictor)
    core = HealthCore(config)
    job = EmulatedJob(
        replicas=4, ranks=2, sink=core_sink(core), seed=seed, workload=Workload(variable=True)
    )
    return drive(job, core, steps)


def test_benign_variable_length_workload_raises_nothing_with_the_predictor() -> None:
    incidents = [i for seed in range(6) for i in _benign(True, seed, 400)]
    assert incidents == []


def test_the_plain_change_point_detector_does_raise_false_alarms() -> None:
    """The same workload fools the baseline, so the previous test is not vacuous."""
    incidents = [i for seed in range(6) for i in _benign(False, seed, 400)]
    assert len(incidents) >= 6
    assert {i.kind for i in incidents} == {IncidentKind.FAIL_SLOW}
