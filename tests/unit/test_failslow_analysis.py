"""bench.failslow_analysis on small synthetic run directories: commit lines written to tmp_path
and read back through `RunLog.load`, as the benchmark reads a real run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from fthsdp.bench.failslow_analysis import (
    Segment,
    Span,
    StepRecord,
    changes,
    compare,
    decisions_in,
    first_commits,
    flap_verdict,
    is_even,
    job_rate,
    measure,
    own_work,
    planner_decisions,
    speed,
    victim_held_back,
)
from fthsdp.deploy.demo.events import RunLog

Shares = Mapping[str, tuple[int, int]]


def _commit(
    replica: str,
    step: int,
    t: float,
    trained: Shares,
    *,
    seconds: Mapping[str, float] | None = None,
    recovered: bool = False,
) -> dict[str, Any]:
    """One commit line as a replica leader writes it."""
    return {
        "event": "commit",
        "t": t,
        "replica": replica,
        "step": step,
        "quorum_id": 1,
        "healthy": sorted(trained),
        "recovered": recovered,
        "trained": {r: [a, b] for r, (a, b) in trained.items()},
        "loss": None if recovered else 1.0,
        "tokens": 0,
        "attempts": 1,
        "seconds": dict(seconds or {}),
    }


def _run(tmp_path: Path, lines: Iterable[Mapping[str, Any]]) -> RunLog:
    """Writes the lines into each replica's `replicas/<r>.jsonl` and loads the run directory."""
    by_replica: dict[str, list[str]] = {}
    for line in lines:
        by_replica.setdefault(line["replica"], []).append(json.dumps(line))
    (tmp_path / "replicas").mkdir(parents=True)
    for replica, texts in by_replica.items():
        (tmp_path / "replicas" / f"{replica}.jsonl").write_text("\n".join(texts) + "\n")
    return RunLog.load(tmp_path)


def _span(name: str, kind: str, factor: float, t0: float, t1: float, **kw: Any) -> Span:
    segment = Segment(name=name, kind=kind, factor=factor, seconds=t1 - t0, **kw)
    return Span(segment=segment, t0=t0, t1=t1)


EVEN2: Shares = {"r0": (0, 4), "r1": (4, 8)}
SKEWED2: Shares = {"r0": (0, 6), "r1": (6, 8)}


# ---------------------------------------------------------------------------------------------
# Samples/s and own speeds


def test_samples_per_s_counts_each_committed_step_once_at_its_first_commit(
    tmp_path: Path,
) -> None:
    trained = {"r0": (0, 4), "r1": (4, 8), "r2": (8, 12)}
    lines = []
    for step, t in [(1, 11.0), (2, 12.0), (3, 13.2), (4, 14.0)]:
        lines += [_commit(r, step, t + 0.3, trained) for r in ("r1", "r2")]
        lines.append(_commit("r0", step, t, trained))
    # r1 committed step 3 first, before r0: its line, not r0's, places the step.
    lines[4] = _commit("r1", 3, 12.95, trained)
    steps = first_commits(_run(tmp_path, lines))

    assert [(s.step, s.t) for s in steps] == [(1, 11.0), (2, 12.0), (3, 12.95), (4, 14.0)]
    assert all(s.samples == 12 for s in steps)  # every contributor's range, not the logger's
    # Steps 1, 2 and 3 (first committed at 12.95) in [11, 13): 36 samples over 2 s, although
    # every step has three commit lines.
    assert job_rate(steps, 11.0, 13.0) == pytest.approx(18.0)
    assert job_rate(steps, 13.0, 15.0) == pytest.approx(6.0)
    assert job_rate(steps, 13.0, 13.0) is None


