"""The QuorumStore contract, run against the in-memory store and the Redis store on a real
redis-server; plus what only Redis does: fencing by lease epoch and surviving a Redis crash."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
import redis.asyncio as aioredis

from fthsdp.services.quorum.core import QuorumRecord, Registration
from fthsdp.services.quorum.domain import RankEndpoint
from fthsdp.services.quorum.errors import FencedError
from fthsdp.services.quorum.lease import RedisLease
from fthsdp.services.quorum.store import InMemoryStore, QuorumStore
from fthsdp.services.quorum.store_redis import RedisQuorumStore
from tests.redis_support import RedisServer

PREFIX = "test:quorum"


def _reg(replica_id: str, incarnation: int) -> Registration:
    ranks = (RankEndpoint(ftar=f"10.0.0.1:{incarnation}", checkpoint="http://10.0.0.1:1"),)
    return Registration(replica_id=replica_id, incarnation=incarnation, world_size=1, ranks=ranks)


def _record(quorum_id: int, round_: int = 1) -> QuorumRecord:
    return QuorumRecord(
        quorum_id=quorum_id,
        round=round_,
        members=(("a", 1), ("b", 2)),
        max_step=7,
        healthy=("a",),
        reason="test",
        formed_unix=1.5,
    )


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> QuorumStore:
    if request.param == "memory":
        return InMemoryStore(history_size=3)
    client = request.getfixturevalue("redis_client")
    return RedisQuorumStore(client, prefix=PREFIX, history_size=3)


async def test_incarnations_grow_per_replica(store: QuorumStore) -> None:
    assert [await store.next_incarnation("a") for _ in range(3)] == [1, 2, 3]
    assert await store.next_incarnation("b") == 1


async def test_member_writes_are_conditional_on_incarnation(store: QuorumStore) -> None:
    await store.put_member(_reg("a", 2))
    await store.put_member(_reg("a", 1))  # a late write about an older incarnation
    assert await store.members() == [_reg("a", 2)]
    await store.remove_member("a", 1)  # the old incarnation's removal must not delete the new
    assert await store.members() == [_reg("a", 2)]
    await store.remove_member("a", 2)
    assert await store.members() == []


async def test_quorum_ids_never_go_back_and_history_is_bounded(store: QuorumStore) -> None:
    for quorum_id in (10, 11, 11, 12):
        await store.save_quorum(_record(quorum_id))
    with pytest.raises(ValueError, match="go back"):
        await store.save_quorum(_record(9))
    assert (await store.last_quorum()) == _record(12)
    assert [r.quorum_id for r in await store.history(0)] == [11, 11, 12]
    assert [r.quorum_id for r in await store.history(2)] == [11, 12]


@pytest.mark.redis
async def test_a_deposed_leaders_writes_are_fenced(redis_client: aioredis.Redis) -> None:
    ttl = timedelta(milliseconds=200)
    first = RedisLease(redis_client, prefix=PREFIX, holder="first", address="a:1")
    second = RedisLease(redis_client, prefix=PREFIX, holder="second", address="b:1")
    epoch1 = await first.try_acquire(ttl)
    assert epoch1 is not None
    assert await second.try_acquire(ttl) is None  # held
    fenced: list[bool] = []
    old = RedisQuorumStore(
        redis_client, prefix=PREFIX, fence=epoch1, on_fenced=lambda: fenced.append(True)
    )
    await old.save_quorum(_record(5))
    await redis_client.delete(first.key)  # the lease expired (the leader was partitioned away)
    epoch2 = await second.try_acquire(ttl)
    assert epoch2 is not None and epoch2 > epoch1
    assert not await first.renew(ttl)  # the old holder cannot renew someone else's lease
    with pytest.raises(FencedError):
        await old.save_quorum(_record(6))
    with pytest.raises(FencedError):
        await old.put_member(_reg("a", 9))
    assert fenced == [True, True]
    new = RedisQuorumStore(redis_client, prefix=PREFIX, fence=epoch2)
    assert (await new.last_quorum()) == _record(5)
    assert await new.members() == []
    await new.save_quorum(_record(6))


@pytest.mark.redis
async def test_lease_epochs_start_above_the_clock_on_an_empty_redis(
    redis_client: aioredis.Redis,
) -> None:
    """A Redis that lost its data must not restart epochs at 1 (clients would reject them)."""
    lease = RedisLease(redis_client, prefix=PREFIX, holder="x", address="x:1")
    epoch = await lease.try_acquire(timedelta(seconds=1))
    assert epoch is not None and epoch > 1_600_000_000_000
    store = RedisQuorumStore(redis_client, prefix=PREFIX)
    assert await store.epoch_floor() > 1_600_000_000_000  # no stored quorum: the clock floor
    await store.save_quorum(_record(42))
    assert await store.epoch_floor() == 42  # a stored quorum: failover keeps its id


@pytest.mark.redis
async def test_state_survives_a_redis_crash(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    store = RedisQuorumStore(client, prefix=PREFIX)
    await store.next_incarnation("a")
    await store.put_member(_reg("a", 1))
    await store.save_quorum(_record(77))
    await client.aclose()
    redis_server.kill()
    redis_server.start()
    client = aioredis.from_url(redis_server.url)
    try:
        store = RedisQuorumStore(client, prefix=PREFIX)
        assert await store.members() == [_reg("a", 1)]
        assert (await store.last_quorum()) == _record(77)
        assert await store.next_incarnation("a") == 2
    finally:
        await client.aclose()
