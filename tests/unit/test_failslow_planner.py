"""The fail-slow planner (`services.quorum.failslow`): its decisions on synthetic speeds."""

from __future__ import annotations

import pytest

from fthsdp.services.quorum.domain import StepWork
from fthsdp.services.quorum.failslow import (
    Choice,
    FailSlowPlanner,
    balanced,
    choose,
    options,
    settled,
    step_time,
)

EVEN = 4
HEALTHY = ("r0", "r1", "r2")
CONFIRM = 8
"""FailSlowPlanner's default confirm_rounds."""


def _options(speeds: dict[str, float], **overrides: float) -> dict[str, Choice]:
    settings: dict[str, float] = {
        "even": EVEN,
        "max_micro_steps": 0,
        "evict_cost_s": 10.0,
        "horizon_s": 60.0,
        "min_replicas": 2,
    }
    settings.update(overrides)
    return dict(
        options(
            speeds,
            even=int(settings["even"]),
            max_micro_steps=int(settings["max_micro_steps"]),
            evict_cost_s=settings["evict_cost_s"],
            horizon_s=settings["horizon_s"],
            min_replicas=int(settings["min_replicas"]),
        )
    )


def test_balanced_shares_keep_the_total_and_minimise_the_slowest_time() -> None:
    speeds = {"r0": 1.0, "r1": 1.0, "r2": 0.5}
    shares = balanced(speeds, 12, 12)
    assert shares == {"r0": 5, "r1": 5, "r2": 2}
    assert step_time(shares, speeds) == 5.0  # the even split takes 8
    # Equal speeds give the even split back; every replica keeps at least one micro-step.
    assert balanced(dict.fromkeys(HEALTHY, 2.0), 12, 12) == dict.fromkeys(HEALTHY, 4)
    assert balanced({"r0": 1.0, "r1": 0.01}, 8, 8) == {"r0": 7, "r1": 1}
    # A cap (memory) stops the fast replicas from taking more.
    assert balanced(speeds, 12, 5) == {"r0": 5, "r1": 5, "r2": 2}
    assert balanced(speeds, 12, 4) == {"r0": 4, "r1": 4, "r2": 4}


def test_a_replica_at_half_speed_is_rebalanced_not_evicted() -> None:
    opts = _options({"r0": 1.0, "r1": 1.0, "r2": 0.5})
    assert opts["keep"].rate == pytest.approx(12 / 8)
    assert opts["rebalance"].rate == pytest.approx(12 / 5)
    assert opts["evict"].evicted == ("r2",)
    assert opts["evict"].rate == pytest.approx(8 / 4 * (1 - 10 / 60))
    assert choose("auto", opts, None, min_gain=0.1).action == "rebalance"
    assert choose("rebalance", opts, None, min_gain=0.1).action == "rebalance"
    assert choose("evict", opts, None, min_gain=0.1).action == "evict"
    assert choose("off", opts, None, min_gain=0.1).action == "keep"


def test_with_no_room_to_move_micro_steps_a_very_slow_replica_is_evicted() -> None:
    opts = _options({"r0": 1.0, "r1": 1.0, "r2": 1 / 3}, max_micro_steps=EVEN)
    assert opts["rebalance"].shares == dict.fromkeys(HEALTHY, EVEN)
    assert choose("auto", opts, None, min_gain=0.1).action == "evict"
    # An eviction that costs more than the horizon gains is never worth it.
    costly = _options({"r0": 1.0, "r1": 1.0, "r2": 1 / 3}, max_micro_steps=EVEN, evict_cost_s=60)
    assert choose("auto", costly, None, min_gain=0.1).action == "keep"
    # Nor below min_replicas.
    assert "evict" not in _options({"r0": 1.0, "r1": 0.1}, min_replicas=2)


def test_equal_speeds_keep_the_even_split_and_noise_does_not_flip_a_choice() -> None:
    equal = _options(dict.fromkeys(HEALTHY, 1.0))
    assert choose("auto", equal, None, min_gain=0.1).action == "keep"
    slow = _options({"r0": 1.0, "r1": 1.0, "r2": 0.5})
    current = choose("auto", slow, None, min_gain=0.1)
    noisy = _options({"r0": 1.05, "r1": 0.95, "r2": 0.52})
    rerated = Choice(
        action=current.action,
        shares=current.shares,
        rate=sum(current.shares.values())
        / step_time(current.shares, {"r0": 1.05, "r1": 0.95, "r2": 0.52}),
    )
    assert choose("auto", noisy, rerated, min_gain=0.1) is rerated


def _feed(planner: FailSlowPlanner, seconds: dict[str, float], steps: int) -> None:
    for _ in range(steps):
        for rid, per_micro_step in seconds.items():
            planner.observe(
                rid,
                1,
                StepWork(even=EVEN, busy_seconds=per_micro_step * EVEN, busy_micro_steps=EVEN),
            )


