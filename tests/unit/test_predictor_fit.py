"""The fail-slow predictor T ≈ αN + βΣl² + γ (the health service's own `fit`) recovers the
coefficients of synthetic steps, including the demo's packed workload with a constant N, and the
bench's MAPE and replay helpers score it."""

from __future__ import annotations

import random

import pytest

from fthsdp.bench.predictor_score import mape, replay_verdicts, split_warmup
from fthsdp.services.health.detectors.failslow import fit, predict

ALPHA = 2.0e-5  # seconds per token
BETA = 3.0e-8  # seconds per Σ l²
GAMMA = 0.004  # seconds per step that no token explains


def _steps(
    n: int, *, constant_tokens: bool, noise: float, seed: int = 0
) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = 1024 if constant_tokens else rng.choice([512, 1024, 2048, 4096])
        lengths = [rng.choice([8, 16, 32, 64, 128, 256]) for _ in range(tokens // 64)]
        sum_sq = sum(length * length for length in lengths) * 4
        t = (ALPHA * tokens + BETA * sum_sq + GAMMA) * (1 + rng.gauss(0, noise))
        out.append((tokens, sum_sq, t))
    return out


def test_fit_recovers_alpha_beta_gamma_from_noiseless_steps() -> None:
    alpha, beta, gamma = fit(_steps(60, constant_tokens=False, noise=0.0))
    assert alpha == pytest.approx(ALPHA, rel=1e-6)
    assert beta == pytest.approx(BETA, rel=1e-6)
    assert gamma == pytest.approx(GAMMA, rel=1e-6)


def test_fit_recovers_beta_and_predicts_with_a_constant_token_budget() -> None:
    """The demo's packed samples: N is the budget every step, so αN and γ are one constant
    (collinear); β is still identified and the prediction is right."""
    samples = _steps(60, constant_tokens=True, noise=0.0)
    coef = fit(samples)
    assert coef[1] == pytest.approx(BETA, rel=1e-6)
    assert coef[0] * 1024 + coef[2] == pytest.approx(ALPHA * 1024 + GAMMA, rel=1e-6)
    for tokens, sum_sq, t in _steps(20, constant_tokens=True, noise=0.0, seed=1):
        assert predict(coef, tokens, sum_sq) == pytest.approx(t, rel=1e-6)


def test_fit_on_noisy_steps_is_close_and_its_mape_is_the_noise() -> None:
    train = _steps(400, constant_tokens=False, noise=0.02)
    test = _steps(400, constant_tokens=False, noise=0.02, seed=2)
    alpha, beta, _ = fit(train)
    assert alpha == pytest.approx(ALPHA, rel=0.05)
    assert beta == pytest.approx(BETA, rel=0.05)
    # Gaussian noise of 2%: the mean absolute error is 2% x sqrt(2/pi) = 1.6%.
    assert mape((alpha, beta, _), test) == pytest.approx(1.6, abs=0.3)
    # A predictor without the Σ l² term explains much less of the same steps.
    flat = fit([(n, 0, t) for n, _sq, t in train])
    assert mape(flat, [(n, 0, t) for n, _sq, t in test]) > 3 * mape((alpha, beta, _), test)


def test_split_warmup_keeps_each_replicas_first_steps_for_the_fit() -> None:
    steps = {
        "r0": _steps(50, constant_tokens=False, noise=0.0),
        "r1": _steps(10, constant_tokens=False, noise=0.0),
    }
    fits, held_out = split_warmup(steps, warmup=30)
    assert set(fits) == {"r0"}  # r1 never finished its warm-up
    assert len(held_out["r0"]) == 20 and "r1" not in held_out
    # Leaving the start-up's steps out of the fit.
    fits, held_out = split_warmup(steps, warmup=30, skip=15)
    assert len(held_out["r0"]) == 5
    assert fits["r0"] == pytest.approx(fit(steps["r0"][15:45]))


def test_replay_is_quiet_on_benign_swings_and_names_a_slow_replica() -> None:
    """The health service's own detector, replayed on synthetic per-replica steps: phases of
    short and long documents on three replicas, then one of them 1.5x slower."""
    records = []
    t = 1000.0
    for step in range(300):
        long = (step // 20) % 2 == 1
        sum_sq = 4 * 256**2 if long else 4 * 16 * 16**2
        healthy = ALPHA * 1024 + BETA * sum_sq + GAMMA
        for replica in ("r0", "r1", "r2"):
            slow = 1.5 if replica == "r1" and step >= 200 else 1.0
            records.append(
                {
                    "rank": {"replica_id": replica, "rank": 0},
                    "step": step,
                    "started_at": t,
                    "duration_s": healthy * slow,
                    "tokens": 1024,
                    "sum_seq_len_sq": sum_sq,
                    "committed": True,
                    "exchange_wait_s": 0.0,
                }
            )
        t += 0.1
    with_predictor = replay_verdicts(records, use_predictor=True)
    assert [(i["replica_id"], i["step"] >= 200) for i in with_predictor] == [("r1", True)]
    # The plain change point (no workload model) fires on the benign swings as well.
    plain = replay_verdicts([r for r in records if r["step"] < 200], use_predictor=False)
    assert len(plain) >= 3
