"""Bounds and pruning of the detectors' state: a report that names thousands of groups costs a
bounded amount of memory, what is dead is forgotten after the retention, and an evaluation costs
the collectives old enough to hang, not every open one."""

from __future__ import annotations

from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.collectives import CollectiveIndex
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.telemetry import CollectiveRecord, IncidentKind, RankId
from tests.unit.test_health_detectors_hang import (
    CFG,
    _a1_never_enters,
    _beat,
    _healthy_round,
    _rec,
)

RETENTION = CFG.collective_retention_s
BOUND = CFG.collective_groups_per_rank
A0 = RankId(replica_id="a", rank=0)


def _index(core: HealthCore) -> CollectiveIndex:
    return core._collectives


def test_one_rank_in_20000_groups_keeps_at_most_its_bound_and_the_newest() -> None:
    core = HealthCore(CFG)
    flood = [_rec("a", 0, f"ftar:{q}:0", 0, q * 1e-3, None) for q in range(20_000)]
    core.collectives(flood)
    index = _index(core)
    assert len(index.rank_groups[A0]) == BOUND
    assert len(index.members) == BOUND and len(index.open) == BOUND
    assert core.stats().open_collectives == BOUND
    # The oldest were forgotten, not the newest refused: a long job never locks itself out.
    assert set(index.rank_groups[A0]) == {f"ftar:{q}:0" for q in range(20_000 - BOUND, 20_000)}
    assert core.stats().groups_dropped["rank_bound"] == 20_000 - BOUND
    core.collectives([_rec("a", 0, "ftar:next:0", 0, 30.0, None)])
    assert "ftar:next:0" in index.rank_groups[A0]
    assert len(index.rank_groups[A0]) == BOUND


def test_a_rank_past_its_bound_leaves_the_groups_of_old_quorums_not_its_live_one() -> None:
    core = HealthCore(CFG)
    for quorum in range(100):  # one quorum per evaluation; the intra group lives on
        core.collectives(
            [
                _rec("a", 0, "replica:a", quorum, float(quorum), quorum + 0.1),
                _rec("a", 0, f"ftar:{quorum}:0", 0, quorum + 0.2, quorum + 0.3),
            ]
        )
        core.evaluate(quorum + 0.5)
    groups = _index(core).rank_groups[A0]
    assert len(groups) == BOUND
    assert "replica:a" in groups
    assert {g for g in groups if g != "replica:a"} == {f"ftar:{q}:0" for q in range(37, 100)}


def test_the_total_bound_forgets_the_least_recently_recorded_groups() -> None:
    core = HealthCore(DetectorConfig(hang_timeout_s=5.0, collective_groups_total=1_000))
    core.collectives([_rec("a", i, f"ftar:1:{i}", 0, 0.0, None) for i in range(3_000)])
    index = _index(core)
    assert len(index.members) == 1_000
    assert set(index.members) == {f"ftar:1:{i}" for i in range(2_000, 3_000)}
    assert len(index.rank_groups) == 1_000  # the ranks of forgotten groups are not kept either
    assert core.stats().groups_dropped["total_bound"] == 2_000


def test_groups_idle_past_the_retention_are_forgotten_entirely() -> None:
    core = HealthCore(CFG)
    for seq in range(3):
        _healthy_round(core, seq, float(seq))
    core.evaluate(3.0)
    index = _index(core)
    assert set(index.members) == {"replica:a", "replica:b", "ftar:1:0", "ftar:1:1"}
    core.evaluate(300.0)
    _healthy_round(core, 3, 300.0, quorum=2)  # a new quorum: new rings, the same intra groups
    core.evaluate(301.0)
    assert len(index.members) == 6 and len(core._slowrank._windows) == 6

    core.evaluate(3.0 + RETENTION + 1.0)  # quorum 1's rings: no record for the retention
    live = {"replica:a", "replica:b", "ftar:2:0", "ftar:2:1"}
    assert set(index.members) == live
    assert set(index._done) == live
    assert set(index.open) == live
    assert set(core._slowrank._windows) == live
    assert set(index.rank_groups[A0]) == {"replica:a", "ftar:2:0"}

    core.evaluate(300.0 + RETENTION + 1.0)  # and now everything
    assert index.members == {} and index._done == {} and index.open == {}
    assert index.rank_groups == {} and index.inside == {}
    assert core._slowrank._windows == {}
    assert core.stats().groups == 0
    assert core.stats().groups_dropped["idle"] == 6


