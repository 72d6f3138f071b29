"""The coordinator (rounds, incarnations, evictions, events) on a fake clock and the in-memory
store; no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.coordinator import Coordinator
from fthsdp.services.quorum.core import Formation, QuorumRecord
from fthsdp.services.quorum.domain import (
    RankEndpoint,
    StaleIncarnationError,
    SupersededRequestError,
    UnknownReplicaError,
    WorldSizeMismatchError,
)
from fthsdp.services.quorum.errors import ShuttingDownError, StoreUnavailableError
from fthsdp.services.quorum.events import Subscription
from fthsdp.services.quorum.rounds import QuorumAsk
from fthsdp.services.quorum.store import InMemoryStore

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
CONFIG = QuorumConfig(
    port=0,
    admin_port=None,
    join_timeout=timedelta(seconds=2),
    heartbeat_timeout=timedelta(seconds=1),
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store() -> InMemoryStore:
    return InMemoryStore()


@pytest.fixture
async def coord(clock: FakeClock, store: InMemoryStore) -> AsyncIterator[Coordinator]:
    coordinator = Coordinator(CONFIG, store, clock=clock, wall=lambda: 1.7e9)
    await coordinator.start(sweep=False)  # the test drives expiry with poll()
    yield coordinator
    await coordinator.close()


async def settle() -> None:
    """Lets spawned tasks (publication of a round) run."""
    for _ in range(5):
        await asyncio.sleep(0)


def start_ask(
    coord: Coordinator, rid: str, inc: int, step: int, **kw: object
) -> asyncio.Task[Formation]:
    return asyncio.create_task(
        coord.quorum(QuorumAsk(replica_id=rid, incarnation=inc, step=step, **kw))  # type: ignore[arg-type]
    )


def drain(sub: Subscription) -> list[tuple[str, str | None]]:
    events = []
    while not sub.queue.empty():
        event = sub.queue.get_nowait()
        assert event is not None
        events.append((event.kind, event.replica_id))
    return events


async def test_join_assigns_monotonic_incarnations_and_rejects_the_old_one(
    coord: Coordinator,
) -> None:
    first, _ = await coord.join("a", 1, [RANK])
    second, _ = await coord.join("a", 1, [RANK])
    assert second > first
    with pytest.raises(StaleIncarnationError, match="stale incarnation"):
        coord.heartbeat("a", first)
    with pytest.raises(StaleIncarnationError):
        await coord.quorum(QuorumAsk(replica_id="a", incarnation=first, step=0))
    assert coord.heartbeat("a", second) == 0
    with pytest.raises(UnknownReplicaError):
        coord.heartbeat("nobody", 1)


async def test_world_size_must_match_the_members(coord: Coordinator) -> None:
    await coord.join("a", 2, [RANK, RANK])
    with pytest.raises(WorldSizeMismatchError, match="same world size"):
        await coord.join("b", 1, [RANK])
    assert sorted(coord.state.registered) == ["a"]


async def test_everyone_in_a_round_gets_the_same_quorum(coord: Coordinator) -> None:
    incs = [(await coord.join(rid, 1, [RANK]))[0] for rid in "abc"]
    tasks = [start_ask(coord, rid, inc, 7) for rid, inc in zip("abc", incs, strict=True)]
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len({id(r.quorum) for r in results}) == 1
    assert [m.replica_id for m in results[0].quorum.members] == ["a", "b", "c"]
    assert results[0].quorum.quorum_id == 1
    assert coord.round_timings[-1].participants == 3


async def test_a_cancelled_long_poll_is_dropped_from_the_round(
    coord: Coordinator, clock: FakeClock
) -> None:
    incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "abc"}
    ghost = start_ask(coord, "c", incs["c"], 0)
    await settle()
    assert "c" in coord.state.waiting
    ghost.cancel()  # what grpc does to the handler when the client dies
    await settle()
    assert "c" not in coord.state.waiting
    a = start_ask(coord, "a", incs["a"], 0)
    b = start_ask(coord, "b", incs["b"], 0)
    await settle()
    assert not a.done()  # c is live (its call just ended) and did not ask: a and b wait
    clock.now += CONFIG.heartbeat_timeout.total_seconds()
    coord.poll()  # c expires
    quorum = (await asyncio.wait_for(a, 5)).quorum
    assert [m.replica_id for m in quorum.members] == ["a", "b"]
    assert (await b).quorum.quorum_id == quorum.quorum_id


async def test_a_retry_with_the_same_attempt_gets_the_same_answer(coord: Coordinator) -> None:
    inc_a, _ = await coord.join("a", 1, [RANK])
    first = await asyncio.wait_for(start_ask(coord, "a", inc_a, 0, attempt_id=42), 5)
    again = await asyncio.wait_for(start_ask(coord, "a", inc_a, 0, attempt_id=42), 5)
    assert again is first  # the answer was lost on the wire: no new round
    other = await asyncio.wait_for(start_ask(coord, "a", inc_a, 0, attempt_id=43), 5)
    assert other.record.round == first.record.round + 1


async def test_a_retry_while_waiting_takes_the_place_of_the_first_call(coord: Coordinator) -> None:
    incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "ab"}
    first = start_ask(coord, "a", incs["a"], 3)
    await settle()
    second = start_ask(coord, "a", incs["a"], 3)
    await settle()
    with pytest.raises(SupersededRequestError):
        await first
    b = start_ask(coord, "b", incs["b"], 3)
    formation = await asyncio.wait_for(second, 5)
    assert [a.replica_id for a in formation.participants] == ["a", "b"]
    assert (await b) is formation


async def test_heartbeat_expiry_evicts_and_tells_watchers(
    coord: Coordinator, clock: FakeClock
) -> None:
    incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "abc"}
    await asyncio.gather(*(start_ask(coord, r, i, 0) for r, i in incs.items()))
    sub = coord.subscribe()
    assert drain(sub) == [("snapshot", None)]
    clock.now += 0.6
    coord.heartbeat("a", incs["a"])
    coord.heartbeat("b", incs["b"])
    clock.now += 0.6  # c silent for 1.2 s > heartbeat timeout; a and b for 0.6 s
    coord.poll()
    assert sorted(coord.state.registered) == ["a", "b"]
    assert drain(sub) == [("evicted", "c")]
    with pytest.raises(StaleIncarnationError):
        coord.heartbeat("c", incs["c"])
    results = await asyncio.gather(
        start_ask(coord, "a", incs["a"], 1), start_ask(coord, "b", incs["b"], 1)
    )
    assert [m.replica_id for m in results[0].quorum.members] == ["a", "b"]
    assert results[0].quorum.quorum_id == 2
    await settle()
    assert drain(sub) == [("quorum", None)]


async def test_report_failure_fails_the_waiting_call_and_releases_the_others(
    coord: Coordinator,
) -> None:
    incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "abc"}
    await asyncio.gather(*(start_ask(coord, r, i, 0) for r, i in incs.items()))
    victim = start_ask(coord, "c", incs["c"], 1)
    a = start_ask(coord, "a", incs["a"], 1)
    await settle()
    assert coord.report_failure("c", None, "rank 3 died", "launcher") is True
    with pytest.raises(StaleIncarnationError, match="rank 3 died"):
        await victim
    b = start_ask(coord, "b", incs["b"], 1)
    assert [m.replica_id for m in (await asyncio.wait_for(a, 5)).quorum.members] == ["a", "b"]
    await b
    assert coord.report_failure("c", None, "again", "peer") is False  # idempotent
    with pytest.raises(UnknownReplicaError):
        coord.report_failure("never", None, "x", "peer")


async def test_leave_is_graceful_and_final(coord: Coordinator) -> None:
    inc, _ = await coord.join("a", 1, [RANK])
    sub = coord.subscribe()
    coord.leave("a", inc, "done")
    assert drain(sub) == [("snapshot", None), ("left", "a")]
    with pytest.raises(StaleIncarnationError):
        coord.leave("a", inc, "twice")


async def test_epochs_and_membership_survive_a_restart_with_the_same_store(
    clock: FakeClock, store: InMemoryStore
) -> None:
    first = Coordinator(CONFIG, store, clock=clock)
    await first.start(sweep=False)
    incs = {rid: (await first.join(rid, 1, [RANK]))[0] for rid in "ab"}
    await asyncio.gather(*(start_ask(first, r, i, 0) for r, i in incs.items()))
    inc_a2, _ = await first.join("a", 1, [RANK])  # a restarts: epoch 2 next round
    results = await asyncio.gather(
        start_ask(first, "a", inc_a2, 0), start_ask(first, "b", incs["b"], 1)
    )
    assert results[0].quorum.quorum_id == 2
    await settle()
    await first.close()

    second = Coordinator(CONFIG, store, clock=clock)
    await second.start(sweep=False)
    try:
        assert second.state.last_quorum_id == 2
        again = await asyncio.gather(
            start_ask(second, "a", inc_a2, 1), start_ask(second, "b", incs["b"], 1)
        )
        # same members after the restart: the fast path holds and the epoch does not move
        assert again[0].quorum.quorum_id == 2
        assert (await second.join("a", 1, [RANK]))[0] > inc_a2
    finally:
        await second.close()


async def test_close_fails_waiting_calls_as_shutting_down(coord: Coordinator) -> None:
    incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "ab"}
    waiting = start_ask(coord, "a", incs["a"], 0)
    sub = coord.subscribe()
    await settle()
    await coord.close()
    with pytest.raises(ShuttingDownError):
        await waiting
    drain_all = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert drain_all[-1] is None  # the Watch stream ends
    with pytest.raises(ShuttingDownError):
        await coord.join("c", 1, [RANK])


async def test_a_slow_watcher_is_cut_off_not_buffered_forever(clock: FakeClock) -> None:
    config = QuorumConfig(port=0, admin_port=None, watch_queue_size=4)
    coordinator = Coordinator(config, InMemoryStore(), clock=clock)
    await coordinator.start(sweep=False)
    try:
        sub = coordinator.subscribe()
        for i in range(10):
            await coordinator.join(f"r{i}", 1, [RANK])
        assert sub.overflowed
        assert sub.queue.get_nowait() is None
    finally:
        await coordinator.close()


class FlakyStore(InMemoryStore):
    """The in-memory store, with an outage switch for quorum writes and history reads."""

    down = False

    async def save_quorum(self, record: QuorumRecord) -> None:
        if self.down:
            raise ConnectionError("store down")
        await super().save_quorum(record)

    async def history(self, limit: int) -> list[QuorumRecord]:
        if self.down:
            raise ConnectionError("store down")
        return await super().history(limit)


async def test_a_store_outage_stops_new_epochs_only(clock: FakeClock) -> None:
    """Issue 23: while the store cannot write, rounds that keep the epoch and the membership are
    answered (training goes on), a new epoch is refused as unavailable (I3: never an id the
    store could lose) and is answered, with its event, only once a later round persisted it."""
    store = FlakyStore()
    coord = Coordinator(CONFIG, store, clock=clock, wall=lambda: 1.7e9)
    await coord.start(sweep=False)
    sub = coord.subscribe()
    try:
        incs = {rid: (await coord.join(rid, 1, [RANK]))[0] for rid in "abc"}

        async def round_of(step: int, rids: str, **kw: object) -> list[Formation | BaseException]:
            tasks = [start_ask(coord, rid, incs[rid], step, **kw) for rid in rids]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

        first = await round_of(1, "abc")
        epoch = first[0].quorum.quorum_id  # type: ignore[union-attr]
        drain(sub)
        store.down = True
        steady = await round_of(2, "abc")
        assert {f.quorum.quorum_id for f in steady} == {epoch}  # type: ignore[union-attr]
        with pytest.raises(StoreUnavailableError):
            await coord.status(history_limit=1)
        # A failed commit asks for a new epoch: refused while the store is down, and retried.
        failed = await round_of(2, "abc", commit_failed=True)
        assert all(isinstance(f, StoreUnavailableError) for f in failed), failed
        again = await round_of(2, "abc")
        assert all(isinstance(f, StoreUnavailableError) for f in again), again
        assert ("quorum", None) not in drain(sub)
        store.down = False
        back = await round_of(2, "abc")
        assert {f.quorum.quorum_id for f in back} == {epoch + 1}  # type: ignore[union-attr]
        assert (await store.last_quorum()).quorum_id == epoch + 1  # type: ignore[union-attr]
        assert ("quorum", None) in drain(sub)
    finally:
        await coord.close()
