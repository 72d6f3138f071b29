"""The quorum clients' one retry rule (`CallRetry`), driven by hand with a fake clock: which
instance each attempt asks, when a refusal waits, and when the call gives up."""

from __future__ import annotations

import itertools
from datetime import timedelta

import grpc
import pytest

from fthsdp.services.quorum.client import AsyncQuorumClient
from fthsdp.services.quorum.client_failover import Failover
from fthsdp.services.quorum.client_retry import CallRetry
from fthsdp.services.quorum.domain import QuorumTimeoutError, QuorumUnavailableError

DELAY = 0.25


def _retry(
    addresses: int,
    *,
    connect_timeout: float = 30.0,
    deadline: float | None = None,
    unavailable_budget: float | None = None,
) -> CallRetry:
    return CallRetry(
        Failover([f"h{i}:1" for i in range(addresses)]),
        itertools.repeat(DELAY),
        now=0.0,
        rpc_timeout=5.0,
        connect_timeout=connect_timeout,
        deadline=deadline,
        unavailable_budget=unavailable_budget,
    )


def _refused(n: int) -> QuorumUnavailableError:
    return QuorumUnavailableError(f"refusal {n}")


def test_a_refusal_moves_to_the_next_instance_at_once_and_waits_after_a_full_round() -> None:
    retry = _retry(3)
    waits, asked = [], []
    for n in range(6):
        attempt = retry.attempt(now=float(n))
        asked.append(attempt.index)
        assert attempt.timeout == 5.0  # a short RPC: each attempt gets the RPC timeout
        waits.append(retry.refused(attempt, _refused(n), now=float(n)))
    assert asked == [0, 1, 2, 0, 1, 2]
    assert waits == [0.0, 0.0, DELAY, 0.0, 0.0, DELAY]


def test_a_short_call_gives_up_after_the_connect_timeout_with_the_last_refusal() -> None:
    retry = _retry(1, connect_timeout=1.0)
    attempt = retry.attempt(now=0.0)
    assert retry.refused(attempt, _refused(0), now=0.9) == pytest.approx(0.1)  # clipped
    last = _refused(1)
    with pytest.raises(QuorumUnavailableError) as caught:
        retry.refused(retry.attempt(now=1.0), last, now=1.0)
    assert caught.value is last


def test_a_long_poll_spends_its_deadline_across_attempts() -> None:
    retry = _retry(1, deadline=10.0)
    assert retry.attempt(now=4.0).timeout == 6.0
    retry.refused(retry.attempt(now=4.0), _refused(0), now=4.0)
    with pytest.raises(QuorumUnavailableError, match="refusal 0"):
        retry.attempt(now=10.0)


def test_a_deadline_passed_before_any_attempt_is_a_timeout() -> None:
    retry = _retry(2, deadline=1.0)
    with pytest.raises(QuorumTimeoutError):
        retry.attempt(now=1.5)


def test_the_unavailable_budget_ends_the_call_once_every_instance_refused() -> None:
    retry = _retry(2, deadline=60.0, unavailable_budget=2.0)
    # the budget counts only once both instances refused, from the first refusal
    assert retry.refused(retry.attempt(now=0.0), _refused(0), now=0.0) == 0.0
    assert retry.refused(retry.attempt(now=0.1), _refused(1), now=0.1) == DELAY
    assert retry.refused(retry.attempt(now=1.0), _refused(2), now=1.0) == 0.0
    with pytest.raises(QuorumUnavailableError, match="refusal 3"):
        retry.refused(retry.attempt(now=2.0), _refused(3), now=2.0)


def test_a_zero_budget_tries_each_instance_once() -> None:
    retry = _retry(3, deadline=60.0, unavailable_budget=0.0)
    assert retry.refused(retry.attempt(now=0.0), _refused(0), now=0.0) == 0.0
    assert retry.refused(retry.attempt(now=0.0), _refused(1), now=0.0) == 0.0
    with pytest.raises(QuorumUnavailableError, match="refusal 2"):
        retry.refused(retry.attempt(now=0.0), _refused(2), now=0.0)


def test_another_threads_advance_is_not_undone() -> None:
    failover = Failover(["a:1", "b:1"])
    retry = CallRetry(
        failover, itertools.repeat(DELAY), now=0.0, rpc_timeout=1.0, connect_timeout=5.0
    )
    attempt = retry.attempt(now=0.0)
    failover.advance(0)  # a concurrent call already moved on to b
    retry.refused(attempt, _refused(0), now=0.0)
    assert failover.current == 1


async def test_a_shared_channel_names_the_one_instance_it_reaches() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="one address"):
            AsyncQuorumClient("127.0.0.1:1,127.0.0.1:2", "t" * 32, channel=channel)
        client = AsyncQuorumClient(
            "127.0.0.1:1", "t" * 32, channel=channel, connect_timeout=timedelta(0)
        )
        with pytest.raises(QuorumUnavailableError):
            await client.status()
        await client.close()
    finally:
        await channel.close(None)
