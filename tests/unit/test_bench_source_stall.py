"""`bench.source_stall`'s reading of a run: which steps a rejoin cost its sources, and how much."""

from __future__ import annotations

import pytest

from fthsdp.bench import source_stall
from fthsdp.deploy.demo.events import CommitEvent, RunLog, StartEvent

STEP_S = 0.02


def commit(
    replica: str,
    step: int,
    t: float,
    *,
    quorum_id: int = 1,
    recovered: bool = False,
    **seconds: float,
) -> CommitEvent:
    return CommitEvent(
        t=t,
        replica=replica,
        step=step,
        quorum_id=quorum_id,
        healthy=("r0", "r1"),
        recovered=recovered,
        trained={},
        loss=None,
        tokens=0,
        attempts=1,
        seconds=seconds,
    )


def steady(replica: str, steps: range, t0: float, quorum_id: int = 1) -> list[CommitEvent]:
    return [commit(replica, s, t0 + (s - steps.start) * STEP_S, quorum_id=quorum_id) for s in steps]


def test_a_rejoin_costs_its_source_the_publish_and_the_wait_for_the_catch_up() -> None:
    # r0 trains steps 0..29; r1 restarts and catches up in step 10 (quorum 2). r0 publishes for
    # 0.5 s in step 10, then waits 1.0 s at step 11's quorum for r1 to fetch and load.
    r0 = steady("r0", range(10), 0.0)
    r0.append(commit("r0", 10, r0[-1].t + STEP_S + 0.5, quorum_id=2, serve=0.5))
    r0.append(commit("r0", 11, r0[-1].t + STEP_S + 1.0, quorum_id=2, quorum=1.0))
    r0 += steady("r0", range(12, 30), r0[-1].t + STEP_S, quorum_id=2)
    fetch_end = r0[10].t + 0.8
    r1: list[StartEvent | CommitEvent] = [StartEvent(replica="r1", step=0, t=fetch_end - 5)]
    r1.append(commit("r1", 10, fetch_end + 0.1, quorum_id=2, recovered=True, fetch=0.6, commit=0.1))
    r1 += steady("r1", range(11, 30), r0[11].t, quorum_id=2)
    log = RunLog()
    log.add(r0)
    log.add(r1)
    (rejoin,) = source_stall.catch_ups(log)
    assert (rejoin.replica, rejoin.step, rejoin.catch_ups, rejoin.stayed) == ("r1", 10, 1, True)
    assert rejoin.sources == ("r0",)
    assert rejoin.publish_s == (0.5,) and rejoin.next_quorum_s == (1.0,)
    assert rejoin.lost_s[0] == pytest.approx(1.5)
    assert (rejoin.fetch_s, rejoin.load_s) == (0.6, 0.1)
    assert rejoin.while_serving_steps == 0 and rejoin.while_serving_ratio is None
    summary = source_stall.summarise([rejoin], STEP_S)
    assert summary["rejoins"] == summary["catch_ups"] == 1
    assert summary["lost_s"] == pytest.approx(1.5)


def test_a_catch_up_that_fell_behind_is_followed_by_the_one_that_stayed() -> None:
    # r1 catches up at step 5, misses step 6's round (too slow) and catches up again at 8.
    r0 = steady("r0", range(12), 0.0)
    r0[5] = commit("r0", 5, r0[5].t, serve=0.2)
    r0[8] = commit("r0", 8, r0[8].t, serve=0.2)
    r1: list[StartEvent | CommitEvent] = [StartEvent(replica="r1", step=0, t=0.0)]
    r1.append(commit("r1", 5, r0[7].t + 0.001, recovered=True))  # r0 trained 6, 7 meanwhile
    r1.append(commit("r1", 8, r0[8].t, recovered=True))
    r1 += steady("r1", range(9, 12), r0[9].t)
    log = RunLog()
    log.add(r0)
    log.add(r1)
    missed, rejoin = source_stall.catch_ups(log)
    assert (missed.step, missed.stayed, missed.catch_ups) == (5, False, 1)
    assert (rejoin.step, rejoin.stayed, rejoin.catch_ups) == (8, True, 2)
    # Step 6 waited at the quorum; step 7 is the one trained while r0's sidecar still served.
    assert missed.while_serving_steps == 1
    assert missed.while_serving_ratio == pytest.approx(1.0)
    summary = source_stall.summarise([missed, rejoin], STEP_S)
    assert (summary["rejoins"], summary["catch_ups"], summary["catch_ups_max"]) == (1, 2, 2)


def test_bad_flags_are_refused() -> None:
    for argv in (["--state-pad-mb", "0"], ["--replicas", "1"], ["--kill-every-s", "0"]):
        with pytest.raises(SystemExit):
            source_stall.parse_args(argv)
