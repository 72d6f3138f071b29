"""Slow rank: the rank that consistently arrives last in its intra-replica group is named."""

from __future__ import annotations

from fthsdp.bench.emulation import EmulatedJob, Fault, FaultKind, Workload, core_sink, drive
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import IncidentKind


def _run(faults: list[Fault], steps: int, seed: int = 3) -> list[tuple[str, str, int | None]]:
    core = HealthCore(DetectorConfig(fail_slow_warmup_steps=1000))  # isolate the slow-rank view
    job = EmulatedJob(
        replicas=4,
        ranks=4,
        sink=core_sink(core),
        seed=seed,
        faults=faults,
        workload=Workload(variable=False),
    )
    return [(i.kind, i.replica_id, i.rank) for i in drive(job, core, steps)]


def test_the_late_rank_is_named_not_its_replica_peers() -> None:
    fault = Fault(kind=FaultKind.SLOW_RANK, replica=2, rank=3, step=5, delay_s=0.1)
    assert _run([fault], 40) == [(IncidentKind.SLOW_RANK, "replica-002", 3)]


def test_a_uniformly_slow_replica_is_named_without_a_rank() -> None:
    fault = Fault(kind=FaultKind.FAIL_SLOW, replica=1, step=5, factor=1.6)
    assert _run([fault], 40) == [(IncidentKind.SLOW_RANK, "replica-001", None)]


def test_no_slow_rank_without_a_fault() -> None:
    assert _run([], 120) == []
