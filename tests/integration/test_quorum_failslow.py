"""Fail-slow mitigation in the quorum service, over real gRPC: leaders report their speed with
each Quorum call, the planner moves micro-steps from a slow replica to the fast ones through the
answers, Status shows why, and the policy `evict` tears the slowest replica down."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fthsdp.services.quorum.client import (
    AsyncQuorumClient,
    Quorum,
    RankEndpoint,
    StaleIncarnationError,
    StepWork,
)
from tests.integration.conftest import QuorumServerFactory

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
REPLICAS = ("r0", "r1", "r2")
EVEN = 4
SECONDS_PER_MICRO_STEP = {"r0": 0.05, "r1": 0.05, "r2": 0.10}
"""r2 computes at half the others' speed."""


async def _round(
    client: AsyncQuorumClient, incarnations: dict[str, int], step: int, shares: dict[str, int]
) -> list[Quorum | BaseException]:
    """One step: every replica asks, declaring its share and its last step's busy time."""

    async def ask(rid: str) -> Quorum:
        work = StepWork(
            micro_steps=shares[rid],
            even=EVEN,
            busy_seconds=SECONDS_PER_MICRO_STEP[rid] * shares[rid],
            busy_micro_steps=shares[rid],
        )
        return await client.quorum(
            rid, incarnations[rid], step, timeout=timedelta(seconds=10), work=work
        )

    return await asyncio.gather(*(ask(r) for r in incarnations), return_exceptions=True)


async def test_a_slow_replica_gets_fewer_micro_steps_and_status_says_why(
    make_quorum_server: QuorumServerFactory, token: str
) -> None:
    server = await make_quorum_server(failslow_policy="rebalance", min_replicas=2)
    async with AsyncQuorumClient(server.address, token) as client:
        incarnations = {rid: await client.join(rid, [RANK]) for rid in REPLICAS}
        shares = dict.fromkeys(REPLICAS, EVEN)
        for step in range(20):
            answers = await _round(client, incarnations, step, shares)
            quorum = answers[0]
            assert isinstance(quorum, Quorum)
            assert all(a == quorum for a in answers)  # one answer for every participant
            micro = quorum.micro_steps
            # What each replica declared for this step is what counts for its data and gradient.
            assert {r: micro.trained_by(r) for r in REPLICAS} == shares
            assert micro.total(quorum.healthy) == sum(shares.values())
            shares = {r: micro.next_for(r) for r in REPLICAS}
            assert sum(shares.values()) == EVEN * len(REPLICAS)  # the global batch stays
        assert shares == {"r0": 5, "r1": 5, "r2": 2}
        status = await client.status()
        (decision,) = [d for d in status.failslow if d.action == "rebalance"][-1:]
        assert dict(decision.shares) == {"r0": 5, "r1": 5, "r2": 2}
        assert "rebalance" in decision.reason and decision.evicted == ()


async def test_policy_evict_tears_the_slowest_replica_down(
    make_quorum_server: QuorumServerFactory, token: str
) -> None:
    server = await make_quorum_server(
        failslow_policy="evict", min_replicas=2, failslow_evict_cost=timedelta(seconds=1)
    )
    async with AsyncQuorumClient(server.address, token) as client:
        incarnations = {rid: await client.join(rid, [RANK]) for rid in REPLICAS}
        events = client.watch()
        evicted = None
        for step in range(20):
            answers = await _round(client, incarnations, step, dict.fromkeys(REPLICAS, EVEN))
            if any(isinstance(a, StaleIncarnationError) for a in answers):
                evicted = step
                break
        assert evicted is not None, "the slowest replica was never evicted"
        assert isinstance(answers[2], StaleIncarnationError)  # r2, the slow one
        assert all(isinstance(a, Quorum) and a.healthy == ("r0", "r1") for a in answers[:2])
        async for event in events:
            if event.kind == "evicted":
                assert event.replica_id == "r2" and event.teardown
                assert event.reason.startswith("fail-slow")
                break
        status = await client.status()
        assert status.failslow[-1].action == "evict"
        assert status.failslow[-1].evicted == ("r2",)


async def test_a_conditional_report_evicts_only_a_replica_the_service_no_longer_hears(
    make_quorum_server: QuorumServerFactory, token: str
) -> None:
    """ReportFailure's `unless_heard_within` (the health service behind a silent node agent):
    a replica that keeps asking stays; one that stopped is evicted once it has been quiet that
    long. Its leader's Watch stream does not count as hearing it."""
    server = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    quiet = timedelta(milliseconds=300)
    async with AsyncQuorumClient(server.address, token) as client:
        incarnation = await client.join("r0", [RANK])
        stream = client.watch(holder=("r0", incarnation))
        async for event in stream:  # the stream holds r0 alive from its snapshot on
            assert event.kind == "snapshot" and event.incarnation == incarnation
            break
        for step in range(3):  # it trains: every report comes within its quiet time
            last_ask = asyncio.get_running_loop().time()
            await client.quorum("r0", incarnation, step, timeout=timedelta(seconds=5))
            assert not await client.report_failure(
                "r0", "agent silent", reporter="health", unless_heard_within=quiet
            )
        (member,) = (await client.status()).members
        assert member.last_seen_ago == timedelta(0)  # held alive by its stream, not by a call
        while not await client.report_failure(  # it stops asking: evicted once quiet enough
            "r0", "agent silent", reporter="health", unless_heard_within=quiet
        ):
            assert asyncio.get_running_loop().time() - last_ask < 5.0, "never evicted"
            await asyncio.sleep(0.02)
        assert asyncio.get_running_loop().time() - last_ask >= quiet.total_seconds()
        assert "r0" not in {m.replica_id for m in (await client.status()).members}
