"""Every rank's watch on a real quorum service: its own replica's eviction for a teardown calls
the rank's teardown (which, in the Manager, exits the process); other evictions do not. A newer
quorum formed without the rank's replica aborts its ring (it could only wait there for peers that
moved on); one that includes it does not."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.services.quorum.client import MembershipEvent, QuorumClient, RankEndpoint
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.ftar import FtarAbortedError, FtarConfig, FtarRing
from fthsdp.worker.plan import StepPlan
from fthsdp.worker.ring_watch import RingWatch
from tests.integration.test_ftar_support import wait_for

_RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(10), f"{what} never happened"


def _config(address: str, token: str, tmp_path: Path, replica_id: str = "r1") -> ManagerConfig:
    return ManagerConfig(
        job_id="job",
        replica_id=replica_id,
        replica_index=int(replica_id[1:]),
        total_replicas=3,
        quorum_address=address,
        checkpoint_url="http://127.0.0.1:8080",
        shm_dir=str(tmp_path),
        token=token,
    )


def _plan(quorum_id: int, replicas: tuple[str, ...]) -> StepPlan:
    return StepPlan(
        quorum_id=quorum_id,
        max_step=0,
        ring=tuple(f"127.0.0.1:{29500 + i}" for i in range(len(replicas))),
        ring_replicas=replicas,
        healthy=replicas,
        sources=(),
        serve=False,
    )


def _ring_at(epoch: int, replica_id: str) -> tuple[FtarRing, StepPlan]:
    """A one-member ring at `epoch` and the plan that put it there."""
    ring = FtarRing(FtarConfig(auth_key=b"k" * 32))
    ring.reconfigure([ring.address], 0, epoch)
    plan = StepPlan(
        quorum_id=epoch,
        max_step=0,
        ring=(ring.address,),
        ring_replicas=(replica_id,),
        healthy=(replica_id,),
        sources=(),
        serve=False,
    )
    return ring, plan


def _offline_watch(
    tmp_path: Path, ring: FtarRing, plan: Callable[[], StepPlan | None]
) -> RingWatch:
    """A rank-0 watch with no quorum service behind it: its events come from `_handle`."""
    return RingWatch(
        _config("127.0.0.1:1", "t" * 32, tmp_path),
        ring=ring,
        plan=plan,
        stop=threading.Event(),
        rank=0,
    )


def test_only_a_teardown_of_its_own_replica_calls_the_ranks_teardown(
    quorum_thread: QuorumServerThread, token: str, tmp_path: Path
) -> None:
    config = _config(quorum_thread.address, token, tmp_path)
    client = QuorumClient(quorum_thread.address, token)
    ring = FtarRing(FtarConfig(auth_key=b"k" * 32))
    stop = threading.Event()
    torn: list[MembershipEvent] = []
    called = threading.Event()

    def on_teardown(event: MembershipEvent) -> None:
        torn.append(event)
        called.set()

    watch = RingWatch(
        config, ring=ring, plan=lambda: None, stop=stop, rank=1, on_teardown=on_teardown
    )
    try:
        incarnations = {r: client.join(r, [_RANK]) for r in ("r0", "r1", "r2")}
        watch.thread.start()
        _wait(watch.live, "the watch stream")
        # Neither another replica's teardown nor this replica's plain eviction tears it down...
        assert client.report_failure("r0", "hung rank", reporter="health", teardown=True)
        assert client.report_failure("r1", "slow", reporter="health")
        incarnations["r1"] = client.join("r1", [_RANK])
        # ...this one does (one stream, in order: the events above were seen before it).
        assert client.report_failure("r1", "hung rank", reporter="health", teardown=True)
        _wait(called, "the teardown")
        (event,) = torn
        assert (event.kind, event.replica_id, event.teardown) == ("evicted", "r1", True)
        assert event.incarnation == incarnations["r1"]
        assert "hung rank" in event.reason
    finally:
        stop.set()
        watch.close()
        ring.close()
        client.close()


def test_the_events_name_the_incarnation_they_are_about(
    quorum_thread: QuorumServerThread, token: str
) -> None:
    client = QuorumClient(quorum_thread.address, token)
    stream = client.watch(timeout=timedelta(seconds=20))
    try:
        assert next(stream).kind == "snapshot"
        first = client.join("r0", [_RANK])
        second = client.join("r0", [_RANK])  # a restart: the first incarnation is superseded
        seen = [next(stream) for _ in range(3)]
        assert [(e.kind, e.incarnation, e.teardown) for e in seen] == [
            ("joined", first, False),
            ("evicted", first, False),
            ("joined", second, False),
        ]
    finally:
        stream.cancel()
        client.close()


def test_a_stream_without_joins_gets_every_other_event_in_order(
    quorum_thread: QuorumServerThread, token: str
) -> None:
    """A leader's stream (RingWatch's) leaves JOINED events out: N replicas starting together
    would be N^2 of them. Evictions, leaves and quorums still come, in the service's order."""
    client = QuorumClient(quorum_thread.address, token)
    quiet = client.watch(timeout=timedelta(seconds=20), without_joins=True)
    every = client.watch(timeout=timedelta(seconds=20))
    try:
        assert next(quiet).kind == "snapshot" and next(every).kind == "snapshot"
        first = client.join("r0", [_RANK])
        second = client.join("r0", [_RANK])  # the first incarnation is evicted
        client.leave("r0", second, "done")
        assert [(e.kind, e.incarnation) for e in (next(every) for _ in range(4))] == [
            ("joined", first),
            ("evicted", first),
            ("joined", second),
            ("left", second),
        ]
        assert [(e.kind, e.incarnation) for e in (next(quiet) for _ in range(2))] == [
            ("evicted", first),
            ("left", second),
        ]
    finally:
        quiet.cancel()
        every.cancel()
        client.close()


