"""Warm spares (issue 21): a restarted replica takes over rank processes that imported torch and
built the model ahead of time, and falls back to fresh processes when the pool is empty.
Invariants: I1 (identical replicas) and I2 (exactly-once data) through both kinds of restart."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import DemoRunner

pytestmark = [pytest.mark.e2e]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    text = (run_dir / "supervisor.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_kills_faster_than_the_pool_refills_use_spares_then_fresh_processes(
    demo: DemoRunner, tmp_path: Path
) -> None:
    """I1 + I2: 2 spares for replicas of 2 ranks, refilled one at a time, and a rank killed
    every 3 s: the first restarts take spares, later ones find the pool short and start fresh
    processes, with no error; every replica ends identical and no sample is trained twice."""
    run_dir = tmp_path / "run"
    report = demo(
        run_dir=run_dir,
        ranks=2,
        spares=2,
        duration=timedelta(seconds=30),
        kill_every=timedelta(seconds=3),
    )
    assert report["invariants"]["I1"]["ok"], report["invariants"]["I1"]
    assert report["invariants"]["I2"]["ok"], report["invariants"]["I2"]
    assert len({r["fingerprint"] for r in report["replicas"].values()}) == 1
    restarts = [e for e in _events(run_dir) if e["event"] == "restart"]
    assert any(e["spare"] for e in restarts), restarts  # the pool was used...
    assert any(not e["spare"] for e in restarts), restarts  # ...and ran dry: the fallback
    # A spare that took over logs as its replica, in the replica's log.
    taken = next(e["replica"] for e in restarts if e["spare"])
    assert "ftar ring listening" in (run_dir / "logs" / f"{taken}.log").read_text()
    # The pool is emptied at the end: no spare outlives the launcher.
    assert len(sorted((run_dir / "logs").glob("spare-*.log"))) >= 2
    assert _spares_of(run_dir) == {}


def _spares_of(run_dir: Path) -> dict[int, str]:
    """Spare processes of this run still alive (not zombies): pid -> state and command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"--spare" in argv and str(run_dir).encode() in argv and state != "Z":
            found[int(proc.name)] = f"{state} {b' '.join(argv).decode(errors='replace')}"
    return found