def test_the_planner_reacts_within_a_few_steps_and_restores_the_even_split() -> None:
    planner = FailSlowPlanner("auto", min_replicas=2)
    now = 100.0
    # Before any measurement (and through the warm-up steps) every replica trains its share.
    assert planner.plan(HEALTHY, EVEN, 0, 0, now) == (dict.fromkeys(HEALTHY, EVEN), ())
    _feed(planner, dict.fromkeys(HEALTHY, 0.1), 2)
    assert planner.plan(HEALTHY, EVEN, 0, 1, now)[0] == dict.fromkeys(HEALTHY, EVEN)
    _feed(planner, dict.fromkeys(HEALTHY, 0.1), 3)
    assert planner.plan(HEALTHY, EVEN, 0, 2, now)[0] == dict.fromkeys(HEALTHY, EVEN)
    assert not planner.decisions  # nothing changed, nothing recorded
    slow = {"r0": 0.1, "r1": 0.1, "r2": 0.2}
    for step in range(3, 20):
        _feed(planner, slow, 1)
        shares, evicted = planner.plan(HEALTHY, EVEN, 0, step, now)
        if shares["r2"] < EVEN:
            break
    # The median of its last steps turns at its 3rd slow step past the warm-up (step 5); the
    # move stands once it was the best for CONFIRM rounds in a row.
    assert step == 5 + CONFIRM - 1, "no reaction within a few steps of a 2x slowdown"
    assert evicted == ()
    assert sum(shares.values()) == 3 * EVEN
    decision = planner.decisions[-1]
    assert decision.action == "rebalance" and decision.step == step
    assert "rebalance" in decision.reason and "keep" in decision.reason
    reacted = step
    for later in range(reacted + 1, reacted + 10):  # the estimate settles
        _feed(planner, slow, 1)
        shares, _ = planner.plan(HEALTHY, EVEN, 0, later, now)
    assert shares == {"r0": 5, "r1": 5, "r2": 2}
    changes = len(planner.decisions)
    for later in range(reacted + 10, reacted + 20):  # the slowdown persists: the choice stays
        _feed(planner, slow, 1)
        planner.plan(HEALTHY, EVEN, 0, later, now)
    assert len(planner.decisions) == changes
    for later in range(reacted + 20, reacted + 35):  # it ends: back to the even split, once
        _feed(planner, dict.fromkeys(HEALTHY, 0.1), 1)
        shares, _ = planner.plan(HEALTHY, EVEN, 0, later, now)
    assert shares == dict.fromkeys(HEALTHY, EVEN)
    assert planner.decisions[-1].action == "keep"
    assert len(planner.decisions) == changes + 1


def test_a_healthy_replica_slow_for_a_few_steps_moves_nothing() -> None:
    """A shared host's noise: a replica a third slower for a few steps, then another; neither
    is a fail-slow, and the even split stays through both (a 2x slowdown moves it: above)."""
    planner = FailSlowPlanner("auto", min_replicas=2)
    _feed(planner, dict.fromkeys(HEALTHY, 0.1), 10)
    step = 0
    for slow in ("r1", "r0", "r1"):
        # CONFIRM - 1 slow steps, then healthy ones: the median of its last 7 is slow for
        # CONFIRM - 1 rounds (from its 4th slow step to its 3rd healthy one).
        episode = [{r: 0.15 if r == slow else 0.1 for r in HEALTHY}] * (CONFIRM - 1)
        for seconds in [*episode, *[dict.fromkeys(HEALTHY, 0.1)] * 7]:
            step += 1
            _feed(planner, seconds, 1)
            assert planner.plan(HEALTHY, EVEN, 0, step, 0.0) == (dict.fromkeys(HEALTHY, EVEN), ())
    assert not planner.decisions
    # The same replica slow for longer is moved, once.
    for _ in range(3 + CONFIRM):
        step += 1
        _feed(planner, {"r0": 0.1, "r1": 0.15, "r2": 0.1}, 1)
        shares, _ = planner.plan(HEALTHY, EVEN, 0, step, 0.0)
    assert shares["r1"] < EVEN
    assert [d.action for d in planner.decisions] == ["rebalance"]


def test_an_evicted_replica_is_not_evicted_again_within_the_horizon() -> None:
    planner = FailSlowPlanner("evict", min_replicas=2, horizon_s=60.0)
    very_slow = {"r0": 0.1, "r1": 0.1, "r2": 0.5}
    _feed(planner, very_slow, 5)
    for step in range(7, 7 + CONFIRM):
        shares, evicted = planner.plan(HEALTHY, EVEN, 0, step, 100.0)
        assert evicted == () or step == 7 + CONFIRM - 1
    assert evicted == ("r2",)
    assert planner.decisions[-1].evicted == ("r2",)
    assert shares == {"r0": EVEN, "r1": EVEN}
    # It comes back as a new incarnation, still slow: measured, but protected for the horizon.
    for _ in range(5):
        planner.observe("r2", 2, StepWork(even=EVEN, busy_seconds=2.0, busy_micro_steps=EVEN))
        _feed(planner, {"r0": 0.1, "r1": 0.1}, 1)
    assert planner.plan(HEALTHY, EVEN, 0, 30, 130.0)[1] == ()
    # Past the horizon it is evicted again, once the move is confirmed.
    evictions = [planner.plan(HEALTHY, EVEN, 0, step, 161.0)[1] for step in range(31, 31 + CONFIRM)]
    assert evictions == [()] * (CONFIRM - 1) + [("r2",)]


def test_policy_off_never_measures_or_moves_anything() -> None:
    planner = FailSlowPlanner("off")
    _feed(planner, {"r0": 0.1, "r1": 0.1, "r2": 1.0}, 10)
    assert planner.plan(HEALTHY, EVEN, 0, 10, 0.0) == (dict.fromkeys(HEALTHY, EVEN), ())
    assert not planner.decisions
    with pytest.raises(ValueError, match="policy"):
        FailSlowPlanner("sometimes")  # type: ignore[arg-type]


def test_replicas_within_the_margin_count_as_equally_fast() -> None:
    assert settled({"r0": 1.0, "r1": 0.9, "r2": 0.5}, 0.2) == {"r0": 0.95, "r1": 0.95, "r2": 0.5}
    # Noise alone never makes anyone slow, so the even split stays.
    noisy = settled({"r0": 1.1, "r1": 0.92, "r2": 1.0}, 0.2)
    assert len(set(noisy.values())) == 1
    assert balanced(noisy, 12, 12) == dict.fromkeys(HEALTHY, 4)
