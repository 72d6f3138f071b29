"""The control plane failing under a running job: a leader and a standby quorum service on a
real redis-server, the leader SIGKILLed while replicas train (the health service naming real
rank deaths is checked with the kills of test_demo_failures.py). Invariants: I1 (identical
replicas), I2 (exactly-once data), I3 (quorum ids never go back), I5 (nothing committed is
lost when the quorum leader dies)."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import DemoRunner

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


def _assert_i1_i2(report: dict[str, Any]) -> None:
    assert report["invariants"]["I1"]["ok"], report["invariants"]["I1"]
    assert report["invariants"]["I2"]["ok"], report["invariants"]["I2"]
    assert len({r["fingerprint"] for r in report["replicas"].values()}) == 1


def _lines(run_dir: Path, name: str) -> list[dict[str, Any]]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killing_the_quorum_leader_loses_nothing_and_training_goes_on(
    demo: DemoRunner, tmp_path: Path
) -> None:
    """I5 + I3: each leader kill is survived without a single replica restart or rejoin (the
    standby restores membership and incarnations from Redis), quorum ids never go back, and
    steps commit on the previous quorum while no leader exists (the Manager's fallback), with
    identical replicas and exactly-once data (I1, I2)."""
    run_dir = tmp_path / "run"
    report = demo(
        run_dir=run_dir,
        redis=True,
        kill_mode="quorum",
        duration=timedelta(seconds=20),
        kill_every=timedelta(seconds=6),
    )
    _assert_i1_i2(report)
    assert len(report["failures"]) >= 2
    events = _lines(run_dir, "supervisor.jsonl")
    assert [e for e in events if e["event"] == "restart"] == []  # no replica was lost
    ids = [q[2] for q in report["series"]["healthy"]]
    assert ids == sorted(ids), ids
    fallback = [
        c
        for replica in report["replicas"]
        for c in _lines(run_dir, f"replicas/{replica}.jsonl")
        if c.get("event") == "commit" and c.get("without_control_plane")
    ]
    assert fallback, "no step committed while the quorum service had no leader"
    # Committed steps are never lost: each replica's commits only move forward, one step at a
    # time, except where it caught up from its peers (a replica that lost a race between going
    # on without the service and reaching the new leader is left behind once, then catches up).
    for replica in report["replicas"]:
        commits = [
            c for c in _lines(run_dir, f"replicas/{replica}.jsonl") if c.get("event") == "commit"
        ]
        for before, after in itertools.pairwise(commits):
            assert after["step"] == before["step"] + 1 or after["recovered"], (before, after)
