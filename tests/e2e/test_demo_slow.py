"""The `slow` kill mode: a replica throttled by SIGSTOP/SIGCONT is named fail-slow, lives on, and
no process is left stopped (real processes, real signals)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.deploy.demo.events import ExitEvent, InjectEvent, RestartEvent, RunLog
from fthsdp.deploy.demo.supervisor import SLOW_PERIOD_S, Throttle
from tests.e2e.conftest import DemoRunner

pytestmark = [pytest.mark.e2e]


def _state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _assert_continued(pid: int) -> None:
    """The process leaves the stopped state (the kernel delivers the SIGCONT at once; the
    deadline only bounds a broken throttle's failure)."""
    deadline = time.monotonic() + 5.0
    while _state(pid) == "T":
        assert time.monotonic() < deadline, "the process was left stopped"
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_a_throttle_stops_and_continues_and_always_leaves_the_process_running() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        throttle = Throttle([proc], period_s=30.0, cycle_s=0.2, stopped_fraction=0.5)
        throttle.start()
        seen = set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            seen.add(_state(proc.pid))
            time.sleep(0.01)
        assert "T" in seen and seen - {"T"}, seen  # stopped, and running in between
        assert throttle.active
        throttle.stop()  # mid-period: the teardown or shutdown path
        assert not throttle.active
        _assert_continued(proc.pid)
        # A period that runs out continues the process too.
        short = Throttle([proc], period_s=0.3, cycle_s=0.1, stopped_fraction=0.9)
        short.start()
        deadline = time.monotonic() + 5.0
        while short.active:
            assert time.monotonic() < deadline, "the throttle outlived its period"
            time.sleep(0.02)
        _assert_continued(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(300)
def test_a_throttled_replica_is_named_fail_slow_and_nothing_is_left_stopped(
    demo: DemoRunner, tmp_path: Path
) -> None:
    report = demo(duration=timedelta(seconds=25), kill_every=timedelta(seconds=8), kill_mode="slow")
    log = RunLog.load(tmp_path / "run")
    injects = [e for e in log.of_type(InjectEvent) if e.mode == "slow"]
    assert injects, "no throttle was injected"
    named = [
        (inject.replica, incident)
        for inject in injects
        for incident in report["incidents"]
        if incident["kind"] == "fail_slow"
        and incident["replica_id"] == inject.replica
        and inject.t <= incident["detected_at"] <= inject.t + SLOW_PERIOD_S + 3
    ]
    assert named, (injects, report["incidents"])
    # Slow, never dead: no rank missed its beats nor exited, no replica restarted.
    assert not [i for i in report["incidents"] if i["kind"] in ("fail_stop", "hang")]
    assert not log.of_type(RestartEvent)
    # Every rank was running (not stopped) when the end came: each exited cleanly by itself,
    # where a stopped one would have ignored SIGTERM and been SIGKILLed after the grace.
    exits = log.of_type(ExitEvent)
    assert len(exits) == 3 and all(e.code == 0 for e in exits), exits
    assert report["invariants"]["I1"]["ok"], report["invariants"]["I1"]
