"""Fail-slow: predictor fit, margin, change point, and the plain baseline."""

from __future__ import annotations

import random

import pytest

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import FailSlowDetector, fit, predict
from fthsdp.services.health.telemetry import RankId, StepRecord

ALPHA, BETA, GAMMA = 2e-5, 1e-8, 0.05


def _record(step: int, sq: int, factor: float = 1.0, replica: str = "r0") -> StepRecord:
    tokens = 16384
    t = (ALPHA * tokens + BETA * sq + GAMMA) * factor
    return StepRecord(
        rank=RankId(replica_id=replica, rank=0),
        step=step,
        started_at=float(step),
        duration_s=t + 0.2,
        exchange_wait_s=0.2,  # waiting on other replicas is not this replica's time
        tokens=tokens,
        sum_seq_len_sq=sq,
    )


def _feed(det: FailSlowDetector, steps: range, factor_from: int, factor: float, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    found = []
    for n in steps:
        # Σl² jumps between short- and long-document phases every 25 steps: up to ~4x time.
        sq = int(16384 * (512 if (n // 25) % 2 == 0 else 6000) * rng.uniform(0.95, 1.05))
        det.add([_record(n, sq, factor if n >= factor_from else 1.0)])
        found += det.check(float(n))
    return found


def test_fit_recovers_the_coefficients() -> None:
    rng = random.Random(1)
    samples = []
    for _ in range(40):
        n, sq = rng.randint(8000, 16000), rng.randint(10**6, 10**8)
        samples.append((n, sq, ALPHA * n + BETA * sq + GAMMA))
    coef = fit(samples)
    assert coef == pytest.approx((ALPHA, BETA, GAMMA), rel=1e-6)
    assert predict(coef, 10000, 5 * 10**7) == pytest.approx(ALPHA * 1e4 + BETA * 5e7 + GAMMA)


def test_benign_workload_phases_raise_nothing() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    assert _feed(det, range(300), factor_from=10**9, factor=1.0) == []


def test_a_slowdown_beyond_the_margin_is_named_once() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    found = _feed(det, range(120), factor_from=70, factor=1.6)
    assert [(i.replica_id, i.evidence["policy"]) for i in found] == [("r0", "report")]
    assert 70 <= found[0].evidence["step"] <= 76
    assert found[0].evidence["ratio"] == pytest.approx(1.6, rel=0.05)
    assert det.suspect("r0")


def test_a_slowdown_within_the_margin_is_not_an_incident() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    assert _feed(det, range(150), factor_from=60, factor=1.15) == []


def test_the_plain_change_point_detector_fires_on_benign_phases() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30, fail_slow_use_predictor=False))
    assert len(_feed(det, range(300), factor_from=10**9, factor=1.0)) >= 3
