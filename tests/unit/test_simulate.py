"""`fthsdp simulate`: the ETT model reproduces the FT-HSDP paper's 44 % and 80 %, the simulation
agrees with the closed forms and prices overlapping failures as stated, a demo report's costs are
read, and bad input is a usage error naming the flag."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fthsdp.deploy.cli import main
from fthsdp.deploy.simulate import (
    AT_100K,
    PAPER,
    JobModel,
    costs_from_report,
    estimate,
    ett_ft_closed,
    ett_sync_closed,
    expected_rollback_s,
    failure_interval_from_mtbf,
    simulate_ft,
    simulate_sync,
)


def _job(**changes: Any) -> JobModel:
    """4 replicas; S = 10 s (a 2 s step: 9 s rebuild + 1 s), D = 100 s, R = 100 s."""
    base = JobModel(
        gpus=32,
        replicas=4,
        failure_interval=timedelta(minutes=10),
        step_time=timedelta(seconds=2),
        detection=timedelta(0),
        ring_rebuild=timedelta(seconds=9),
        catch_up=timedelta(0),
        replica_restart=timedelta(seconds=100),
        sync_restart=timedelta(seconds=100),
    )
    return replace(base, **changes)


def test_the_papers_inputs_give_its_44_and_80_percent() -> None:
    assert round(100 * ett_sync_closed(PAPER)) == 44
    assert round(100 * ett_ft_closed(PAPER)) == 80
    # And not by rounding luck: within a tenth of a point of 1 − 10/18 and 1 − (3 + 7/12)/18.
    assert ett_sync_closed(PAPER) == pytest.approx(1 - 10 / 18, abs=1e-3)
    assert ett_ft_closed(PAPER) == pytest.approx(1 - (3 + 7 / 12) / 18, abs=1e-3)


def test_fthsdp_costs_at_100k_gpus_leave_only_the_replicas_own_restart() -> None:
    # S = 0.1 + 0.1 + 1 s, D = 0.1 + 600 + 7 s: the loss is the failed replica's 1/12.
    expected = 1 - (1.2 + (607.1 - 1.2) / 12) / 1080
    assert ett_ft_closed(AT_100K) == pytest.approx(expected)
    assert ett_ft_closed(AT_100K) > 0.95


def test_simulation_agrees_with_the_closed_forms_at_the_papers_inputs() -> None:
    e = estimate(PAPER, horizon=timedelta(days=365), runs=2, seed=0)
    assert abs(e.ft_sim - e.ft_closed) < 0.01
    assert abs(e.sync_sim - e.sync_closed) < 0.01
    assert e.failures > 50_000


def test_rollback_to_a_checkpoint_is_priced_exactly() -> None:
    # A checkpoint every 30 min at a failure every 18 min: far from C ≪ M, so C/2 would be wrong.
    m = replace(PAPER, checkpoint_interval=timedelta(minutes=30))
    assert expected_rollback_s(1800, 1 / 1080) < 900
    e = estimate(m, horizon=timedelta(days=365), runs=2, seed=1)
    assert abs(e.sync_sim - e.sync_closed) < 0.01
    assert e.sync_closed < ett_sync_closed(PAPER) - 0.2


def test_a_replica_back_within_the_stall_costs_only_the_stall() -> None:
    m = _job(replica_restart=timedelta(seconds=5))
    assert ett_ft_closed(m) == pytest.approx(1 - 10 / 600)


def test_overlapping_failures_of_two_replicas_each_cost_their_own_share() -> None:
    # Stalls [0, 10] and [50, 60]; r0 out [0, 100], r1 out [50, 150]. r0's own time outside a
    # stall is 100 − 10 − 10 (r1's stall), r1's is 100 − 10: 20 + (80 + 90) / 4 lost.
    assert simulate_ft(_job(), [(0.0, 0), (50.0, 1)], 1000.0) == pytest.approx(1 - 62.5 / 1000)


def test_a_failure_during_a_recovery_or_a_stall_queues_another_whole_one() -> None:
    # r0 twice: out [0, 200]; stalls [0, 10], [50, 60]: 20 + (200 − 20) / 4.
    assert simulate_ft(_job(), [(0.0, 0), (50.0, 0)], 1000.0) == pytest.approx(1 - 65 / 1000)
    # Two failures 5 s apart: one stall [0, 20]; r0 out [0, 100], r1 out [5, 105].
    assert simulate_ft(_job(), [(0.0, 0), (5.0, 1)], 1000.0) == pytest.approx(
        1 - (20 + (80 + 85) / 4) / 1000
    )


def test_a_synchronous_restart_queues_and_rolls_back_to_the_last_checkpoint() -> None:
    # Up since 0 with a checkpoint every 2 s: the failure at 501 loses 1 s; the one at 550 hits
    # the restart and adds another: restarting [501, 701].
    assert simulate_sync(_job(), [(501.0, 0), (550.0, 2)], 1000.0) == pytest.approx(1 - 201 / 1000)


def test_the_horizon_clips_a_recovery_still_running() -> None:
    assert simulate_sync(_job(), [(950.0, 0)], 1000.0) == pytest.approx(1 - 50 / 1000)
    assert simulate_ft(_job(), [(995.0, 0)], 1000.0) == pytest.approx(1 - 5 / 1000)


def test_mtbf_per_1000_hosts_scales_with_the_hosts() -> None:
    interval = failure_interval_from_mtbf(3.6864, gpus=98_304, gpus_per_host=8)
    assert interval.total_seconds() == pytest.approx(18 * 60)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"replicas": 0}, "replicas must be at least 1"),
        ({"gpus": 2}, "exceed gpus"),
        ({"gpus": 30}, "do not divide"),
        ({"step_time": timedelta(0)}, "step_time must be positive"),
        ({"detection": timedelta(seconds=-1)}, "detection must not be negative"),
    ],
)
def test_a_model_that_cannot_be_is_refused(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _job(**changes)


def _report() -> dict[str, Any]:
    """The shape of a demo `report.json` (`deploy/demo/report.py`), the keys this reads."""

    def failure(t: float, replica: str | None, **costs: float | None) -> dict[str, Any]:
        return {"t": t, "replica": replica, "mode": "process", "rank": 0, "step": 10,
                "healthy_step": 40, **costs}  # fmt: skip

    return {
        "failures": [
            failure(25.0, "r1", detection_s=0.08, survivor_stall_s=0.06, time_to_healthy_s=13.0),
            failure(50.0, "r0", detection_s=0.10, survivor_stall_s=0.30, time_to_healthy_s=14.1),
            failure(75.0, "r2", detection_s=0.09, survivor_stall_s=0.25, time_to_healthy_s=12.1),
            # A quorum-service restart names no replica; a failure that never healed has None.
            failure(90.0, None, detection_s=None, survivor_stall_s=9.0, time_to_healthy_s=9.5),
            failure(99.0, "r1", detection_s=0.2, survivor_stall_s=None, time_to_healthy_s=None),
        ],
        "effective_training_time": 0.81,
        "summary": {"median_step_s": 0.061},
    }


def test_a_demo_reports_replica_failures_give_the_costs() -> None:
    costs = costs_from_report(_report())
    assert costs.failures == 3
    assert costs.detection.total_seconds() == pytest.approx(0.09)
    assert costs.ring_rebuild.total_seconds() == pytest.approx(0.25 - 0.09)
    assert costs.catch_up.total_seconds() == pytest.approx(13.0 - 0.09)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["simulate", *argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


_FAST = ("--horizon-days", "20", "--runs", "1", "--sweep-intervals-min", "18,60")


def test_paper_preset_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "ett.json"
    code, out, _ = _cli("--paper", *_FAST, "--sweep-replicas", "12", "--json", str(path))
    assert code == 0
    assert "80.0 %" in out and "44.4 %" in out
    assert "at 100K GPUs with fthsdp's measured detection and stall" in out
    numbers = json.loads(path.read_text())
    assert round(100 * numbers["ett"]["ft_closed"]) == 80
    assert round(100 * numbers["ett"]["sync_closed"]) == 44
    assert [(c["replicas"], c["failure_interval_min"]) for c in numbers["sweep"]] == [
        (12, 18.0),
        (12, 60.0),
    ]
    # The 100K line keeps fthsdp's own costs, not the paper's 3 min stall.
    assert numbers["at_100k"]["inputs"]["ring_rebuild_s"] == pytest.approx(0.1)
    assert numbers["at_100k"]["ett"]["ft_closed"] > 0.95


def test_from_report_takes_the_costs_and_a_flag_still_wins(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report()))
    path = tmp_path / "ett.json"
    argv = ("--from-report", str(report), "--catch-up-s", "30", *_FAST, "--json", str(path))
    code, _, _ = _cli(*argv)
    assert code == 0
    inputs = json.loads(path.read_text())["inputs"]
    assert inputs["detection_s"] == pytest.approx(0.09)
    assert inputs["ring_rebuild_s"] == pytest.approx(0.16)
    assert inputs["catch_up_s"] == 30.0
    # The report's time to healthy already holds the process restart: no second one.
    assert inputs["replica_restart_min"] == 0.0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "ett.png"
    code, _, _ = _cli(*_FAST, "--sweep-replicas", "4,12", "--plot", str(path))
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--step-time-s", "0"), "--step-time-s"),
        (("--failure-interval-min", "-5"), "--failure-interval-min"),
        (("--detection-s", "-0.1"), "--detection-s"),
        (("--sync-restart-min", "0"), "--sync-restart-min"),
        (("--horizon-days", "0"), "--horizon-days"),
        (("--replicas", "0"), "--replicas"),
        (("--gpus", "8", "--replicas", "16"), "--replicas: 16 replicas exceed --gpus 8"),
        (("--gpus", "100", "--replicas", "12"), "not divisible by 12"),
        (("--sweep-replicas", "7"), "--sweep-replicas"),
        (("--step-time-s", "soon"), "--step-time-s"),
        (("--from-report", "/nonexistent/report.json"), "--from-report"),
        (("--paper", "--from-report", "r.json"), "not allowed with argument --paper"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_flag(argv: tuple[str, ...], needle: str) -> None:
    code, _, err = _cli(*argv)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err


def test_a_report_without_replica_failures_is_refused(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"failures": []}))
    code, _, err = _cli("--from-report", str(report))
    assert code == 2
    assert "--from-report" in err and "no replica failure" in err
