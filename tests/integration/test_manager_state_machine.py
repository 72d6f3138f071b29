"""The Manager's state machine under faults, in seconds: 2 replicas x 1 rank as threads of this
process, against the real quorum service and checkpoint sidecar (`manager_support`). A replica
is killed at a point of its step (`manager_faults_support`: what `worker.faults` does to a
process, done to one Manager), hangs, or loses the control plane; the tests check what the
others committed, step by step (which quorum, which contributors, how many attempts), and that
every replica ends bitwise equal to a plain single-process replay of the same history (I1), with
exactly-once sample accounting (I2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fthsdp.services.checkpoint.client import SnapshotPublisher
from fthsdp.worker.peer_state import PeerState, StateFetchError
from fthsdp.worker.plan import Source
from tests.integration.manager_faults_support import (
    InProcessFaults,
    Killer,
    Replica,
    Runner,
    assert_bitwise_equal,
    contiguous,
    kill_and_rejoin,
    poll,
    quorum_port,
    reference,
    replica,
    source_killed_while_serving,
    trained_ranges,
    waiting_in_round,
)
from tests.integration.manager_support import JOIN_S, control_plane

pytestmark = pytest.mark.timeout(120)

BOTH = (0, 1)
R0 = (0,)
R1 = (1,)


@pytest.fixture
def killer(monkeypatch: pytest.MonkeyPatch) -> Killer:
    return Killer(monkeypatch)


def test_a_killed_peer_rejoins_as_a_new_incarnation_and_no_sample_is_lost_or_counted_twice(
    tmp_path: Path, killer: Killer
) -> None:
    """r1 is killed between steps 1 and 2 (no Leave: the service evicts it by heartbeat); r0
    trains steps 2-3 alone; r1 restarts as a new incarnation from other initial values, catches
    up from r0 at step 4 (contributing nothing), and both train steps 5-6 together.

    I1: both end bitwise equal to the replay of that history, optimizer state included. I2: the
    position table travelled with the catch-up, so the new r1 resumes its shard at 2, exactly
    where its last committed contribution ended; r1's samples were trained in steps 0, 1, 5, 6
    and r0's in all 7, each range once, back to back."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        client = stack.local.quorum_client()
        r0 = replica(stack, "r0", 0)
        r1 = replica(stack, "r1", 1)
        restart = threading.Event()
        new: list[Replica] = []
        resumed_at: list[int] = []
        runner = Runner()

        def first_r1() -> None:
            r1.train_until(2)
            killer.kill(r1.manager)

        def second_r1() -> None:
            restart.wait()
            back = replica(stack, "r1", 1, seed=7)
            new.append(back)
            back.train_step()
            resumed_at.append(back.manager.positions.get("r1"))
            back.train_until(7)

        def survivor() -> None:
            r0.train_until(4)
            restart.set()
            poll(lambda: waiting_in_round(client, "r1"), what="the new r1 asks for a quorum")
            r0.train_until(7)

        try:
            runner.run({"r0": survivor, "r1": first_r1, "r1'": second_r1})
            (r1b,) = new
            assert r0.manager.fingerprint() == r1b.manager.fingerprint()
        finally:
            for r in (r0, *new):
                r.manager.shutdown()
            client.close()

    q1 = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q1, ("r0", "r1"), False, 1),
        (1, q1, ("r0", "r1"), False, 1),
        (2, q1 + 1, ("r0",), False, 1),
        (3, q1 + 1, ("r0",), False, 1),
        (4, q1 + 2, ("r0",), False, 1),
        (5, q1 + 2, ("r0", "r1"), False, 1),
        (6, q1 + 2, ("r0", "r1"), False, 1),
    ]
    assert r1.committed() == r0.committed()[:2]
    assert r1b.committed() == [
        (4, q1 + 2, ("r0",), True, 1),
        (5, q1 + 2, ("r0", "r1"), False, 1),
        (6, q1 + 2, ("r0", "r1"), False, 1),
    ]
    _assert_end_as_replay([BOTH, BOTH, R0, R0, R0, BOTH, BOTH], r0, r1b)
    assert resumed_at == [2]
    for r in (r0, r1b):
        assert r.manager.positions.as_dict() == {"r0": 7, "r1": 4}
    assert trained_ranges(r0.outcomes, "r1") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    ranges = trained_ranges(r0.outcomes, "r0")
    assert ranges[0] == (0, 1) and len(ranges) == 7 and all(contiguous(ranges))


