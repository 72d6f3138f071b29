"""bench.recovery's fault-free overhead: ratios against the DDP runs around each fault-free run,
and health's own cost from the health arms."""

from __future__ import annotations

from typing import Any

import pytest

from fthsdp.bench.recovery import overhead_repeats, parse_args


def _step(median: float) -> dict[str, Any]:
    return {"step_times": {"interval_s": {"median": median}}}


def _ddp(median: float) -> dict[str, Any]:
    return {"interval_s": {"median": median}}


def test_each_run_is_judged_by_the_ddp_runs_around_it_and_health_by_its_arm() -> None:
    phases = {
        "ddp_before": _ddp(0.10),
        "faultfree": _step(0.12),
        "faultfree_nohealth": _step(0.11),
        "ddp_after": _ddp(0.14),
        "faultfree_1": _step(0.15),
        "faultfree_nohealth_1": _step(0.12),
        "ddp_after_1": _ddp(0.10),
    }
    rep = overhead_repeats(phases, 2)
    assert [r["ratio"] for r in rep["runs"]] == pytest.approx([0.12 / 0.12, 0.15 / 0.12])
    assert rep["health_cost"]["ratios"] == pytest.approx([0.12 / 0.11, 0.15 / 0.12])
    assert rep["health_cost"]["median"] == pytest.approx((0.12 / 0.11 + 0.15 / 0.12) / 2)


def test_without_the_health_arms_there_is_no_health_cost() -> None:
    phases = {"ddp_before": _ddp(0.1), "faultfree": _step(0.1), "ddp_after": _ddp(0.1)}
    assert overhead_repeats(phases, 1)["health_cost"] is None


@pytest.mark.parametrize(
    "argv", [["--health-arms"], ["--overhead-only", "--health-arms", "--no-health"]]
)
def test_the_health_arms_need_overhead_only_with_health(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
