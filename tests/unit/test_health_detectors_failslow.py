"""Fail-slow: predictor fit, margin, change point, the peer guard (no peers: silent), persistence
in time, and the plain baseline."""

from __future__ import annotations

import random

import pytest

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import FailSlowDetector, fit, predict
from fthsdp.services.health.telemetry import RankId, StepRecord

ALPHA, BETA, GAMMA = 2e-5, 1e-8, 0.05


def _record(
    step: int, sq: int, factor: float = 1.0, replica: str = "r0", period_s: float = 1.0
) -> StepRecord:
    tokens = 16384
    # Steps of about half a period (scaled with it), plus as much waiting on the others.
    t = (ALPHA * tokens + BETA * sq + GAMMA) * factor * period_s
    return StepRecord(
        rank=RankId(replica_id=replica, rank=0),
        step=step,
        started_at=step * period_s,
        duration_s=t + 0.2 * period_s,
        exchange_wait_s=0.2 * period_s,  # waiting on other replicas is not this replica's time
        tokens=tokens,
        sum_seq_len_sq=sq,
    )


def _feed(  # type: ignore[no-untyped-def]
    det: FailSlowDetector,
    steps: range,
    factor_from: int,
    factor: float,
    seed: int = 0,
    peers: tuple[str, ...] = ("r1",),
    period_s: float = 1.0,
    factor_until: int = 10**9,
):
    """r0 (slowed by `factor` from step `factor_from` until `factor_until`) and its healthy
    `peers` train the same workload."""
    rng = random.Random(seed)
    found = []
    for n in steps:
        # Σl² jumps between short- and long-document phases every 25 steps: up to ~4x time.
        sq = int(16384 * (512 if (n // 25) % 2 == 0 else 6000) * rng.uniform(0.95, 1.05))
        slowed = factor if factor_from <= n < factor_until else 1.0
        det.add([_record(n, sq, slowed, period_s=period_s)])
        det.add([_record(n, sq, replica=peer, period_s=period_s) for peer in peers])
        found += det.check(n * period_s)
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


def test_a_single_replica_is_never_judged_and_says_why() -> None:
    # Nothing tells a slow replica from a slow machine without a peer.
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    assert det.judgement("r0") == "warming_up"
    assert _feed(det, range(120), factor_from=70, factor=1.6, peers=()) == []
    assert det.judgement("r0") == "no_peers"
    assert not det.suspect("r0")


def test_a_peer_that_stopped_stepping_is_no_peer() -> None:
    # r1 trains until step 60 and then goes down: its old residuals say nothing of the time r0
    # is slow in, so r0 has no peer then.
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    _feed(det, range(60), factor_from=10**9, factor=1.0)
    assert det.judgement("r0") == "judging"
    assert _feed(det, range(60, 120), factor_from=70, factor=1.6, peers=()) == []
    assert det.judgement("r0") == "no_peers"


def test_a_slowdown_shared_with_the_peers_is_nobodys() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    rng = random.Random(0)
    for n in range(120):
        sq = int(16384 * 512 * rng.uniform(0.95, 1.05))
        factor = 1.6 if n >= 70 else 1.0  # the machine, not a replica
        det.add([_record(n, sq, factor, replica=r) for r in ("r0", "r1", "r2")])
        assert det.check(float(n)) == []


def test_a_slowdown_shorter_than_the_persistence_time_is_a_blip() -> None:
    # 10 ms steps: 20 slow steps are 0.2 s of slowness, far short of the 2 s it takes.
    config = DetectorConfig(fail_slow_warmup_steps=30, fail_slow_persist_s=2.0)
    det = FailSlowDetector(config)
    blip = _feed(det, range(200), factor_from=70, factor=3.0, period_s=0.01, factor_until=90)
    assert blip == []
    det = FailSlowDetector(config)
    lasting = _feed(det, range(600), factor_from=70, factor=3.0, period_s=0.01)
    assert [i.replica_id for i in lasting] == ["r0"]
    # The median of a 2 s window: not before half of it (1 s, 100 steps) was slow.
    assert lasting[0].evidence["step"] >= 70 + 100
    # By steps alone (five of them), the blip would have been an incident.
    counted = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30, fail_slow_persist_s=0.0))
    by_steps = _feed(
        counted, range(200), factor_from=70, factor=3.0, period_s=0.01, factor_until=90
    )
    assert [i.replica_id for i in by_steps] == ["r0"]


def test_nothing_is_judged_while_the_job_recovers() -> None:
    # A hold (the core's, after a fail-stop) covers steps 60-80; r0 is slow exactly then.
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    _feed(det, range(60), factor_from=10**9, factor=1.0)
    det.hold(80.0)
    assert det.judgement("r0") == "recovering"
    assert _feed(det, range(60, 80), factor_from=60, factor=1.6, factor_until=80) == []
    assert _feed(det, range(80, 160), factor_from=10**9, factor=1.0) == []
    assert det.judgement("r0") == "judging"
    # A slowdown after the hold is named as before.
    found = _feed(det, range(160, 220), factor_from=170, factor=1.6)
    assert [i.replica_id for i in found] == ["r0"]


def test_a_replica_rejoining_a_running_job_mutes_the_detector_until_it_settled() -> None:
    config = DetectorConfig(fail_slow_warmup_steps=30, fail_slow_settle_s=5.0)
    det = FailSlowDetector(config)
    _feed(det, range(60), factor_from=10**9, factor=1.0)
    rng = random.Random(3)
    found = []
    for n in range(60, 140):
        # r2 rejoins at step 60 and warms up (30 steps); meanwhile r0 serves its catch-up,
        # slowly, until step 100 (settled by 95).
        sq = int(16384 * 512 * rng.uniform(0.95, 1.05))
        det.add([_record(n, sq, 1.6 if n < 94 else 1.0), _record(n, sq, replica="r1")])
        det.add([_record(n, sq, replica="r2")])
        found += det.check(float(n))
        if n == 70:
            assert det.judgement("r0") == "recovering"
    assert found == []
    assert det.judgement("r0") == "judging"


def test_a_slowdown_hovering_at_the_margin_is_one_incident() -> None:
    # r0's own residual sits just under the margin while its peers run faster than predicted:
    # its excess over them stays well beyond the margin, one continuing slowdown.
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    rng = random.Random(0)
    found = []
    for n in range(300):
        sq = int(16384 * 512 * rng.uniform(0.95, 1.05))
        slow = n >= 70
        det.add([_record(n, sq, 1.22 if slow else 1.0)])
        det.add([_record(n, sq, 0.8 if slow else 1.0, replica=r) for r in ("r1", "r2")])
        found += det.check(float(n))
    assert [i.replica_id for i in found] == ["r0"]


def test_the_evidence_names_the_slowest_ranks_of_the_step() -> None:
    det = FailSlowDetector(DetectorConfig(fail_slow_warmup_steps=30))
    (found,) = _feed(det, range(120), factor_from=70, factor=1.6)
    (slowest,) = found.evidence["slowest_ranks"]  # _feed's replicas have one rank
    assert slowest["rank"] == 0
    assert slowest["own_s"] == pytest.approx(found.evidence["measured_s"])
    assert slowest["waiting_s"] == pytest.approx(0.2)
