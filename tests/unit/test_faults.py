"""The fault plan's grammar and firing rules (each fault once per job, by its marker file)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fthsdp.worker.faults import SLOW_DEFAULT_S, SLOW_DELAY_S, Fault, FaultPlan, parse_faults


def test_the_grammar_names_replica_rank_step_point_and_seconds() -> None:
    assert parse_faults("r1:0:12:exchange, r1:1:*:hang,r0:0:*:slow_fetch:3") == [
        Fault(replica_id="r1", rank=0, step=12, point="exchange"),
        Fault(replica_id="r1", rank=1, step=None, point="hang"),
        Fault(replica_id="r0", rank=0, step=None, point="slow_fetch", seconds=3.0),
    ]


@pytest.mark.parametrize(
    "spec",
    [
        "r1:0:12",
        "r1:0:12:nowhere",
        "r1:0:12:hang:3",
        "r1:0:12:slow_fetch",
        "r1:x:1:hang",
        "r1:0:12:slow:0",
        "r1:0:12:slow:4000",
    ],
)
def test_a_bad_fault_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_faults(spec)


def test_a_hang_blocks_its_thread_at_its_step_only_and_fires_once(tmp_path: Path) -> None:
    env = {"FTHSDP_FAULTS": "r1:1:5:hang", "FTHSDP_FAULTS_DIR": str(tmp_path)}
    FaultPlan.from_env("r1", 0, env).hang(5)  # another rank: nothing
    plan = FaultPlan.from_env("r1", 1, env)
    plan.hang(4)  # another step: nothing
    assert not list(tmp_path.iterdir())

    thread = threading.Thread(target=plan.hang, args=(5,), daemon=True)
    thread.start()
    marker = tmp_path / "fault-r1-1-5-hang"
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the hang never fired"
        time.sleep(0.01)
    thread.join(0.2)
    assert thread.is_alive(), "a hang returned"
    # A restarted rank (a new plan over the same marker directory) does not hang again.
    FaultPlan.from_env("r1", 1, env).hang(5)


def test_a_slow_fault_lasts_its_seconds_or_the_default() -> None:
    assert parse_faults("r1:0:40:slow,r2:1:*:slow:3") == [
        Fault(replica_id="r1", rank=0, step=40, point="slow", seconds=SLOW_DEFAULT_S),
        Fault(replica_id="r2", rank=1, step=None, point="slow", seconds=3.0),
    ]


def test_a_slow_rank_is_late_from_its_step_for_its_seconds_once(tmp_path: Path) -> None:
    env = {"FTHSDP_FAULTS": "r1:0:40:slow:5", "FTHSDP_FAULTS_DIR": str(tmp_path)}
    assert FaultPlan.from_env("r1", 1, env).slow_delay(40, 100.0) == 0.0  # another rank
    plan = FaultPlan.from_env("r1", 0, env)
    assert plan.slow_delay(39, 99.0) == 0.0  # before its step
    assert plan.slow_delay(40, 100.0) == SLOW_DELAY_S
    assert (tmp_path / "fault-r1-0-40-slow").exists()
    # Every later step while the period lasts, whatever their numbers.
    assert plan.slow_delay(41, 102.0) == SLOW_DELAY_S
    assert plan.slow_delay(41, 104.9) == SLOW_DELAY_S
    assert plan.slow_delay(50, 105.1) == 0.0
    # A restarted rank that reaches the step again is not slowed again.
    assert FaultPlan.from_env("r1", 0, env).slow_delay(40, 200.0) == 0.0


def test_a_slow_rank_sleeps_its_delay() -> None:
    plan = FaultPlan(parse_faults("r1:0:*:slow:30"), None)
    started = time.monotonic()
    plan.slow(7)
    assert time.monotonic() - started >= SLOW_DELAY_S