def test_an_open_collective_of_an_idle_group_goes_with_it() -> None:
    core = HealthCore(CFG)
    core.collectives([_rec("a", 0, "ftar:1:0", 0, 0.0, None)])
    core.evaluate(1.0)
    core.evaluate(1.0 + RETENTION + 1.0)
    index = _index(core)
    assert index.members == {} and index.inside == {} and len(index.ages) == 0


def _beat_b(core: HealthCore, at: float) -> None:
    for rank in (0, 1):
        core.heartbeat(_beat("b", rank, at, "p"))


def test_the_ranks_of_a_dead_replica_are_forgotten_after_the_retention() -> None:
    core = HealthCore(CFG)
    for replica in ("a", "b"):
        for rank in (0, 1):
            core.heartbeat(_beat(replica, rank, 0.0, "p"))
    _healthy_round(core, 0, 0.0)
    core.evaluate(0.5)
    _beat_b(core, 1.9)
    found = core.evaluate(2.0)
    assert sorted((i.kind, i.replica_id, i.rank) for i in found) == [
        (IncidentKind.FAIL_STOP, "a", 0),
        (IncidentKind.FAIL_STOP, "a", 1),
    ]
    for now in range(100, 700, 100):  # b beats on; a stays dead
        _beat_b(core, now - 0.1)
        core.evaluate(float(now))
        assert {v.replica_id: v.state for v in core.replicas()} == {"a": "down", "b": "healthy"}
    _beat_b(core, 699.9)
    core.evaluate(700.0)  # a sent nothing since 0.5: more than the retention
    assert [v.replica_id for v in core.replicas()] == ["b"]
    assert {r.replica_id for r in core._failstop.tracked()} == {"b"}
    assert A0 not in _index(core).rank_groups and A0 not in _index(core).inside
    assert core.stats().ranks_forgotten == 2
    assert core.stats().replicas == 1


def test_a_rank_that_only_ever_sent_telemetry_is_forgotten_too() -> None:
    core = HealthCore(CFG)
    core.collectives([_rec("x", 0, "replica:x", 0, 0.0, 0.1)])
    core.evaluate(1.0)
    core.evaluate(1.0 + RETENTION / 2)
    assert [v.replica_id for v in core.replicas()] == ["x"]
    core.evaluate(1.0 + RETENTION + 100.0)
    assert core.replicas() == []
    assert core.stats().ranks_forgotten == 1


def test_the_hang_detector_names_the_culprit_after_old_groups_were_pruned() -> None:
    """Quorum 1's rings are forgotten; the intra groups kept their members (a/1 among them), so
    the rank that never enters is still named, through the new quorum's rings."""
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    core.evaluate(1.0)
    core.evaluate(300.0)
    _healthy_round(
        core, 0, 300.0, quorum=2
    )  # intra groups: seq 0 was quorum 1's; the same seq is done
    _healthy_round(core, 1, 301.0, quorum=2)
    core.evaluate(650.0)
    index = _index(core)
    assert "ftar:1:0" not in index.members and "ftar:1:1" not in index.members
    core.collectives(
        [
            _rec("a", 0, "replica:a", 2, 650.0, None),
            _rec("b", 0, "replica:b", 2, 650.0, 650.1),
            _rec("b", 1, "replica:b", 2, 650.0, 650.1),
            _rec("b", 0, "ftar:2:0", 2, 650.2, None),
            _rec("b", 1, "ftar:2:1", 2, 650.2, None),
        ]
    )
    assert core.evaluate(654.0) == []
    found = core.evaluate(656.5)
    assert [(i.kind, i.replica_id, i.rank) for i in found] == [(IncidentKind.HANG, "a", 1)]
    assert found[0].evidence["group"] == "replica:a"
    assert found[0].evidence["reason"] == "never_entered"
    assert found[0].evidence["blocked_collectives"] == 3
    assert core.evaluate(657.0) == []


