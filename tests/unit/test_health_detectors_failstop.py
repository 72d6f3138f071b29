"""Fail-stop: missed heartbeats, on a fake clock."""

from __future__ import annotations

import pytest

from fthsdp.services.health.detectors.failstop import FailStopDetector
from fthsdp.services.health.telemetry import Heartbeat, IncidentKind, RankId

A = RankId(replica_id="r0", rank=0)
B = RankId(replica_id="r1", rank=3)


def _hb(rank: RankId, at: float, step: int = 5) -> Heartbeat:
    return Heartbeat(rank=rank, host=f"host-{rank.replica_id}", step=step, at=at)


def test_a_silent_rank_is_named_once_until_it_beats_again() -> None:
    det = FailStopDetector(timeout_s=1.0)
    det.beat(_hb(A, 10.0))
    det.beat(_hb(B, 10.0))
    assert det.check(10.9) == []
    det.beat(_hb(B, 10.8))
    found = det.check(11.5)
    assert [(i.kind, i.replica_id, i.rank, i.host) for i in found] == [
        (IncidentKind.FAIL_STOP, "r0", 0, "host-r0")
    ]
    assert found[0].evidence["last_step"] == 5
    assert [i.rank for i in det.check(12.0)] == [3]  # B's beat at 10.8 is now 1.2 s old
    assert det.check(12.05) == []  # A and B are each reported once
    det.beat(_hb(A, 12.1))
    assert det.check(12.2) == []
    assert [i.rank for i in det.check(13.5)] == [0]


def test_ranks_of_one_replica_that_stopped_together_are_named_together() -> None:
    """The killed rank's last beat came after its crashing sibling's: both are named when the
    first crosses the timeout (the report tears the replica down, and the other would not be)."""
    killed, sibling, busy = (RankId(replica_id="r0", rank=r) for r in (1, 0, 2))
    det = FailStopDetector(timeout_s=1.0)
    det.beat(_hb(B, 10.0))
    det.beat(_hb(sibling, 10.00))
    det.beat(_hb(killed, 10.2))
    det.beat(_hb(busy, 10.0))
    det.beat(_hb(busy, 10.9))  # beating: not named
    det.beat(_hb(B, 10.9))
    found = det.check(11.05)  # the sibling 1.05 s silent, the killed rank 0.85 s
    assert sorted((i.replica_id, i.rank) for i in found) == [("r0", 0), ("r0", 1)]
    assert det.check(11.3) == []  # once each


def test_clean_leave_is_never_an_incident() -> None:
    det = FailStopDetector(timeout_s=1.0)
    det.beat(_hb(A, 0.0))
    det.leave(A)
    assert det.check(100.0) == []


def test_a_reordered_older_beat_does_not_rewind() -> None:
    det = FailStopDetector(timeout_s=1.0)
    det.beat(_hb(A, 5.0))
    det.beat(_hb(A, 3.0))
    assert det.check(5.9) == []


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FailStopDetector(timeout_s=0)