def test_a_hung_peer_once_reported_is_dropped_and_the_survivor_retries_its_step_alone(
    tmp_path: Path,
) -> None:
    """r1's training thread stops before step 2's exchange while its heartbeats go on (a hang:
    only a report can end it; with two replicas, r0 alone is no majority while r1 looks alive).
    The health service's report evicts r1; r0's ring watch aborts the exchange r0 is blocked in,
    and r0 commits step 2 on the next quorum, alone, from the gradient it kept (no torn average
    with a half-sent r1), then goes on alone. Its parameters are the single-replica replay."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        exchange_timeout = timedelta(seconds=60)
        r0 = replica(stack, "r0", 0, exchange_timeout=exchange_timeout)
        hang = InProcessFaults(hang_at=2)
        r1 = replica(stack, "r1", 1, faults=hang, exchange_timeout=exchange_timeout)
        runner = Runner()
        after_release: list[BaseException] = []

        def hung_r1() -> None:
            try:
                r1.train_until(3)
            except Exception as exc:  # its Manager was shut down while it hung
                after_release.append(exc)

        try:
            runner.start("r0", lambda: r0.train_until(5))
            runner.start("r1", hung_r1)
            poll(hang.fired.is_set, what="r1 hangs in step 2")
            stack.local.report_failure("r1", "hung in step 2")
            # Only the eviction notice can end r0's exchange this early: its bound is 60 s.
            poll(lambda: r0.manager.step == 5, within_s=30, what="r0 trains on alone")
        finally:
            r1.manager.shutdown()
            hang.release.set()
            runner.join()
            r0.manager.shutdown()

    q1 = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q1, ("r0", "r1"), False, 1),
        (1, q1, ("r0", "r1"), False, 1),
        (2, q1 + 1, ("r0",), False, 2),
        (3, q1 + 1, ("r0",), False, 1),
        (4, q1 + 1, ("r0",), False, 1),
    ]
    assert r1.committed() == r0.committed()[:2]
    assert len(after_release) == 1  # r1 never committed step 2
    assert_bitwise_equal(r0.params(), reference([BOTH, BOTH, R0, R0, R0]))
    assert r0.manager.positions.as_dict() == {"r0": 5, "r1": 2}


def test_steps_go_on_without_the_quorum_service_and_resume_on_a_new_quorum_when_it_returns(
    tmp_path: Path,
) -> None:
    """The control-plane grace: with the quorum service down, both replicas train steps 2-3 on
    the previous quorum (same ring epoch, committed `without_control_plane`). Once it is back
    (empty: it forgot them), they go on without it only until their channels reconnect (the
    client's reconnect backoff, at most 2 s), then rejoin and commit on a new, larger quorum id
    (I3), both at the same step. Nothing is lost or repeated on the way: both end bitwise equal
    to the replay of that many steps of both (I1, I2)."""
    grace = timedelta(milliseconds=300)
    with control_plane(tmp_path, total_replicas=2, min_replicas=2) as stack:
        port = quorum_port(stack)
        r0 = replica(stack, "r0", 0, control_plane_grace=grace)
        r1 = replica(stack, "r1", 1, control_plane_grace=grace)
        down = threading.Barrier(2, action=stack.local.stop_quorum, timeout=JOIN_S)
        up = threading.Barrier(2, action=lambda: stack.local.start_quorum(port), timeout=JOIN_S)
        rejoined = threading.Barrier(2, timeout=JOIN_S)
        runner = Runner()

        def body(r: Replica) -> None:
            r.train_until(2)
            down.wait()
            r.train_until(4)
            up.wait()
            # A liveness guard, not a speed bound: the channel retries every 2 s at most.
            deadline = time.monotonic() + 30
            while r.outcomes[-1].without_control_plane:
                assert time.monotonic() < deadline, "never reached the restarted service"
                r.train_step()
            rejoined.wait()
            r.train_until(r.manager.step + 2)

        try:
            runner.run({"r0": lambda: body(r0), "r1": lambda: body(r1)})
            assert r0.manager.fingerprint() == r1.manager.fingerprint()
        finally:
            r0.manager.shutdown()
            r1.manager.shutdown()

    both = ("r0", "r1")
    steps = r0.manager.step
    back = steps - 3  # the first step committed on the restarted service
    assert r1.manager.step == steps and back >= 4
    q1 = r0.outcomes[0].quorum_id
    q2 = r0.outcomes[back].quorum_id
    assert q2 > q1
    without = [o.without_control_plane for o in r0.outcomes]
    assert without == [False] * 2 + [True] * (back - 2) + [False] * 3
    # Which attempt of the first step back commits depends on which replica reached the
    # service first (a step mixing the two cannot commit); every other step commits at once.
    attempts = [o.attempts for o in r0.outcomes]
    assert attempts[:back] + attempts[back + 1 :] == [1] * (steps - 1)
    expected = [(s, q1, both) for s in range(back)] + [(s, q2, both) for s in range(back, steps)]
    for r in (r0, r1):
        assert [(o.step, o.quorum_id, o.healthy) for o in r.outcomes] == expected
        assert not any(o.recovered for o in r.outcomes)
        assert_bitwise_equal(r.params(), reference([BOTH] * steps))
        assert r.manager.positions.as_dict() == {"r0": steps, "r1": steps}


def test_a_step_without_the_quorum_service_does_not_commit_when_a_peer_dies_in_it(
    tmp_path: Path, killer: Killer
) -> None:
    """The control-plane grace's limit: with the service down, r0 and r1 both start step 2 on
    the previous quorum, and r1 dies as its exchange starts. That step cannot commit on the
    previous quorum (a member is missing from its ring): r0's attempt fails, it waits for the
    service instead of falling back again, and once the service returns r0 commits step 2 on a
    new quorum, alone, and trains on: the single-replica replay, no step `without_control_plane`."""
    grace = timedelta(milliseconds=300)
    with control_plane(tmp_path, total_replicas=2) as stack:
        port = quorum_port(stack)
        r0 = replica(stack, "r0", 0, control_plane_grace=grace, metrics_port=0)
        kill = InProcessFaults(killer=killer, kill_at=("exchange", 2))
        r1 = replica(stack, "r1", 1, faults=kill, control_plane_grace=grace)
        down = threading.Barrier(2, action=stack.local.stop_quorum, timeout=JOIN_S)
        runner = Runner()
        metrics = r0.manager.metrics
        assert metrics is not None

        def failed_attempts() -> float | None:
            return metrics.registry.get_sample_value(
                "fthsdp_worker_failed_attempts_total", {"replica": "r0"}
            )

        def body(r: Replica) -> None:
            r.train_until(2)
            down.wait()
            r.train_until(4)

        try:
            runner.start("r0", lambda: body(r0))
            runner.start("r1", lambda: body(r1))
            poll(kill.fired.is_set, what="r1 dies in step 2's exchange")
            poll(lambda: failed_attempts() == 1, what="r0's step 2 fails on the previous quorum")
            assert r0.manager.step == 2
            stack.local.start_quorum(port)
            runner.join()
        finally:
            r0.manager.shutdown()

    assert runner.killed == ["r1"]
    q1 = r0.outcomes[0].quorum_id
    q2 = r0.outcomes[2].quorum_id
    assert q2 > q1
    assert r0.committed() == [
        (0, q1, ("r0", "r1"), False, 1),
        (1, q1, ("r0", "r1"), False, 1),
        (2, q2, ("r0",), False, 2),
        (3, q2, ("r0",), False, 1),
    ]
    assert not any(o.without_control_plane for o in r0.outcomes)
    assert failed_attempts() == 1
    assert_bitwise_equal(r0.params(), reference([BOTH, BOTH, R0, R0]))
    assert r0.manager.positions.as_dict() == {"r0": 4, "r1": 2}


def test_a_peer_killed_as_its_exchange_starts_leaves_no_torn_step_and_catches_up(
    tmp_path: Path, killer: Killer
) -> None:
    """Fault point `exchange`: r1 dies as step 2's exchange starts, r0 already in it. r0's
    attempt fails, and step 2 commits on the next quorum from r0's gradient alone (attempt 2);
    the new r1 catches up at step 5 and both end as the replay (I1). r1's shard: its samples of
    steps 0-1 and 6-7, from position 2 on after the restart (I2)."""
    r0, r1, r1b, resumed_at = kill_and_rejoin(tmp_path, killer, kill_at=("exchange", 2), joins_at=0)
    q = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q, ("r0", "r1"), False, 1),
        (1, q, ("r0", "r1"), False, 1),
        (2, q + 1, ("r0",), False, 2),
        (3, q + 1, ("r0",), False, 1),
        (4, q + 1, ("r0",), False, 1),
        (5, q + 2, ("r0",), False, 1),
        (6, q + 2, ("r0", "r1"), False, 1),
        (7, q + 2, ("r0", "r1"), False, 1),
    ]
    assert r1.committed() == r0.committed()[:2]
    assert r1b.committed() == [(5, q + 2, ("r0",), True, 1), *r0.committed()[6:]]
    _assert_end_as_replay([BOTH, BOTH, R0, R0, R0, R0, BOTH, BOTH], r0, r1b)
    assert resumed_at == 2
    assert r1b.manager.positions.as_dict() == r0.manager.positions.as_dict()
    assert r0.manager.positions.as_dict() == {"r0": 8, "r1": 4}


def test_a_peer_killed_after_its_vote_counts_its_contribution_once(
    tmp_path: Path, killer: Killer
) -> None:
    """Fault point `commit`: r1 dies after step 2's vote, before its optimizer step. The
    exchange was complete, so r0 commits step 2 with r1's gradient in it (nothing torn), then
    goes on alone. The new r1 resumes its shard at position 3: its step-2 samples were trained
    and are not trained again (I2); both end as the replay (I1)."""
    r0, r1, r1b, resumed_at = kill_and_rejoin(tmp_path, killer, kill_at=("commit", 2), joins_at=0)
    q = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q, ("r0", "r1"), False, 1),
        (1, q, ("r0", "r1"), False, 1),
        (2, q, ("r0", "r1"), False, 1),
        (3, q + 1, ("r0",), False, 1),
        (4, q + 1, ("r0",), False, 1),
        (5, q + 2, ("r0",), False, 1),
        (6, q + 2, ("r0", "r1"), False, 1),
        (7, q + 2, ("r0", "r1"), False, 1),
    ]
    assert r1.committed() == r0.committed()[:2]
    assert r1b.committed() == [(5, q + 2, ("r0",), True, 1), *r0.committed()[6:]]
    _assert_end_as_replay([BOTH, BOTH, BOTH, R0, R0, R0, BOTH, BOTH], r0, r1b)
    assert resumed_at == 3
    assert r1b.manager.positions.as_dict() == r0.manager.positions.as_dict()
    assert r0.manager.positions.as_dict() == {"r0": 8, "r1": 5}
    assert trained_ranges(r0.outcomes, "r1") == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_a_peer_killed_while_catching_up_does_not_stop_the_source_committing(
    tmp_path: Path, killer: Killer
) -> None:
    """Fault point `fetch`: r1 joins at r0's step 3 and dies while fetching r0's state. r0,
    serving it, fails that attempt (r1's zeros never come) and commits step 3 alone on the next
    quorum; the new r1 catches up at step 5; both end as the replay (I1). r1 never contributed:
    its shard stands at 2 after two steps of both (I2)."""
    r0, r1, r1b, resumed_at = kill_and_rejoin(tmp_path, killer, kill_at=("fetch", 0), joins_at=3)
    q = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q, ("r0",), False, 1),
        (1, q, ("r0",), False, 1),
        (2, q, ("r0",), False, 1),
        (3, q + 2, ("r0",), False, 2),  # attempt 1 on quorum q + 1, with r1
        (4, q + 2, ("r0",), False, 1),
        (5, q + 3, ("r0",), False, 1),
        (6, q + 3, ("r0", "r1"), False, 1),
        (7, q + 3, ("r0", "r1"), False, 1),
    ]
    assert r1.committed() == []
    assert r1b.committed() == [(5, q + 3, ("r0",), True, 1), *r0.committed()[6:]]
    _assert_end_as_replay([R0, R0, R0, R0, R0, R0, BOTH, BOTH], r0, r1b)
    assert resumed_at == 0
    assert r1b.manager.positions.as_dict() == r0.manager.positions.as_dict()
    assert r0.manager.positions.as_dict() == {"r0": 8, "r1": 2}


def _assert_end_as_replay(schedule: Sequence[Sequence[int]], *replicas: Replica) -> None:
    """Each replica's parameters are bitwise the replay of `schedule` from the same start (I1)."""
    expected = reference(schedule)
    for r in replicas:
        assert_bitwise_equal(r.params(), expected)


def _assert_survived_its_source(r1: Replica, r0: Replica, r0b: Replica, resumed_at: int) -> None:
    q = r0.outcomes[0].quorum_id
    assert r0.committed() == [(step, q, ("r0",), False, 1) for step in range(3)]
    # Attempt 1 of r1's first step was the catch-up on quorum q + 1: it never commits.
    assert r1.committed() == [
        (0, q + 2, ("r1",), False, 2),
        (1, q + 2, ("r1",), False, 1),
        (2, q + 2, ("r1",), False, 1),
        (3, q + 3, ("r1",), False, 1),
        (4, q + 3, ("r0", "r1"), False, 1),
        (5, q + 3, ("r0", "r1"), False, 1),
    ]
    assert r0b.committed() == [(3, q + 3, ("r1",), True, 1), *r1.committed()[4:]]
    _assert_end_as_replay([R1, R1, R1, R1, BOTH, BOTH], r1, r0b)
    # r0's steps 0-2 died with it: the new r0 retrains its shard from 0, as the model says.
    assert resumed_at == 0
    assert r0b.manager.positions.as_dict() == r1.manager.positions.as_dict()
    assert r1.manager.positions.as_dict() == {"r0": 2, "r1": 6}


def test_a_source_killed_while_serving_leaves_its_catching_up_peer_untorn(
    tmp_path: Path, killer: Killer
) -> None:
    """Fault point `serve`: r0, the only replica at step 3, dies right after publishing its
    state for r1. r1's catch-up attempt fails and nothing of it is applied: r1 does not jump
    to step 3 with state it never voted on, but trains its own step 0 on the next quorum (alone:
    steps 0-2 died with r0, as with any job that loses every healthy replica and has no durable
    checkpoint). The new r0 catches up from r1 and both end as the replay (I1, I2)."""
    _assert_survived_its_source(*source_killed_while_serving(tmp_path, killer))


def test_a_catch_up_fetch_is_cancelled_when_its_attempt_fails_and_nothing_waits_for_it(
    tmp_path: Path, killer: Killer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r1's catch-up fetch is stuck (a transfer that cannot see its cancellation) when its
    source r0 dies and the attempt fails. r1's next quorum request does not queue behind the
    fetch: r1 commits three steps alone on new quorums while it is still stuck. Once the
    transfer can look, it finds itself cancelled: it raises instead of returning r0's state of
    step 3 (which r0 did publish, so only the cancellation stops it)."""
    fetches: list[tuple[str, int, BaseException | None]] = []
    fetch_peer = PeerState.fetch_peer

    def recorded(
        state: PeerState,
        sources: Sequence[Source],
        step: int,
        **waits: threading.Event | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, str | int]]:
        try:
            result = fetch_peer(state, sources, step, **waits)
        except BaseException as exc:
            fetches.append((sources[0].replica_id, step, exc))
            raise
        fetches.append((sources[0].replica_id, step, None))
        return result

    monkeypatch.setattr(PeerState, "fetch_peer", recorded)
    stuck = InProcessFaults(stuck_fetch=True)

    def while_alone(r1: Replica) -> None:
        poll(stuck.fired.is_set, what="r1's fetch gets stuck")
        poll(lambda: r1.manager.step >= 3, what="r1 trains alone")
        assert not any(source == "r0" for source, _, _ in fetches)  # still stuck
        stuck.release.set()
        # The safety bound: far below r1's fetch_timeout (60 s), so only the cancellation
        # (not the deadline) can have ended the fetch.
        poll(lambda: any(source == "r0" for source, _, _ in fetches), within_s=20, what="fetch")

    r1, r0, r0b, resumed_at = source_killed_while_serving(
        tmp_path, killer, r1_faults=stuck, while_alone=while_alone
    )
    (first,) = [f for f in fetches if f[0] == "r0"]
    assert first[1] == 3
    assert isinstance(first[2], StateFetchError) and "cancelled" in str(first[2]), first
    assert [f for f in fetches if f[0] != "r0"] == [("r1", 3, None)]  # the new r0's catch-up
    _assert_survived_its_source(r1, r0, r0b, resumed_at)


def test_a_lost_snapshot_publish_costs_one_retry_not_the_fetch_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r1 joins at r0's step 2; r0's sidecar does not answer the publish of its state for r1
    (a `TimeoutError` at that one call: serving is best effort, and `PeerState.publish` says
    the recovering peer's fetch then fails and it retries on the next quorum). Expected: r1
    stops waiting for a snapshot that can no longer appear (r0 published, or failed to, before
    its exchange, which r1's completed exchange included), retries, catches up from r0's next
    publish, and both go on identical."""
    publish = SnapshotPublisher.publish
    lost: list[int] = []

    def publish_once_lost(
        publisher: SnapshotPublisher,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, str | int],
    ) -> None:
        if not lost:
            lost.append(step)
            raise TimeoutError("the sidecar did not answer")
        publish(publisher, step, tensors, meta)

    monkeypatch.setattr(SnapshotPublisher, "publish", publish_once_lost)
    fetch_timeout = timedelta(seconds=30)
    with control_plane(tmp_path, total_replicas=2) as stack:
        client = stack.local.quorum_client()
        r0 = replica(stack, "r0", 0, fetch_timeout=fetch_timeout)
        join = threading.Event()
        joined: list[Replica] = []
        runner = Runner()

        def late() -> None:
            assert join.wait(JOIN_S)
            r1 = replica(stack, "r1", 1, fetch_timeout=fetch_timeout)
            joined.append(r1)
            r1.train_until(5)

        def first() -> None:
            r0.train_until(2)
            join.set()
            poll(lambda: waiting_in_round(client, "r1"), what="r1 asks for a quorum")
            r0.train_until(5)

        try:
            runner.start("r0", first)
            runner.start("r1", late)
            # The bound is the property: far below fetch_timeout (30 s), which is what r1
            # would otherwise wait, and r0 with it (alone it is no majority of two).
            poll(lambda: r0.manager.step == 5, within_s=8, what="both train on")
            runner.join()
            (r1,) = joined
            assert r0.manager.fingerprint() == r1.manager.fingerprint()
        finally:
            for r in (r0, *joined):
                r.manager.shutdown()
            runner.join(check=False)
            client.close()

    assert lost == [2]
    q = r0.outcomes[0].quorum_id
    assert r0.committed() == [
        (0, q, ("r0",), False, 1),
        (1, q, ("r0",), False, 1),
        (2, q + 1, ("r0",), False, 1),
        (3, q + 2, ("r0",), False, 1),
        (4, q + 2, ("r0", "r1"), False, 1),
    ]
    assert r1.committed() == [(3, q + 2, ("r0",), True, 2), (4, q + 2, ("r0", "r1"), False, 1)]
    assert_bitwise_equal(r1.params(), reference([R0, R0, R0, R0, BOTH]))


def test_a_new_incarnation_never_serves_a_dead_ones_snapshot_of_another_history(
    tmp_path: Path, killer: Killer
) -> None:
    """The sidecar outlives a replica's process and keeps its snapshots, immutable per step.
    r0 trains steps 0-2 alone, publishes step 3 for r1 and dies: r1 goes on from its own step 0
    (another history). The new r0 catches up from r1 at step 2; r1 is killed at step 3 and its
    new incarnation joins to catch up from r0 at step 3. Expected: it gets r0's state of step 3
    in this history, and both end as the replay of it (I1)."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        client = stack.local.quorum_client()
        r0 = replica(stack, "r0", 0, faults=InProcessFaults(killer=killer, kill_at=("serve", 3)))
        join, r0_back, r1_back = threading.Event(), threading.Event(), threading.Event()
        made: dict[str, Replica] = {}
        runner = Runner()

        def r0_first() -> None:
            r0.train_until(3)
            join.set()
            poll(lambda: waiting_in_round(client, "r1"), what="r1 asks for a quorum")
            r0.train_until(6)

        def r1_first() -> None:
            assert join.wait(JOIN_S)
            r1 = made["r1"] = replica(stack, "r1", 1)
            r1.train_until(2)
            r0_back.set()
            poll(lambda: waiting_in_round(client, "r0"), what="the new r0 asks for a quorum")
            r1.train_until(3)
            # Killed once the new r0 caught up from it: a new process of r1 drops the snapshots
            # of its predecessor (they may be of another history), so an earlier kill would only
            # make the new r0 retry its catch-up.
            poll(lambda: made["r0'"].manager.step >= 3, what="the new r0 caught up from r1")
            killer.kill(r1.manager)
            r1_back.set()

        def r0_second() -> None:
            assert r0_back.wait(JOIN_S)
            back = made["r0'"] = replica(stack, "r0", 0, seed=7)
            back.train_until(3)
            poll(lambda: waiting_in_round(client, "r1"), what="the new r1 asks for a quorum")
            back.train_until(6)

        def r1_second() -> None:
            assert r1_back.wait(JOIN_S)
            made["r1'"] = replica(stack, "r1", 1, seed=8)
            made["r1'"].train_until(6)

        try:
            runner.run({"r0": r0_first, "r1": r1_first, "r0'": r0_second, "r1'": r1_second})
            assert runner.killed == ["r0"]
            r0b, r1b = made["r0'"], made["r1'"]
            q = r0b.outcomes[0].quorum_id
            both = ("r0", "r1")
            assert r0b.committed() == [
                (2, q, ("r1",), True, 1),
                (3, q + 1, ("r0",), False, 1),
                (4, q + 1, both, False, 1),
                (5, q + 1, both, False, 1),
            ]
            assert r1b.committed() == [(3, q + 1, ("r0",), True, 1), *r0b.committed()[2:]]
            assert r1b.manager.positions.as_dict() == r0b.manager.positions.as_dict()
            assert r0b.manager.fingerprint() == r1b.manager.fingerprint()
            _assert_end_as_replay([R1, R1, R1, R0, BOTH, BOTH], r0b, r1b)
            assert r0b.manager.positions.as_dict() == {"r0": 3, "r1": 5}
        finally:
            for name in ("r0'", "r1'"):
                if name in made:
                    made[name].manager.shutdown()
            client.close()
