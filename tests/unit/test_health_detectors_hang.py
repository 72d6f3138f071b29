"""Hang: the wait-for graph over collective records names the rank that never entered."""

from __future__ import annotations

from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Heartbeat,
    IncidentKind,
    RankId,
)

CFG = DetectorConfig(hang_timeout_s=5.0)


def _rec(replica: str, rank: int, group: str, seq: int, start: float, end: float | None):  # type: ignore[no-untyped-def]
    return CollectiveRecord(
        rank=RankId(replica_id=replica, rank=rank),
        group=group,
        seq=seq,
        op="allreduce",
        started_at=start,
        ended_at=end,
    )


def _healthy_round(core: HealthCore, seq: int, t: float, quorum: int = 1) -> None:
    """Two replicas x 2 ranks: intra groups then the rings of `quorum`, all completing."""
    recs = []
    for r in ("a", "b"):
        for i in (0, 1):
            recs.append(_rec(r, i, f"replica:{r}", seq, t, t + 0.1))
            recs.append(_rec(r, i, f"ftar:{quorum}:{i}", seq, t + 0.2, t + 0.3))
    core.collectives(recs)


def _a1_never_enters(core: HealthCore) -> None:
    """Rank 1 of replica a never enters intra #1; a/0 blocks in it; b's ranks block in rings."""
    core.collectives(
        [
            _rec("a", 0, "replica:a", 1, 1.0, None),
            _rec("b", 0, "replica:b", 1, 1.0, 1.1),
            _rec("b", 1, "replica:b", 1, 1.0, 1.1),
            _rec("b", 0, "ftar:1:0", 1, 1.2, None),
            _rec("b", 1, "ftar:1:1", 1, 1.2, None),
        ]
    )


def test_rank_that_never_entered_is_named_through_the_graph() -> None:
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    _a1_never_enters(core)
    assert core.evaluate(5.0) == []  # nothing open for 5 s yet
    found = core.evaluate(6.5)
    assert [(i.kind, i.replica_id, i.rank) for i in found] == [(IncidentKind.HANG, "a", 1)]
    assert found[0].evidence["group"] == "replica:a"
    assert found[0].evidence["reason"] == "never_entered"
    # intra a#1, ring 0 (b/0 waits on a/0, inside a#1) and ring 1 (a/1 never entered it)
    assert found[0].evidence["blocked_collectives"] == 3
    assert core.evaluate(7.0) == []  # reported once


def test_member_that_never_left_is_named() -> None:
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    core.collectives(
        [
            _rec("a", 0, "ftar:1:0", 1, 1.0, None),
            _rec("b", 0, "ftar:1:0", 1, 1.0, 1.5),
        ]
    )
    found = core.evaluate(7.0)
    assert [(i.replica_id, i.rank, i.evidence["reason"]) for i in found] == [("a", 0, "never_left")]


def test_no_hang_while_collectives_complete_or_are_young() -> None:
    core = HealthCore(CFG)
    for seq in range(20):
        _healthy_round(core, seq, float(seq))
    core.collectives([_rec("a", 0, "replica:a", 20, 20.0, None)])
    assert core.evaluate(24.0) == []


def test_a_clean_leave_unblocks_the_collective() -> None:
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    core.collectives([_rec("b", 1, "ftar:1:1", 1, 1.0, None)])
    core.rank_left(RankId(replica_id="a", rank=1))
    core.collectives([_rec("b", 1, "ftar:1:1", 1, 1.0, 1.2)])
    assert core.evaluate(10.0) == []


def _beat(replica: str, rank: int, at: float, process: str) -> Heartbeat:
    return Heartbeat(
        rank=RankId(replica_id=replica, rank=rank), host="h", step=1, at=at, process=process
    )