def test_a_newer_quorum_without_this_replica_aborts_its_ring(
    quorum_thread: QuorumServerThread, token: str, tmp_path: Path
) -> None:
    """The demo's race after a quorum leader died: r1 sat in its ring's epoch (connecting, or
    exchanging alone) while r0 and r2 formed a newer quorum; the quorum event ends its wait."""
    client = QuorumClient(quorum_thread.address, token)
    ring, plan = _ring_at(0, "r1")  # the in-memory service numbers its first quorum 1
    stop = threading.Event()
    watch = RingWatch(
        _config(quorum_thread.address, token, tmp_path),
        ring=ring,
        plan=lambda: plan,
        stop=stop,
        rank=0,
    )
    try:
        watch.thread.start()
        _wait(watch.live, "the watch stream")
        incarnations = {r: client.join(r, [_RANK]) for r in ("r0", "r2")}
        assert not ring.broken
        with ThreadPoolExecutor(2) as pool:
            asks = [
                pool.submit(client.quorum, r, i, 0, timeout=timedelta(seconds=10))
                for r, i in incarnations.items()
            ]
            quorum = asks[0].result(timeout=15)
        assert {m.replica_id for m in quorum.members} == {"r0", "r2"}
        wait_for(lambda: ring.broken)
        assert ring.epoch == 0
    finally:
        stop.set()
        watch.close()
        ring.close()
        client.close()


def test_a_quorum_that_includes_this_replica_or_is_not_newer_leaves_its_ring_alone(
    tmp_path: Path,
) -> None:
    ring, plan = _ring_at(5, "r1")
    watch = _offline_watch(tmp_path, ring, lambda: plan)
    try:
        for quorum_id, members in ((6, ("r0", "r1")), (5, ("r0",)), (4, ("r0",))):
            event = MembershipEvent(
                kind="quorum", replica_id=None, quorum_id=quorum_id, reason="", members=members
            )
            watch._handle(event)
            assert not ring.broken, (quorum_id, members)
        watch._handle(
            MembershipEvent(kind="quorum", replica_id=None, quorum_id=6, reason="", members=("r0",))
        )
        assert ring.broken
    finally:
        watch.close()
        ring.close()


