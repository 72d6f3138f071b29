"""bench.rca_live's matching of health incidents to injected faults, on hand-made reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fthsdp.bench import rca_live
from fthsdp.bench.rca_live import InjectedFault, match, planned_faults, score_run, summarise

T0 = 1_000_000.0


def _incident(kind: str, replica: str, rank: int | None, t: float) -> dict[str, Any]:
    return {
        "kind": kind,
        "replica_id": replica,
        "rank": rank,
        "host": replica,
        "detected_at": T0 + t,
        "summary": f"{kind} {replica}:{rank}",
        "evidence": {"t": t},
    }


def _failure(mode: str, replica: str | None, rank: int | None, t: float) -> dict[str, Any]:
    return {"t": t, "replica": replica, "mode": mode, "rank": rank, "detection_s": None}


def _report(failures: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "failures": failures,
        "incidents": incidents,
        "summary": {"possible_replica_steps": 2000},
    }


def test_a_killed_rank_is_detected_and_its_replicas_other_rank_follows_on() -> None:
    report = _report(
        [_failure("process", "r1", 0, 10.0)],
        [_incident("fail_stop", "r1", 1, 10.8), _incident("fail_stop", "r1", 0, 10.9)],
    )
    scored = score_run(report, t0=T0, planned=[])
    (fault,) = scored["faults"]
    assert fault["detected"] and fault["detected_as"] == "fail_stop"
    assert fault["latency_s"] == pytest.approx(0.9)  # rank 0's incident, not rank 1's
    assert [m["rank"] for m in fault["matched"]] == [1, 0]
    assert scored["false_alarms"] == []


def test_an_incident_long_after_the_fault_is_a_false_alarm_and_the_fault_missed() -> None:
    report = _report(
        [_failure("replica", "r2", None, 10.0)],
        [_incident("fail_stop", "r2", 0, 10.0 + rca_live.WINDOW_S + 1)],
    )
    scored = score_run(report, t0=T0, planned=[])
    assert not scored["faults"][0]["detected"]
    (alarm,) = scored["false_alarms"]
    assert alarm["kind"] == "fail_stop" and alarm["replica"] == "r2"
    assert alarm["since_last_fault_s"] == pytest.approx(rca_live.WINDOW_S + 1)
    assert alarm["last_fault"] == "replica r2"


def test_a_wrong_culprit_is_a_false_alarm_and_the_fault_missed() -> None:
    slow = InjectedFault(kind="slow_point", replica="r1", rank=0, t=T0 + 5.0)
    verdict = match(
        [slow],
        [
            _incident("slow_rank", "r2", 0, 8.0),  # another replica
            _incident("slow_rank", "r1", 1, 9.0),  # the right replica, another rank: it lives on
        ],
    )
    assert verdict.faults[0].detected_by is None and verdict.faults[0].matched == []
    assert verdict.false_alarms == [0, 1]


def test_a_replica_level_culprit_names_a_slow_rank_and_fail_slow_of_it_follows_on() -> None:
    slow = InjectedFault(kind="slow_point", replica="r1", rank=0, t=T0 + 5.0)
    verdict = match(
        [slow], [_incident("fail_slow", "r1", None, 7.0), _incident("slow_rank", "r1", None, 9.0)]
    )
    assert verdict.faults[0].detected_by == 1
    assert verdict.faults[0].matched == [0, 1]
    assert verdict.false_alarms == []


def test_a_kind_the_fault_does_not_explain_is_a_false_alarm() -> None:
    throttled = InjectedFault(kind="slow", replica="r0", rank=None, t=T0 + 20.0)
    verdict = match([throttled], [_incident("fail_stop", "r0", 1, 22.0)])
    assert verdict.faults[0].detected_by is None
    assert verdict.false_alarms == [0]


def test_an_incident_goes_to_the_fault_it_detects_then_to_the_latest() -> None:
    kill = InjectedFault(kind="process", replica="r1", rank=1, t=T0 + 10.0)
    hang = InjectedFault(kind="hang_point", replica="r1", rank=0, t=T0 + 12.0)
    # fail_stop of rank 1 detects the kill; it only follows from the hang (a teardown).
    # The hang of rank 0 detects only the hang point.
    verdict = match(
        [kill, hang], [_incident("fail_stop", "r1", 1, 12.5), _incident("hang", "r1", 0, 15.2)]
    )
    assert verdict.faults[0].detected_by == 0 and verdict.faults[0].matched == [0]
    assert verdict.faults[1].detected_by == 1 and verdict.faults[1].matched == [1]
    assert verdict.false_alarms == []


def test_planned_faults_come_from_their_markers_and_join_the_injected(tmp_path: Path) -> None:
    for name in ("fault-r1-0-60-slow", "fault-r2-1-480-hang", "fault-r0-0-any-exchange"):
        (tmp_path / name).touch()
    planned = {(f.kind, f.replica, f.rank) for f in planned_faults(tmp_path)}
    assert planned == {("slow_point", "r1", 0), ("hang_point", "r2", 1)}
    hang = InjectedFault(kind="hang_point", replica="r2", rank=1, t=T0 + 30.0)
    report = _report(
        [_failure("slow", "r0", None, 10.0), _failure("quorum", None, None, 20.0)],
        [_incident("fail_slow", "r0", None, 13.0), _incident("hang", "r2", 1, 33.2)],
    )
    scored = score_run(report, t0=T0, planned=[hang])
    assert [(f["kind"], f["t"], f["detected"]) for f in scored["faults"]] == [
        ("slow", 10.0, True),
        ("hang_point", 30.0, True),
    ]


def test_the_summary_counts_recall_precision_and_false_alarms_per_1000_steps() -> None:
    runs = [
        score_run(
            _report(
                [_failure("process", "r1", 0, 10.0), _failure("hang", "r2", 1, 30.0)],
                [
                    _incident("fail_stop", "r1", 0, 10.8),
                    _incident("fail_stop", "r1", 1, 10.8),
                    _incident("fail_slow", "r0", None, 20.0),
                ],
            ),
            t0=T0,
            planned=[],
        )
    ]
    summary = summarise(runs)
    total = summary["total"]
    assert (total["injected"], total["detected"], total["missed"]) == (2, 1, 1)
    assert total["recall"] == 0.5
    assert total["incidents"] == 3 and total["false_alarms"] == 1
    assert total["precision"] == pytest.approx(2 / 3, abs=1e-3)
    assert total["false_alarms_per_1000_steps"] == 0.5  # 1 in 2000 replica-steps
    assert summary["per_kind"]["process"]["recall"] == 1.0
    assert summary["per_kind"]["hang"]["missed"] == 1
    assert summary["per_kind"]["slow"]["recall"] is None  # none injected


def test_the_schedule_covers_every_kind_in_four_runs() -> None:
    args = rca_live.parse_args(["--duration", "40"])
    modes, points = set(), set()
    for run in range(4):
        mode, spec = rca_live.schedule(run, args)
        modes.add(mode)
        early, late = (entry.split(":") for entry in spec.split(","))
        points |= {early[3], late[3]}
        assert int(early[2]) < int(late[2])
        if mode == "slow":  # a throttle right after a slow rank of its replica: one episode
            assert early[3] == "hang"
    assert modes == {"process", "replica", "hang", "slow"}
    assert points == {"hang", "slow"}
    # Two injections before the demo's quiet last stretch of 10 s.
    assert 2 * rca_live.kill_every(40) < 30 < 3 * rca_live.kill_every(40)


def test_a_throttle_right_after_the_same_replicas_last_one_is_the_same_fault() -> None:
    period = rca_live.SLOW_PERIOD_S
    report = _report(
        [
            _failure("slow", "r1", None, 10.0),
            _failure("slow", "r1", None, 10.0 + period + 0.1),  # back to back: one episode
            _failure("slow", "r1", None, 10.0 + 3 * period),  # after a normal stretch
        ],
        [_incident("fail_slow", "r1", None, 12.0), _incident("fail_slow", "r1", None, 48.0)],
    )
    scored = score_run(report, t0=T0, planned=[])
    assert [(f["t"], f["detected"]) for f in scored["faults"]] == [
        (10.0, True),
        (10.0 + 3 * period, True),
    ]
    assert scored["merged_throttles"] == 1


def test_the_bench_knows_the_supervisors_throttle_period() -> None:
    from fthsdp.deploy.demo.supervisor import SLOW_PERIOD_S

    assert rca_live.SLOW_PERIOD_S == SLOW_PERIOD_S


def test_a_slow_faults_detection_must_come_while_it_lasts_or_just_after() -> None:
    slow = InjectedFault(kind="slow_point", replica="r1", rank=0, t=T0 + 5.0, until=T0 + 13.0)
    late = 13.0 + rca_live.SLOW_LAG_S + 1  # inside the window, long after the slowness ended
    verdict = match(
        [slow], [_incident("slow_rank", "r1", 0, 9.0), _incident("fail_slow", "r1", None, late)]
    )
    assert verdict.faults[0].detected_by == 0 and verdict.faults[0].matched == [0]
    assert verdict.false_alarms == [1]


def test_a_fault_whose_replica_a_later_fault_took_down_first_is_cut_short_not_missed() -> None:
    slow = InjectedFault(kind="slow_point", replica="r2", rank=1, t=T0 + 29.0, until=T0 + 37.0)
    report = _report(
        [_failure("replica", "r2", None, 31.0)],
        [_incident("fail_stop", "r2", 0, 32.0), _incident("fail_stop", "r2", 1, 32.0)],
    )
    scored = score_run(report, t0=T0, planned=[slow])
    by_kind = {f["kind"]: f for f in scored["faults"]}
    assert by_kind["slow_point"]["cut_short_by"] == "replica r2 at 31.0"
    assert by_kind["replica"]["detected"] and by_kind["replica"]["cut_short_by"] is None
    total = summarise([scored])["total"]
    assert (total["injected"], total["cut_short"], total["detected"], total["missed"]) == (
        2,
        1,
        1,
        0,
    )
    assert total["recall"] == 1.0