def _a0_stuck_in_ring(process: str) -> HealthCore:
    """a/0 (process `process`) entered ring #1 and never left it; b/0 finished it."""
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    core.heartbeat(_beat("a", 0, 0.5, process))
    core.collectives(
        [_rec("a", 0, "ftar:1:0", 1, 1.0, None), _rec("b", 0, "ftar:1:0", 1, 1.0, 1.5)]
    )
    return core


def test_a_restarted_rank_is_not_the_culprit_of_what_its_old_process_left_open() -> None:
    """A rank killed inside a ring collective and restarted faster than the heartbeat timeout:
    its new process beats, so the collective its old process never left blocks nobody."""
    core = _a0_stuck_in_ring("old")
    core.heartbeat(_beat("a", 0, 2.0, "new"))
    # The old process's entry, late from an agent's backlog, is stale too.
    core.collectives([_rec("a", 0, "ftar:1:0", 1, 0.4, None)])
    core.heartbeat(_beat("a", 0, 6.9, "new"))
    assert core.evaluate(7.0) == []


def test_the_same_process_beating_on_still_hangs_the_collective() -> None:
    """Beats without a new process change nothing: a rank alive but stuck is a hang (the
    detector the restart rule must not blind)."""
    core = _a0_stuck_in_ring("p1")
    core.heartbeat(_beat("a", 0, 6.9, "p1"))
    found = core.evaluate(7.0)
    assert [(i.replica_id, i.rank, i.evidence["reason"]) for i in found] == [("a", 0, "never_left")]


def test_the_aftermath_of_a_named_hang_is_no_new_hang() -> None:
    """Seen in a demo run: a/1 never entered ring #1 and was named; its replica was torn down
    (it left), and the two ranks that waited gave up one after the other. For a moment one had
    left and the other not, which read as a second culprit ("never left"), and with the culprit
    gone as "the collective itself is stuck": healthy replicas evicted for a hang they suffered."""
    core = HealthCore(CFG)
    for replica in ("a", "b", "c"):
        core.collectives([_rec(replica, 1, "ftar:1:1", 0, 0.0, 0.1)])
    core.collectives(
        [_rec("b", 1, "ftar:1:1", 1, 1.0, None), _rec("c", 1, "ftar:1:1", 1, 1.0, None)]
    )
    found = core.evaluate(6.5)
    assert [(i.replica_id, i.rank, i.evidence["reason"]) for i in found] == [
        ("a", 1, "never_entered")
    ]
    core.rank_left(RankId(replica_id="a", rank=1))  # torn down
    assert core.evaluate(6.6) == []  # b/1 and c/1 inside, none left: not "stuck"
    core.collectives([_rec("b", 1, "ftar:1:1", 1, 1.0, 6.7)])
    assert core.evaluate(6.8) == []  # c/1 not yet left: not "never left"
    core.collectives([_rec("c", 1, "ftar:1:1", 1, 1.0, 6.9)])
    assert core.evaluate(7.0) == []
    # The next collective of the group is judged afresh.
    core.collectives(
        [_rec("b", 1, "ftar:1:1", 2, 7.0, None), _rec("c", 1, "ftar:1:1", 2, 7.0, 7.1)]
    )
    found = core.evaluate(12.5)
    assert [(i.replica_id, i.rank, i.evidence["reason"]) for i in found] == [("b", 1, "never_left")]


def test_a_failing_detector_never_takes_another_ones_verdict_with_it() -> None:
    """Seen with an oversized setting: one detector raised on every evaluation, and a rank that
    fell silent meanwhile was marked reported but its incident never came out."""
    core = HealthCore(DetectorConfig(heartbeat_timeout_s=1.0))
    core.heartbeat(_beat("a", 0, 0.0, "p"))

    class Broken:
        def check(self, now: float) -> list[object]:
            raise OverflowError("a detector's bug")

    core._slowrank = Broken()  # type: ignore[assignment]
    found = core.evaluate(5.0)
    assert [(i.kind, i.replica_id, i.rank) for i in found] == [(IncidentKind.FAIL_STOP, "a", 0)]