def test_an_eviction_dooms_every_plan_of_its_quorum_that_holds_the_replica(
    tmp_path: Path,
) -> None:
    """Overlapping failures: r0 is evicted while this rank still holds the plan of quorum 5,
    but quorum 6 (formed just before, with r0) is on its way. Its ring can never commit, so
    the rank must not rebuild it and wait for r0; a later quorum (a new incarnation of r0,
    if any) and a quorum without r0 are fine."""
    current = _plan(5, ("r0", "r1"))
    ring = FtarRing(FtarConfig(auth_key=b"k" * 32))
    watch = _offline_watch(tmp_path, ring, lambda: current)
    try:
        assert watch.gone_from(_plan(6, ("r0", "r1"))) is None
        watch._handle(
            MembershipEvent(kind="evicted", replica_id="r0", quorum_id=6, reason="", incarnation=1)
        )
        assert watch.gone_from(_plan(6, ("r0", "r1"))) == "r0"
        assert watch.gone_from(current) == "r0"
        assert watch.gone_from(_plan(7, ("r0", "r1"))) is None
        assert watch.gone_from(_plan(6, ("r1", "r2"))) is None
        # Its own replica's events never doom its plans (a teardown has its own path).
        watch._handle(
            MembershipEvent(kind="left", replica_id="r1", quorum_id=8, reason="", incarnation=1)
        )
        assert watch.gone_from(_plan(8, ("r1", "r2"))) is None
        # The current plan's epoch stays aborted: its rebuild, if not started yet, fails too.
        with pytest.raises(FtarAbortedError, match="epoch 5 was aborted"):
            ring.reconfigure([ring.address], 0, 5)
        ring.reconfigure([ring.address], 0, 7)
        assert not ring.broken
    finally:
        watch.close()
        ring.close()


def test_an_eviction_before_the_current_plan_formed_leaves_its_ring_alone(
    tmp_path: Path,
) -> None:
    """Quorum 6 formed after r0's old incarnation was evicted (at quorum 5): it holds r0's new
    incarnation, and the stale event must not abort it."""
    ring, _ = _ring_at(6, "r1")
    plan = _plan(6, ("r0", "r1"))
    watch = _offline_watch(tmp_path, ring, lambda: plan)
    try:
        watch._handle(
            MembershipEvent(kind="evicted", replica_id="r0", quorum_id=5, reason="", incarnation=1)
        )
        assert not ring.broken
        assert watch.gone_from(plan) is None
    finally:
        watch.close()
        ring.close()


def test_a_member_that_left_does_not_abort_the_exchange_but_dooms_later_rebuilds(
    tmp_path: Path,
) -> None:
    """A graceful leave comes after the leaver committed its last step: the exchange in flight
    may still complete (the last replica to finish the job's final step must not fail it), but
    no ring of that quorum is rebuilt with the member gone."""
    ring, _ = _ring_at(6, "r1")
    plan = _plan(6, ("r0", "r1"))
    watch = _offline_watch(tmp_path, ring, lambda: plan)
    try:
        watch._handle(
            MembershipEvent(kind="left", replica_id="r0", quorum_id=6, reason="", incarnation=1)
        )
        assert not ring.broken
        assert watch.gone_from(plan) == "r0"
        watch._handle(
            MembershipEvent(kind="evicted", replica_id="r0", quorum_id=6, reason="", incarnation=1)
        )
        assert ring.broken
    finally:
        watch.close()
        ring.close()


def test_an_eviction_seen_with_a_stale_plan_leaves_a_ring_already_at_a_newer_epoch(
    tmp_path: Path,
) -> None:
    """The race behind a 2 s stall: the watch reads the plan of quorum 5 (holding r0), the
    training thread moves on to quorum 6 (without r0) and starts rebuilding its ring, and only
    then does the watch abort for quorum 5. That abort must not break the ring of quorum 6; a
    newer plan that holds r0 too is aborted in turn."""
    ring, _ = _ring_at(6, "r1")
    plans = iter([_plan(5, ("r0", "r1")), _plan(6, ("r1", "r2"))])
    latest = _plan(6, ("r1", "r2"))

    def plan() -> StepPlan:
        return next(plans, latest)

    watch = _offline_watch(tmp_path, ring, plan)
    try:
        watch._handle(
            MembershipEvent(kind="evicted", replica_id="r0", quorum_id=6, reason="", incarnation=1)
        )
        assert not ring.broken
    finally:
        watch.close()
        ring.close()
    ring, _ = _ring_at(6, "r0")
    plans = iter([_plan(5, ("r0", "r1")), _plan(6, ("r0", "r1"))])
    latest = _plan(6, ("r0", "r1"))
    watch = _offline_watch(tmp_path, ring, plan)
    try:
        watch._handle(
            MembershipEvent(kind="evicted", replica_id="r0", quorum_id=6, reason="", incarnation=1)
        )
        assert ring.broken  # quorum 6 holds r0 as well: its ring is doomed too
    finally:
        watch.close()
        ring.close()