def _pending_rings(count: int) -> list[CollectiveRecord]:
    """Rings of two, a/i and b/i: they met once (seq 0), then a/i entered seq 1, b/i not yet."""
    records = []
    for i in range(count):
        group = f"ftar:1:{i}"
        records += [
            _rec("a", i, group, 0, 0.0, 0.1),
            _rec("b", i, group, 0, 0.0, 0.1),
            _rec("a", i, group, 1, 1.0, None),
        ]
    return records


def test_an_evaluation_visits_no_young_collective_and_no_named_one_again() -> None:
    core = HealthCore(CFG)
    core.collectives(_pending_rings(5_000))
    assert core.evaluate(2.0) == []
    assert core.stats().open_collectives == 5_000
    assert core.stats().hang_visits == 0  # none of the 5,000 young ones was looked at

    found = core.evaluate(6.5)  # all older than the hang timeout now
    assert len(found) == 5_000
    assert {(i.replica_id, i.rank, i.evidence["reason"]) for i in found} == {
        ("b", i, "never_entered") for i in range(5_000)
    }
    assert core.stats().hang_visits == 5_000

    assert core.evaluate(7.0) == []
    assert core.stats().hang_visits == 5_000  # named: not resolved again

    # A record that changes one makes it judged once more; it is still the same hang.
    core.collectives([_rec("b", 7, "ftar:1:7", 1, 7.1, None)])
    assert core.evaluate(7.5) == []
    assert core.stats().hang_visits == 5_001
    assert core.evaluate(8.0) == []
    assert core.stats().hang_visits == 5_001


def test_a_collective_nobody_is_inside_is_not_looked_at_again() -> None:
    core = HealthCore(CFG)
    core.collectives(
        [
            _rec("a", 0, "ftar:1:0", 0, 0.0, 0.1),
            _rec("b", 0, "ftar:1:0", 0, 0.0, 0.1),
            _rec("a", 0, "ftar:1:0", 1, 1.0, 1.5),  # a/0 gave up on seq 1; b/0 never came
        ]
    )
    assert core.evaluate(7.0) == []
    assert core.stats().hang_visits == 1
    assert core.evaluate(8.0) == []
    assert core.stats().hang_visits == 1


def _beat_all(core: HealthCore, at: float) -> None:
    for replica in ("a", "b"):
        for rank in (0, 1):
            core.heartbeat(_beat(replica, rank, at, "p"))


def test_a_named_culprit_stays_down_while_its_hang_is_open_and_no_longer() -> None:
    """The verdicts of settled collectives are not re-judged on every evaluation, so the
    bookkeeping of who is hung must follow the collectives closing."""
    core = HealthCore(CFG)
    _healthy_round(core, 0, 0.0)
    _a1_never_enters(core)
    _beat_all(core, 6.4)
    found = core.evaluate(6.5)
    assert [(i.kind, i.replica_id, i.rank) for i in found] == [(IncidentKind.HANG, "a", 1)]
    _beat_all(core, 6.6)  # alive but hung: beating does not clear it
    assert core.evaluate(6.7) == []
    assert {v.replica_id: v.state for v in core.replicas()}["a"] == "down"

    core.collectives(  # a/1 comes through: the intra collective and the rings complete
        [
            _rec("a", 1, "replica:a", 1, 6.8, 6.9),
            _rec("a", 0, "replica:a", 1, 1.0, 6.9),
            _rec("a", 0, "ftar:1:0", 1, 6.9, 7.0),
            _rec("a", 1, "ftar:1:1", 1, 6.9, 7.0),
            _rec("b", 0, "ftar:1:0", 1, 1.2, 7.0),
            _rec("b", 1, "ftar:1:1", 1, 1.2, 7.0),
        ]
    )
    assert core.stats().open_collectives == 0
    _beat_all(core, 7.0)
    assert core.evaluate(7.1) == []
    _beat_all(core, 7.2)
    assert {v.replica_id: v.state for v in core.replicas()} == {"a": "healthy", "b": "healthy"}