def test_own_work_is_the_commit_interval_less_the_exchange_phases(tmp_path: Path) -> None:
    waits = {"quorum": 0.3, "ring": 0.2, "exchange": 0.1, "total": 1.9}
    lines = [
        _commit("r0", 1, 0.0, EVEN2),
        _commit("r0", 2, 2.0, EVEN2, seconds=waits),  # 2.0 - 0.6 of waiting on the others
        _commit("r0", 3, 3.0, EVEN2, recovered=True),  # caught up from peers: not its compute
        _commit("r0", 5, 5.0, EVEN2),  # a step missing in between (a restart)
        _commit("r0", 6, 7.5, EVEN2, seconds={"compute": 0.5, "quorum": 2.0}),
        _commit("r0", 7, 8.0, {"r1": (0, 8)}),  # r0 contributed nothing
    ]
    work = own_work(_run(tmp_path, lines), "r0")

    assert [(w.t, w.samples) for w in work] == [(2.0, 4), (7.5, 4)]
    assert work[0].compute_s == pytest.approx(1.4)
    assert work[1].compute_s == pytest.approx(0.5)  # the reported compute, not the interval
    assert speed(work, 0.0, 10.0) == pytest.approx(8 / 1.9)
    assert speed(work, 2.5, 7.0) is None


# ---------------------------------------------------------------------------------------------
# One run measured: f', retained, ideal (direct), reaction, changes


def _throttled_run(tmp_path: Path) -> tuple[RunLog, list[Span]]:
    """Two replicas, r1 throttled 2x from t=112 to 132: its compute goes from 0.1 s to 0.25 s
    per sample and steps from one a second to one every two; the planner moves two of r1's four
    samples to r0 at t=114.5 and back to even at t=132.5. r0 computes 0.1 s per sample
    throughout; r1 logs every step 0.2 s after r0."""
    times = [100.5 + i for i in range(20)] + [120.5 + 2 * i for i in range(6)]
    times += [132.5 + i for i in range(8)]
    lines = []
    for step, t in enumerate(times, start=1):
        trained = SKEWED2 if 114.5 <= t < 132 else EVEN2
        for replica, at in (("r0", t), ("r1", t + 0.2)):
            start, end = trained[replica]
            per_sample = 0.25 if replica == "r1" and 112 <= at < 132 else 0.1
            seconds = {"compute": per_sample * (end - start), "quorum": 0.05}
            lines.append(_commit(replica, step, at, trained, seconds=seconds))
    spans = [
        _span("unthrottled", "base", 1.0, 100.0, 112.0, windows=3),
        _span("settle 2x", "settle", 2.0, 112.0, 120.0),
        _span("slow 2x", "slow", 2.0, 120.0, 132.0, windows=3),
        _span("recover 2x", "recover", 1.0, 132.0, 140.0, windows=1, skip_s=4.0),
    ]
    return _run(tmp_path, lines), spans


def test_measure_reads_fprime_retained_ideal_and_reaction_from_commit_lines(
    tmp_path: Path,
) -> None:
    log, spans = _throttled_run(tmp_path)
    out = measure(log, spans, "r1", ["r0", "r1"])

    base = out["base"]
    assert [(w["t0"], w["t1"]) for w in base["windows"]] == [(100, 104), (104, 108), (108, 112)]
    assert base["samples_per_s"] == pytest.approx(8.0)  # 8 samples a second, each step once
    assert base["victim_s_per_sample"] == pytest.approx(0.1)
    assert base["capacity"] == pytest.approx(20.0)  # 10 + 10 samples per second of compute

    slow = out["slow"]["2"]
    assert slow["samples_per_s"] == pytest.approx(4.0)
    assert slow["windows"][0]["speeds"] == {"r0": pytest.approx(10.0), "r1": pytest.approx(4.0)}
    # References: the unthrottled windows before and the recovery's second half after.
    assert slow["reference"] == {
        "samples_per_s": pytest.approx(8.0),
        "victim_s_per_sample": pytest.approx(0.1),
        "capacity": pytest.approx(20.0),
    }
    assert slow["retained"] == pytest.approx(0.5)
    assert slow["achieved_slowdown"] == pytest.approx(2.5)  # 0.25 / 0.1 s per sample
    assert slow["ideal_direct"] == pytest.approx(14 / 20)
    assert slow["reaction_s"] == pytest.approx(2.5)  # from the settle's start at 112
    assert slow["changes"] == 1  # even -> skewed; back to even happens after the segment
    assert out["changes_total"] == 2
    assert out["flaps"] == []


