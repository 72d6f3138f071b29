"""Rounds against a real grpc.aio quorum server: many leaders, killed clients, silent replicas,
failure reports pushed to watchers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import pytest

from fthsdp.protos import quorum_pb2 as qpb
from fthsdp.services.quorum.client import (
    AsyncQuorumClient,
    MembershipEvent,
    Quorum,
    QuorumDecodeCache,
    RankEndpoint,
)
from fthsdp.services.quorum.domain import SOURCES_PER_RANK
from fthsdp.services.quorum.server import QuorumServer
from tests.integration.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]
LONG = timedelta(seconds=20)


def ranks(i: int, world: int = 2) -> list[RankEndpoint]:
    return [
        RankEndpoint(
            ftar=f"127.0.0.1:{20000 + 10 * i + r}", checkpoint=f"http://127.0.0.1:{30000 + i}"
        )
        for r in range(world)
    ]


@pytest.fixture
async def client(quorum_server: QuorumServer, token: str) -> AsyncIterator[AsyncQuorumClient]:
    c = AsyncQuorumClient(quorum_server.address, token)
    yield c
    await c.close()


async def next_event(stream: AsyncIterator[MembershipEvent], kind: str) -> MembershipEvent:
    async def find() -> MembershipEvent:
        async for event in stream:
            if event.kind == kind:
                return event
        raise AssertionError("watch stream ended")

    return await asyncio.wait_for(find(), 10)


async def form_round(
    client: AsyncQuorumClient, incs: dict[str, int], step: int
) -> dict[str, Quorum]:
    results = await asyncio.gather(
        *(client.quorum(rid, inc, step, timeout=LONG) for rid, inc in incs.items())
    )
    return dict(zip(incs, results, strict=True))


async def test_32_leaders_form_identical_rounds_for_several_steps(
    quorum_server: QuorumServer, token: str
) -> None:
    leaders = [AsyncQuorumClient(quorum_server.address, token) for _ in range(32)]
    try:
        ids = [f"replica-{i:02d}" for i in range(32)]
        incs = await asyncio.gather(
            *(c.join(rid, ranks(i)) for i, (c, rid) in enumerate(zip(leaders, ids, strict=True)))
        )
        for step in range(4):
            quorums = await asyncio.gather(
                *(
                    c.quorum(rid, inc, step, timeout=LONG)
                    for c, rid, inc in zip(leaders, ids, incs, strict=True)
                )
            )
            identities = {
                (q.quorum_id, tuple((m.replica_id, m.incarnation, m.step) for m in q.members))
                for q in quorums
            }
            assert len(identities) == 1
            assert [m.replica_id for m in quorums[0].members] == ids
            assert quorums[0].quorum_id == 1  # nobody changed: the epoch stays
            assert quorums[0].max_step == step
            assert quorums[0].num_healthy == 32
            # Each leader holds its own endpoints and its ring neighbours', no one else's.
            seventh = quorums[7]
            for i in (6, 7, 8):
                assert seventh.member(f"replica-{i:02d}").ranks == tuple(ranks(i))
            assert seventh.member("replica-20").ranks == ()
        timings = quorum_server.round_timings()
        assert [t.participants for t in timings] == [32] * 4
    finally:
        await asyncio.gather(*(c.close() for c in leaders))


class _Recording(QuorumDecodeCache):
    """A decode cache noting whose endpoints each answer to each caller carried."""

    def __init__(self) -> None:
        super().__init__()
        self.carried: dict[str, list[list[str]]] = {}

    def decode(self, msg: qpb.QuorumResponse, replica_id: str) -> Quorum | None:
        self.carried.setdefault(replica_id, []).append([e.replica_id for e in msg.endpoints])
        return super().decode(msg, replica_id)


async def test_a_membership_change_sends_each_leader_only_the_endpoints_it_lacks(
    quorum_server: QuorumServer, token: str
) -> None:
    """Ring a b c d; d leaves. a's ring was d a b and is now c a b: it gets c's endpoints and
    no others; b's ring did not change: nothing; c gets a's. Each still holds its whole ring."""
    ids = ["a", "b", "c", "d"]
    caches = {rid: _Recording() for rid in ids}
    leaders = {
        rid: AsyncQuorumClient(quorum_server.address, token, decode_cache=caches[rid])
        for rid in ids
    }
    try:
        incs = {rid: await leaders[rid].join(rid, ranks(i)) for i, rid in enumerate(ids)}

        async def round_of(members: list[str], step: int) -> dict[str, Quorum]:
            answers = await asyncio.gather(
                *(leaders[r].quorum(r, incs[r], step, timeout=LONG) for r in members)
            )
            return dict(zip(members, answers, strict=True))

        first = await round_of(ids, 0)
        assert [c.carried[r][-1] for r, c in caches.items()] == [
            ["a", "b", "d"], ["a", "b", "c"], ["b", "c", "d"], ["a", "c", "d"]
        ]  # fmt: skip
        assert first["a"].member("c").ranks == ()  # not a's neighbour
        await round_of(ids, 1)
        assert all(c.carried[r][-1] == [] for r, c in caches.items())  # steady: nothing
        await leaders["d"].leave("d", incs["d"])
        after = await round_of(ids[:3], 2)
        assert after["a"].quorum_id != first["a"].quorum_id
        assert [caches[r].carried[r][-1] for r in ids[:3]] == [["c"], [], ["a"]]
        for rid in ids[:3]:
            for j in range(3):  # every one of the three holds the whole ring's endpoints
                assert after[rid].member(ids[j]).ranks == tuple(ranks(j)), (rid, ids[j])
    finally:
        await asyncio.gather(*(c.close() for c in leaders.values()))


async def test_a_recovering_leader_gets_its_sources_endpoints_once(
    quorum_server: QuorumServer, token: str
) -> None:
    """r3 is behind: its ranks fetch from a few healthy sources, whose endpoints come with its
    first answer; while it stays behind in the same quorum, none come again."""
    ids = [f"r{i}" for i in range(7)]
    cache = _Recording()
    client = AsyncQuorumClient(quorum_server.address, token, decode_cache=cache)
    try:
        incs = {rid: await client.join(rid, ranks(i)) for i, rid in enumerate(ids)}
        for step in (9, 10):
            answers = await asyncio.gather(
                *(
                    client.quorum(rid, incs[rid], 0 if rid == "r3" else step, timeout=LONG)
                    for rid in ids
                )
            )
            mine = answers[3]
            sources = {rid for per_rank in mine.sources["r3"] for rid in per_rank}
            assert len(sources) == SOURCES_PER_RANK + 1  # 2 ranks, rotations one apart
            needed = sources | {"r2", "r3", "r4"}
            assert {m.replica_id for m in mine.members if m.ranks} == needed
            assert mine.member("r6").ranks == ()
        first, second = cache.carried["r3"]
        assert set(first) == needed and second == []
    finally:
        await client.close()


async def test_a_killed_client_does_not_count_in_the_round(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    # a and b ask only once c's process is gone: no heartbeat timeout may run out meanwhile
    # (starting that process alone took over a second on a loaded machine).
    server = await make_quorum_server(
        join_timeout=timedelta(milliseconds=300), heartbeat_timeout=timedelta(seconds=60)
    )
    client = AsyncQuorumClient(server.address, token)
    try:
        incs = {rid: await client.join(rid, ranks(i)) for i, rid in enumerate("abc")}
        script = (
            "import os, sys\n"
            "from datetime import timedelta\n"
            "from fthsdp.services.quorum.client import QuorumClient\n"
            "c = QuorumClient(sys.argv[1], os.environ['FTHSDP_TOKEN'])\n"
            "c.quorum('c', int(sys.argv[2]), 0, timeout=timedelta(seconds=60))\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", script, server.address, str(incs["c"])],
            cwd=ROOT,
            env={**os.environ, "FTHSDP_TOKEN": token},
        )
        try:

            async def c_waiting() -> bool:
                status = await client.status()
                return any(m.replica_id == "c" and m.waiting for m in status.members)

            await eventually(c_waiting)
        finally:
            proc.kill()
            proc.wait(timeout=10)

        async def c_dropped() -> bool:
            return not await c_waiting()

        await eventually(c_dropped)
        quorums = await form_round(client, {"a": incs["a"], "b": incs["b"]}, 0)
        assert [m.replica_id for m in quorums["a"].members] == ["a", "b"]
    finally:
        await client.close()


async def test_a_silent_replica_is_evicted_after_the_heartbeat_timeout(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    server = await make_quorum_server(
        heartbeat_timeout=timedelta(milliseconds=500), join_timeout=timedelta(seconds=30)
    )
    client = AsyncQuorumClient(server.address, token)
    try:
        incs = {rid: await client.join(rid, ranks(i)) for i, rid in enumerate("abc")}
        first = await form_round(client, incs, 0)
        silent_since = time.monotonic()  # c's last sign of life: its answered call
        survivors = await form_round(client, {"a": incs["a"], "b": incs["b"]}, 1)
        waited = time.monotonic() - silent_since
        quorum = survivors["a"]
        assert [m.replica_id for m in quorum.members] == ["a", "b"]
        assert quorum.quorum_id == first["a"].quorum_id + 1
        # c counted as live until it expired (0.5 s): the upper bound is the property, half the
        # join timeout (30 s) that would otherwise have dropped it.
        assert 0.4 <= waited < 15.0
        status = await client.status()
        assert [m.replica_id for m in status.members] == ["a", "b"]
    finally:
        await client.close()


async def test_report_failure_evicts_at_once_and_watchers_hear_it(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    server = await make_quorum_server(
        heartbeat_timeout=timedelta(seconds=10), join_timeout=timedelta(seconds=30)
    )
    client = AsyncQuorumClient(server.address, token)
    watcher = AsyncQuorumClient(server.address, token)
    try:
        incs = {rid: await client.join(rid, ranks(i)) for i, rid in enumerate("abc")}
        await form_round(client, incs, 0)
        stream = watcher.watch()
        events = aiter(stream)
        snapshot = await next_event(events, "snapshot")
        assert snapshot.members == ("a", "b", "c")
        assert snapshot.quorum_id == 1
        assert await client.report_failure("c", "rank 1 crashed", reporter="launcher") is True
        evicted = await next_event(events, "evicted")
        assert evicted.replica_id == "c"
        assert "rank 1 crashed" in evicted.reason
        assert evicted.members == ()  # watchers follow membership from the snapshot
        started = time.monotonic()
        survivors = await form_round(client, {"a": incs["a"], "b": incs["b"]}, 1)
        # The bound is the property: at once, not after the heartbeat timeout (10 s).
        assert time.monotonic() - started < 5.0
        assert [m.replica_id for m in survivors["a"].members] == ["a", "b"]
        new_quorum = await next_event(events, "quorum")
        assert new_quorum.quorum_id == 2
        assert new_quorum.members == ("a", "b")
        stream.cancel()
    finally:
        await watcher.close()
        await client.close()


async def test_recovering_replica_gets_sources_from_every_healthy_one(
    client: AsyncQuorumClient,
) -> None:
    incs = {rid: await client.join(rid, ranks(i, world=4)) for i, rid in enumerate("abc")}
    results = await asyncio.gather(
        client.quorum("a", incs["a"], 10, timeout=LONG),
        client.quorum("b", incs["b"], 10, timeout=LONG),
        client.quorum("c", incs["c"], 0, timeout=LONG),
    )
    quorum = results[2]
    assert quorum.max_step == 10
    assert quorum.healthy == ("a", "b")
    per_rank = quorum.sources["c"]
    assert len(per_rank) == 4
    assert all(sorted(order) == ["a", "b"] for order in per_rank)
    assert [order[0] for order in per_rank] == ["a", "b", "a", "b"]
