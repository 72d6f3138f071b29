"""The pure quorum core: the round decision, formation and membership, on a fake clock."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.core import (
    Ask,
    CoreState,
    Decision,
    Formation,
    Registration,
    check_id,
    check_ranks,
    check_step,
    decide,
    expired,
    form,
    membership_bytes,
)
from fthsdp.services.quorum.domain import (
    InvalidRequestError,
    RankEndpoint,
    StaleIncarnationError,
    UnknownReplicaError,
)

HB = 1.0
JOIN = 2.0
CONFIG = QuorumConfig(
    port=0,
    admin_port=None,
    join_timeout=timedelta(seconds=JOIN),
    heartbeat_timeout=timedelta(seconds=HB),
)
RANK = RankEndpoint(ftar="10.0.0.1:29500", checkpoint="http://10.0.0.1:8080")


def register(state: CoreState, rid: str, now: float, *, inc: int = 1, world: int = 1) -> None:
    state.register(
        Registration(replica_id=rid, incarnation=inc, world_size=world, ranks=(RANK,) * world), now
    )


def ask(state: CoreState, rid: str, now: float, *, step: int = 0, failed: bool = False) -> None:
    inc = state.registered[rid].incarnation
    state.add_ask(
        Ask(replica_id=rid, incarnation=inc, step=step, commit_failed=failed, arrived=now)
    )


def form_now(state: CoreState, now: float) -> Formation:
    formation = form(now, state, reason="test", formed_unix=0.0)
    state.apply(formation, now)
    return formation


def form_on_fast_path(state: CoreState, now: float) -> Formation:
    """Decide at `now`, require a formation on the fast path, and apply it."""
    decision, reason = decide(now, state, CONFIG)
    assert decision.form, reason
    assert decision.path == "fast"
    return form_now(state, now)


def members(formation: Formation) -> list[str]:
    return [m.replica_id for m in formation.quorum.members]


def steady(ids: list[str], now: float = 0.0, config: QuorumConfig = CONFIG) -> CoreState:
    """A state whose previous quorum is exactly `ids` (formed at `now`)."""
    state = CoreState()
    for rid in ids:
        register(state, rid, now)
        ask(state, rid, now)
    decision, _ = decide(now, state, config)
    assert decision.form
    form_now(state, now)
    return state


def test_nobody_waiting_never_forms() -> None:
    state = CoreState()
    register(state, "a", 0.0)
    decision, reason = decide(0.5, state, CONFIG)
    assert not decision.form
    assert decision.wake_at is None
    assert "no replica" in reason


def test_every_live_replica_asked_forms_at_once() -> None:
    state = CoreState()
    for rid in "abc":
        register(state, rid, 0.0)
    ask(state, "a", 0.1)
    ask(state, "b", 0.1)
    assert not decide(0.1, state, CONFIG)[0].form
    ask(state, "c", 0.2)
    decision, reason = decide(0.2, state, CONFIG)
    assert decision.form, reason
    assert decision.path == "all_asked"
    assert members(form_now(state, 0.2)) == ["a", "b", "c"]


def test_join_timeout_applies_while_a_live_replica_has_not_asked() -> None:
    state = CoreState()
    for rid in "abc":
        register(state, rid, 0.0)
    ask(state, "a", 0.1)
    ask(state, "b", 0.1)
    for t in (0.5, 1.0, 1.5, 2.0):  # c keeps beating but never asks
        state.touch("c", t)
        decision, _ = decide(t, state, CONFIG)
        assert not decision.form
        assert decision.wake_at == pytest.approx(0.1 + JOIN)
    decision, reason = decide(0.1 + JOIN, state, CONFIG)
    assert decision.form, reason
    assert decision.path == "join_timeout"
    assert members(form_now(state, 2.1)) == ["a", "b"]


def test_a_straggler_that_stops_beating_releases_the_round_at_its_expiry() -> None:
    state = CoreState()
    for rid in "abc":
        register(state, rid, 0.0)
    state.touch("c", 0.3)
    ask(state, "a", 0.5)
    ask(state, "b", 0.5)
    assert not decide(1.29, state, CONFIG)[0].form
    decision, reason = decide(1.3, state, CONFIG)  # c expired at 0.3 + HB, before the join timeout
    assert decision.form, reason
    assert decision.path == "all_asked"


def test_fast_path_does_not_wait_for_a_registered_newcomer() -> None:
    state = steady(["a", "b"])
    register(state, "c", 1.0)  # joined, live, still loading: has not asked
    ask(state, "a", 1.1, step=1)
    ask(state, "b", 1.1, step=1)
    formation = form_on_fast_path(state, 1.1)
    assert members(formation) == ["a", "b"]
    assert formation.quorum.quorum_id == 1


def test_fast_path_takes_waiting_newcomers_and_bumps_the_epoch() -> None:
    state = steady(["a", "b"])
    state.touch("b", 0.9)
    register(state, "c", 1.0)
    ask(state, "c", 1.0)
    ask(state, "a", 1.1, step=5)
    assert not decide(1.1, state, CONFIG)[0].form  # b, a previous member, has not asked
    ask(state, "b", 1.2, step=5)
    formation = form_on_fast_path(state, 1.2)
    assert members(formation) == ["a", "b", "c"]
    assert formation.quorum.quorum_id == 2
    assert formation.quorum.healthy == ("a", "b")
    assert formation.quorum.max_step == 5
    assert set(formation.quorum.sources) == {"c"}


def test_a_replica_arriving_after_formation_waits_for_the_next_round() -> None:
    state = steady(["a", "b"])
    ask(state, "a", 1.0, step=1)
    ask(state, "b", 1.0, step=1)
    form_now(state, 1.0)
    register(state, "c", 1.05)
    ask(state, "c", 1.1)  # too late for round 2: it must not form a round of its own
    decision, _ = decide(1.1, state, CONFIG)
    assert not decision.form
    ask(state, "a", 1.2, step=2)
    ask(state, "b", 1.2, step=2)
    assert decide(1.2, state, CONFIG)[0].form
    assert members(form_now(state, 1.2)) == ["a", "b", "c"]


def test_restarting_newcomers_neither_stall_nor_outvote_the_survivors() -> None:
    """Overlapping failures: c and d restarted (new incarnations joined, still loading, not
    asked) when the survivors ask. They train nothing, so the survivors form at once: the
    newcomers are neither waited for nor counted against the survivors' majority (I6 counts
    the replicas that take part), and they join the round they ask in."""
    state = steady(["a", "b", "c", "d"])
    register(state, "c", 1.0, inc=2)
    register(state, "d", 1.2, inc=2)
    for t in (1.3, 1.5):
        state.touch("c", t)
        state.touch("d", t)
    ask(state, "a", 1.5, step=1)
    ask(state, "b", 1.5, step=1)
    decision, reason = decide(1.5, state, CONFIG)
    assert decision.form, reason
    formation = form_now(state, 1.5)
    assert members(formation) == ["a", "b"]
    ask(state, "c", 1.6, step=0)  # c is ready: it takes part from the next round on
    ask(state, "a", 1.7, step=2)
    ask(state, "b", 1.7, step=2)
    decision, reason = decide(1.7, state, CONFIG)
    assert decision.form, reason
    assert members(form_now(state, 1.7)) == ["a", "b", "c"]
    # From then on c counts: a round without it waits for it (it is live and took part).
    ask(state, "a", 1.8, step=3)
    ask(state, "b", 1.8, step=3)
    assert not decide(1.8, state, CONFIG)[0].form


def test_a_minority_of_live_replicas_never_forms() -> None:
    state = CoreState()
    for rid in "abcde":
        register(state, rid, 0.0)
    ask(state, "a", 0.0)
    ask(state, "b", 0.0)
    for t in (0.5, 0.9):
        for rid in "cde":
            state.touch(rid, t)
    decision, reason = decide(0.95, state, CONFIG)
    assert not decision.form
    for rid in "cde":
        state.touch(rid, 2.5)
    decision, reason = decide(3.0, state, CONFIG)  # far past the join timeout: still 2 of 5
    assert not decision.form
    assert "majority" in reason
    ask(state, "c", 3.0)
    decision, reason = decide(3.0, state, CONFIG)
    assert decision.form, reason
    assert decision.path == "join_timeout"


def test_half_of_the_live_replicas_is_not_a_majority() -> None:
    state = steady(["a", "b", "c", "d"])
    ask(state, "a", 0.5, step=1)
    ask(state, "b", 0.5, step=1)
    state.touch("c", 2.0)
    state.touch("d", 2.0)
    decision, reason = decide(0.5 + JOIN, state, CONFIG)
    assert not decision.form
    assert "majority" in reason


def test_min_replicas_holds_even_when_everyone_asked() -> None:
    config = QuorumConfig(port=0, admin_port=None, min_replicas=3)
    state = CoreState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    ask(state, "a", 0.0)
    ask(state, "b", 0.0)
    decision, reason = decide(10.0, state, config)
    assert not decision.form
    assert "min_replicas=3" in reason
    register(state, "c", 10.0)
    ask(state, "c", 10.0)
    assert decide(10.0, state, config)[0].form


def test_min_replicas_holds_on_the_fast_path() -> None:
    config = QuorumConfig(port=0, admin_port=None, min_replicas=2)
    state = steady(["a", "b"], config=config)
    state.remove("b")
    ask(state, "a", 1.0, step=1)
    decision, _ = decide(1.0, state, config)
    assert not decision.form


def test_shrink_after_eviction_forms_at_once_with_a_new_epoch() -> None:
    state = steady(["a", "b", "c"])
    state.remove("c")  # evicted
    register(state, "d", 0.5)  # a live newcomer that has not asked must not delay survivors
    ask(state, "a", 0.6, step=1)
    ask(state, "b", 0.6, step=1)
    formation = form_on_fast_path(state, 0.6)
    assert members(formation) == ["a", "b"]
    assert formation.quorum.quorum_id == 2


def test_commit_failure_bumps_the_epoch_and_only_then() -> None:
    state = steady(["a", "b"])
    ids = []
    for step, failed in ((1, False), (1, True), (1, False), (2, False)):
        ask(state, "a", float(step), step=step, failed=failed)
        ask(state, "b", float(step), step=step)
        assert decide(float(step), state, CONFIG)[0].form
        ids.append(form_now(state, float(step)).quorum.quorum_id)
    assert ids == [1, 2, 2, 2]


def test_restart_is_a_new_member_and_the_old_incarnation_is_stale() -> None:
    state = steady(["a", "b"])
    register(state, "b", 1.0, inc=2)  # b's process restarted and joined again
    with pytest.raises(StaleIncarnationError, match="stale incarnation"):
        state.check("b", 1)
    assert state.check("b", 2).incarnation == 2
    with pytest.raises(UnknownReplicaError):
        state.check("b", 3)
    with pytest.raises(UnknownReplicaError):
        state.check("zz", 1)
    ask(state, "a", 1.1, step=1)
    ask(state, "b", 1.1, step=0)
    decision, reason = decide(1.1, state, CONFIG)
    assert decision.form, reason
    formation = form_now(state, 1.1)
    assert formation.quorum.quorum_id == 2  # same ids, new incarnation: a membership change
    assert formation.quorum.member("b").incarnation == 2
    assert formation.quorum.sources["b"] == (("a",),)


def test_removed_replica_is_stale_not_unknown() -> None:
    state = steady(["a", "b"])
    state.remove("b")
    with pytest.raises(StaleIncarnationError, match="no longer a member"):
        state.check("b", 1)


def test_the_membership_size_follows_joins_rejoins_and_removals() -> None:
    state = CoreState()
    register(state, "a", 0.0, world=2)
    register(state, "b", 0.0, world=3)
    register(state, "b", 1.0, inc=2, world=3)  # a rejoin replaces its own share
    expected = sum(membership_bytes(r.ranks) for r in state.registered.values())
    assert state.membership_bytes == expected > 0
    state.remove("a")
    state.remove("zz")
    assert state.membership_bytes == membership_bytes(state.registered["b"].ranks)
    state.remove("b")
    assert state.membership_bytes == 0 and state.member_bytes == {}


def test_heartbeat_expiry_spares_waiting_replicas() -> None:
    state = CoreState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    ask(state, "a", 0.1)
    gone, next_expiry = expired(0.9, state, CONFIG)
    assert gone == []
    assert next_expiry == pytest.approx(HB)
    gone, next_expiry = expired(5.0, state, CONFIG)
    assert gone == ["b"]  # a waits in the round: its open call is its sign of life
    assert next_expiry is None


def test_retried_ask_replaces_the_first_and_counts_once() -> None:
    state = CoreState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    ask(state, "a", 0.1, step=3)
    ask(state, "a", 0.2, step=3)
    assert len(state.waiting) == 1
    assert not decide(0.2, state, CONFIG)[0].form
    state.drop_ask("a")  # the retry's RPC was cancelled too
    assert state.round_started is None
    assert not decide(0.3, state, CONFIG)[0].form


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "leave", "round", "fail_round"]),
            st.integers(min_value=0, max_value=5),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_quorum_id_is_monotonic_and_moves_exactly_on_change(ops: list[tuple[str, int]]) -> None:
    state = CoreState()
    incarnation: dict[str, int] = {}
    last_id = 0
    last_members: tuple[tuple[str, int], ...] | None = None
    now = 0.0
    for op, who in ops:
        now += 0.01
        rid = f"r{who}"
        if op == "join":
            incarnation[rid] = incarnation.get(rid, 0) + 1
            register(state, rid, now, inc=incarnation[rid])
        elif op == "leave":
            state.remove(rid)
        elif state.registered:
            failed = op == "fail_round"
            for i, r in enumerate(sorted(state.registered)):
                ask(state, r, now, step=1, failed=failed and i == 0)
            assert decide(now, state, CONFIG)[0].form
            formation = form_now(state, now)
            identity = tuple((m.replica_id, m.incarnation) for m in formation.quorum.members)
            expected = last_id + 1 if failed or identity != last_members else last_id
            assert formation.quorum.quorum_id == expected
            last_id, last_members = formation.quorum.quorum_id, identity


def test_validation_rejects_bad_input() -> None:
    for bad in ("", "x" * 129, "has space", "tab\there"):
        with pytest.raises(InvalidRequestError):
            check_id(bad)
    assert check_id("x" * 128) == "x" * 128
    with pytest.raises(InvalidRequestError, match="step"):
        check_step(-1)
    with pytest.raises(InvalidRequestError, match="world_size"):
        check_ranks(0, [])
    with pytest.raises(InvalidRequestError, match="world_size"):
        check_ranks(4097, [RANK] * 4097)
    with pytest.raises(InvalidRequestError, match="one endpoint per rank"):
        check_ranks(2, [RANK])
    with pytest.raises(InvalidRequestError, match="host:port"):
        check_ranks(1, [RankEndpoint(ftar="nohost", checkpoint="http://h:1")])
    with pytest.raises(InvalidRequestError, match="ftar"):
        check_ranks(1, [RankEndpoint(ftar="h:" + "1" * 300, checkpoint="http://h:1")])
    with pytest.raises(InvalidRequestError, match="checkpoint"):
        check_ranks(1, [RankEndpoint(ftar="h:1", checkpoint="ftp://h")])


CATCHUP = 10.0
CATCHUP_CONFIG = dataclasses.replace(CONFIG, catchup_timeout=timedelta(seconds=CATCHUP))


def _round_without(state: CoreState, late: str, start: float, step: int) -> Decision:
    """a and b ask at `start`; `late` beats on without asking until the round decides to form."""
    ask(state, "a", start, step=step)
    ask(state, "b", start, step=step)
    t = start
    while True:
        state.touch(late, t)
        decision, reason = decide(t, state, CATCHUP_CONFIG)
        if decision.form:
            return decision
        assert decision.wake_at is not None, reason
        t = min(decision.wake_at, t + 0.5)


def test_a_catch_up_that_outlasted_the_join_timeout_is_waited_for_the_next_time() -> None:
    """c catches up (behind a and b), misses the next round (its fetch and load outlast the join
    timeout), and catches up again: that round waits for it past the join timeout, up to the
    catch-up timeout, so it rejoins instead of falling behind forever."""
    state = steady(["a", "b", "c"])
    ask(state, "a", 1.0, step=10)
    ask(state, "b", 1.0, step=10)
    ask(state, "c", 1.0, step=3)  # behind: it catches up in quorum 2
    assert form_now(state, 1.0).quorum.max_step == 10 and not state.slow_catchup
    first = _round_without(state, "c", 2.0, step=11)
    assert first.path == "join_timeout"  # the first miss costs the join timeout, as always
    formation = form_now(state, 2.0 + JOIN)
    assert members(formation) == ["a", "b"] and state.missed_catchup == {"c"}
    ask(state, "a", 5.0, step=12)
    ask(state, "b", 5.0, step=12)
    ask(state, "c", 5.0, step=11)  # behind again: catching up once more
    form_now(state, 5.0)
    assert state.slow_catchup == {"c"}
    ask(state, "a", 6.0, step=13)
    ask(state, "b", 6.0, step=13)
    state.touch("c", 6.0 + JOIN)
    decision, reason = decide(6.0 + JOIN, state, CATCHUP_CONFIG)
    assert not decision.form and "catching up again" in reason
    assert decision.wake_at == pytest.approx(min(6.0 + CATCHUP, 6.0 + JOIN + HB))
    ask(state, "c", 6.0 + JOIN + 0.5, step=13)  # its catch-up took 2.5 s: it rejoins
    decision, reason = decide(6.0 + JOIN + 0.5, state, CATCHUP_CONFIG)
    assert decision.form, reason
    formation = form_now(state, 6.0 + JOIN + 0.5)
    assert formation.record.healthy == ("a", "b", "c")
    assert not state.missed_catchup and not state.slow_catchup  # forgotten once healthy


def test_the_wait_for_a_slow_catch_up_is_bounded_by_the_catch_up_timeout() -> None:
    state = steady(["a", "b", "c"])
    for t, steps in ((1.0, (10, 10, 3)), (5.0, (12, 12, 11))):
        for rid, step in zip("abc", steps, strict=True):
            ask(state, rid, t, step=step)
        form_now(state, t)
        if t == 1.0:  # c misses the round after its first catch-up
            _round_without(state, "c", 2.0, step=11)
            form_now(state, 2.0 + JOIN)
    assert state.slow_catchup == {"c"}
    decision = _round_without(state, "c", 6.0, step=13)  # c never asks, yet keeps beating
    assert decision.path == "join_timeout"
    assert members(form_now(state, 6.0 + CATCHUP)) == ["a", "b"]