def test_compare_takes_fprime_from_the_off_run_and_derives_the_ideal() -> None:
    def row(retained: float, achieved: float | None) -> dict[str, Any]:
        return {
            "samples_per_s": 100 * retained,
            "retained": retained,
            "achieved_slowdown": achieved,
            "ideal_direct": 0.75,
            "reaction_s": None,
        }

    runs = {"off": {"slow": {"2": row(0.5, 2.5)}}, "auto": {"slow": {"2": row(0.9, 1.6)}}}
    auto = compare(runs, replicas=3)["2"]["auto"]

    assert auto["achieved_slowdown"] == pytest.approx(2.5)  # off's, not auto's own 1.6
    assert (auto["achieved_from"], auto["own_victim_slowdown"]) == ("off", 1.6)
    assert auto["ideal"] == pytest.approx((2 + 1 / 2.5) / 3)
    assert auto["vs_off"] == pytest.approx(1.8)
    assert auto["vs_ideal"] == pytest.approx(0.9 / 0.8)
    assert auto["vs_ideal_direct"] == pytest.approx(1.2)

    # Without an off run: a run's own f', else the median of the others'.
    alone = compare({"auto": runs["auto"], "evict": {"slow": {"2": row(0.7, None)}}}, 3)["2"]
    assert (alone["auto"]["achieved_slowdown"], alone["auto"]["achieved_from"]) == (1.6, "own")
    assert alone["evict"]["achieved_from"] == "other runs"
    assert alone["evict"]["achieved_slowdown"] == pytest.approx(1.6)
    assert alone["evict"]["vs_off"] is None


# ---------------------------------------------------------------------------------------------
# Assignment changes and thrashing


def _record(step: int, **shares: int) -> StepRecord:
    trained, at = {}, 0
    for replica, n in shares.items():
        trained[replica] = (at, at + n)
        at += n
    return StepRecord(step, float(step), trained)


def test_changes_count_each_step_whose_assignment_differs_from_the_previous() -> None:
    steps = [
        _record(1, r0=4, r1=4, r2=4),
        _record(2, r0=4, r1=4, r2=4),
        _record(3, r0=5, r1=5, r2=2),  # rebalanced
        _record(4, r0=5, r1=5, r2=2),
        _record(5, r0=6, r1=6),  # r2 evicted: membership counts
        _record(6, r0=4, r1=4, r2=4),  # r2 back
        _record(7, r0=4, r1=4, r2=4),
    ]
    assert [c["step"] for c in changes(steps, 0.0, 10.0)] == [3, 5, 6]
    assert changes(steps, 0.0, 10.0)[1]["shares"] == {"r0": 6, "r1": 6}
    # Step 3 compares with step 2 although step 2 lies before the window.
    assert [c["step"] for c in changes(steps, 3.0, 5.0)] == [3]
    assert is_even(steps[0].shares, 3) and not is_even(steps[2].shares, 3)
    assert not is_even(steps[4].shares, 3)  # equal shares, but a replica is missing
    assert victim_held_back(steps[2].shares, "r2") and victim_held_back(steps[4].shares, "r2")
    assert not victim_held_back(steps[2].shares, "r0")  # more than the others' mean
    assert not victim_held_back(steps[0].shares, "r2")


EVEN3: Shares = {"r0": (0, 4), "r1": (4, 8), "r2": (8, 12)}
A3: Shares = {"r0": (0, 5), "r1": (5, 10), "r2": (10, 12)}
B3: Shares = {"r0": (0, 6), "r1": (6, 9), "r2": (9, 12)}
FLAPS = [
    _span("on 1", "flap-on", 2.0, 200.0, 206.0, windows=1),
    _span("off 1", "flap-off", 1.0, 206.0, 212.0, windows=1),
    _span("tail", "tail", 1.0, 212.0, 218.0, windows=1),
]


