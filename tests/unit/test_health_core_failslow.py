"""The core's fail-slow wiring over a whole job (fake clock): a replica that dies and restarts
mutes the detector for the survivors while the job recovers, the API says so, and a slowdown
once it settled is named."""

from __future__ import annotations

from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import Heartbeat, IncidentKind, RankId, StepRecord

TOKENS, SQ = 16384, 16384 * 512


def _step(core: HealthCore, n: int, replicas: dict[str, str], slow: str | None = None) -> None:
    """Every replica in `replicas` (id -> its process) beats and commits step n at t = n."""
    for replica, process in replicas.items():
        rank = RankId(replica_id=replica, rank=0)
        core.heartbeat(Heartbeat(rank=rank, host="h", step=n, at=float(n), process=process))
        own = 0.4 * (1.6 if replica == slow else 1.0)
        core.steps(
            [
                StepRecord(
                    rank=rank,
                    step=n,
                    started_at=float(n),
                    duration_s=own + 0.1,
                    exchange_wait_s=0.1,
                    tokens=TOKENS,
                    sum_seq_len_sq=SQ,
                )
            ]
        )


def _judgement(core: HealthCore, replica: str) -> str:
    return {v.replica_id: v.fail_slow for v in core.replicas()}[replica]


def test_survivors_are_not_judged_while_a_dead_replica_restarts() -> None:
    core = HealthCore(DetectorConfig(fail_slow_warmup_steps=10, fail_slow_settle_s=5.0))
    job = {"r0": "p0", "r1": "p1", "r2": "p2"}
    kinds = []
    for n in range(40):
        _step(core, n, job)
        kinds += [i.kind for i in core.evaluate(n + 0.5)]
    assert kinds == [] and _judgement(core, "r0") == "judging"
    survivors = {"r0": "p0", "r1": "p1"}
    for n in range(40, 60):  # r2 died; r0 serves, slowly, while r2 restarts
        _step(core, n, survivors, slow="r0")
        kinds += [i.kind for i in core.evaluate(n + 0.5)]
    assert kinds == [IncidentKind.FAIL_STOP]
    assert _judgement(core, "r0") == "recovering"
    job["r2"] = "p2-restarted"
    for n in range(60, 90):  # back, warming up again; r0 still slowed for a while
        _step(core, n, job, slow="r0" if n < 70 else None)
        kinds += [i.kind for i in core.evaluate(n + 0.5)]
    assert kinds == [IncidentKind.FAIL_STOP]
    assert _judgement(core, "r0") == "judging"
    for n in range(90, 130):  # a real slowdown, in a settled job
        _step(core, n, job, slow="r1")
        kinds += [i.kind for i in core.evaluate(n + 0.5)]
    assert kinds == [IncidentKind.FAIL_STOP, IncidentKind.FAIL_SLOW]
