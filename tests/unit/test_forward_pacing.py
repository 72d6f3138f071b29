"""ForwardPacing: an agent's forward delays after answers and after each kind of failure."""

from __future__ import annotations

import random

import grpc
import pytest

from fthsdp.services.health.config import MAX_FORWARD_INTERVAL
from fthsdp.services.health.forward_pacing import (
    UNREACHABLE_MAX_BACKOFF_S,
    ForwardPacing,
    central_busy,
)

LONGEST_S = MAX_FORWARD_INTERVAL.total_seconds()


@pytest.mark.parametrize(
    ("status", "ready", "busy"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, True, True),
        (grpc.StatusCode.CANCELLED, True, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True, True),
        # the same on a connection that is down: a cut link, not a busy central
        (grpc.StatusCode.DEADLINE_EXCEEDED, False, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, False),
        # reached, but nothing to do with load
        (grpc.StatusCode.UNAVAILABLE, True, False),
        (grpc.StatusCode.UNAUTHENTICATED, True, False),
        (grpc.StatusCode.INVALID_ARGUMENT, True, False),
        (None, True, False),
    ],
)
def test_only_a_timeout_or_refusal_on_a_live_connection_reads_as_busy(
    status: grpc.StatusCode | None, ready: bool, busy: bool
) -> None:
    assert central_busy(status, ready) is busy


def test_busy_failures_in_a_row_back_off_past_the_unreachable_cap_to_the_longest_interval() -> None:
    delays = []
    for seed in range(20):
        pacing = ForwardPacing(0.2, random.Random(seed))
        delays.append([pacing.failed(busy=True) for _ in range(12)])
    # bounds 0.4, 0.8, ... 25.6, then the longest interval central may ask for
    assert all(0.0 <= d <= LONGEST_S for run in delays for d in run)
    late = [run[-1] for run in delays]
    assert max(late) > UNREACHABLE_MAX_BACKOFF_S * 3
    assert sum(late) / len(late) > UNREACHABLE_MAX_BACKOFF_S  # uniform up to 30 s: mean ~15


def test_unreachable_failures_stay_within_a_few_seconds_even_after_a_busy_run() -> None:
    for seed in range(20):
        pacing = ForwardPacing(0.2, random.Random(seed))
        for _ in range(12):
            pacing.failed(busy=True)
        after = [pacing.failed(busy=False) for _ in range(50)]
        assert max(after) <= UNREACHABLE_MAX_BACKOFF_S
        assert max(after) > UNREACHABLE_MAX_BACKOFF_S / 2  # drawn up to the cap, not pinned low


def test_an_answer_ends_the_backoff_and_sets_the_cadence_central_asked_for() -> None:
    pacing = ForwardPacing(0.2, random.Random(1))
    for _ in range(12):
        pacing.failed(busy=True)
    assert pacing.answered(0) == 0.2 and pacing.asked_s == 0.0
    assert pacing.failed(busy=True) <= 0.4  # a fresh run of failures
    assert pacing.answered(9_000) == 9.0 and pacing.asked_s == 9.0
    # a uint32 off the wire is clamped to the longest interval central may ask for
    assert pacing.answered(2**32 - 1) == LONGEST_S