def _flap_run(
    tmp_path: Path, assignments: list[Shares], epoch: float = 0.0
) -> list[dict[str, Any]]:
    lines = [_commit("r0", i + 1, epoch + 200.5 + i, a) for i, a in enumerate(assignments)]
    spans = [dataclasses.replace(s, t0=s.t0 + epoch, t1=s.t1 + epoch) for s in FLAPS]
    return measure(_run(tmp_path, lines), spans, "r2", ["r0", "r1", "r2"])["flaps"]


def test_flaps_thrashing_when_the_assignment_moves_again_once_even(tmp_path: Path) -> None:
    # on: 200.5..205.5; off: 206.5..211.5; tail: 212.5..217.5
    flaps = _flap_run(
        tmp_path,
        [EVEN3, A3, A3, A3, A3, A3]
        + [A3, EVEN3, EVEN3, B3, EVEN3, EVEN3]  # even at 207.5, then B3 and back: 2 more
        + [A3] * 6,  # the tail never gets back to even
    )
    off, tail = flaps[1], flaps[2]

    assert [seg["name"] for seg in flaps] == ["on 1", "off 1", "tail"]
    assert len(flaps[0]["changes"]) == 1 and "even_after_s" not in flaps[0]
    assert flaps[0]["samples_per_s"] == pytest.approx(12.0)
    assert [c["step"] for c in off["changes"]] == [8, 10, 11]
    assert off["even_after_s"] == pytest.approx(1.5)
    assert off["changes_once_even"] == 2
    assert tail["even_after_s"] is None and tail["changes_once_even"] is None
    assert flap_verdict(flaps) == (True, True)


def test_flaps_no_thrashing_when_the_assignment_stays_even(tmp_path: Path) -> None:
    flaps = _flap_run(tmp_path, [A3] * 6 + [A3, A3] + [EVEN3] * 10)
    off, tail = flaps[1], flaps[2]

    assert off["even_after_s"] == pytest.approx(2.5)
    assert off["changes_once_even"] == 0
    assert tail["even_after_s"] == pytest.approx(0.5)
    assert tail["changes_once_even"] == 0
    assert flap_verdict(flaps) == (False, False)


def test_flaps_at_wall_clock_times_count_the_return_to_even_once(tmp_path: Path) -> None:
    """Commit lines carry Unix times (~1.8e9 s), where a float's resolution is ~0.2 us."""
    flaps = _flap_run(tmp_path, [A3] * 6 + [A3, A3] + [EVEN3] * 10, epoch=1_796_657_000.0)
    assert flaps[1]["changes_once_even"] == 0 and flaps[2]["changes_once_even"] == 0
    assert flap_verdict(flaps) == (False, False)


# ---------------------------------------------------------------------------------------------
# The planner's decisions in `fthsdp status --json`


def test_planner_decisions_finds_every_action_wherever_it_sits() -> None:
    status = {
        "quorum": {
            "failslow": {"decisions": [{"action": "rebalance", "shares": {"r0": 5}}, {"a": 1}]},
            "quorums": [{"quorum_id": 3, "action": 7}],  # not a decision: action is no string
        },
        "last": {"action": "evict", "inner": {"action": "keep"}},
    }
    found = planner_decisions(status)

    assert [d["action"] for d in found] == ["rebalance", "evict"]
    assert found[1]["inner"] == {"action": "keep"}  # a decision is taken whole
    assert planner_decisions([{"action": "keep"}, "x", 3]) == [{"action": "keep"}]


def test_decisions_in_counts_by_decided_at_unix_or_iso() -> None:
    decisions = [
        {"action": "keep", "decided_at": 5.0},
        {"action": "rebalance", "decided_at": "1970-01-01T00:00:07+00:00"},
        {"action": "evict", "decided_at": 6},
        {"action": "keep", "decided_at": "yesterday"},
        {"action": "keep"},
    ]
    assert decisions_in(decisions, 0.0, 6.0) == 1  # [t0, t1): 6 is not in it
    assert decisions_in(decisions, 6.0, 8.0) == 2
    assert decisions_in(decisions, 0.0, 100.0) == 3
