"""TransitDelays: a batch held up in the network is refused, clocks that drift or step are not."""

from __future__ import annotations

import pytest

from fthsdp.services.health.transit import LATE_S, RESYNC_S, TransitDelays

AGENT = ("host-a", "agent:host-a")
SKEW = 37.5
"""The agent's clock is behind the receiver's by this much: only changes of it matter."""


def _sent(transit: TransitDelays, sent_at: float, now: float) -> float | None:
    return transit.late(AGENT, now - sent_at, now)


def test_forwards_held_up_behind_a_cut_link_are_refused_and_the_next_fresh_one_is_not() -> None:
    transit = TransitDelays()
    now = 1000.0
    for i in range(10):  # every 200 ms, a few ms in transit
        assert _sent(transit, now - SKEW - 0.003 * (i % 3), now) is None
        now += 0.2
    cut_at = now - SKEW
    now += 6.0  # the link is back: the forwards sent 6, 5.5 and 4 s ago arrive at once
    late = [_sent(transit, cut_at + dt, now) for dt in (0.0, 0.5, 2.0)]
    assert late == pytest.approx([6.0, 5.5, 4.0], abs=0.01)
    assert _sent(transit, now - SKEW, now) is None


def test_a_batch_up_to_late_s_late_is_taken() -> None:
    transit = TransitDelays()
    assert _sent(transit, 100.0, 100.0 + SKEW) is None
    assert _sent(transit, 100.2, 100.2 + SKEW + LATE_S - 0.01) is None
    assert _sent(transit, 100.4, 100.4 + SKEW + LATE_S + 0.5) is not None


def test_slow_clock_drift_is_followed() -> None:
    transit = TransitDelays()
    now = 0.0
    offset = SKEW
    for _ in range(36_000):  # two hours at 5 batches/s; the sender's clock loses 500 ppm
        assert transit.late(AGENT, offset, now) is None
        now += 0.2
        offset += 0.2 * 500e-6
    assert offset - SKEW > LATE_S  # drifted past the threshold, and never refused


def test_a_clock_stepped_back_is_refused_for_resync_s_then_taken() -> None:
    transit = TransitDelays()
    now = 0.0
    assert transit.late(AGENT, SKEW, now) is None
    step = SKEW + 30.0  # the sender's clock jumped 30 s back
    refused_until = None
    while now < 3 * RESYNC_S:
        now += 0.2
        if transit.late(AGENT, step, now) is None:
            refused_until = now
            break
    assert refused_until is not None and RESYNC_S <= refused_until < RESYNC_S + 0.5
    assert transit.late(AGENT, step, now + 0.2) is None


def test_a_clock_stepped_forward_is_taken_at_once_and_becomes_the_reference() -> None:
    transit = TransitDelays()
    assert transit.late(AGENT, SKEW, 0.0) is None
    assert transit.late(AGENT, SKEW - 30.0, 0.2) is None
    assert transit.late(AGENT, SKEW - 30.0 + LATE_S + 1.0, 0.4) is not None


def test_senders_are_judged_apart() -> None:
    transit = TransitDelays()
    assert transit.late(AGENT, SKEW, 0.0) is None
    assert transit.late(("host-b", "agent:host-b"), SKEW + 10.0, 0.0) is None
    assert transit.late(("host-a", "rank:r0/0"), SKEW + 10.0, 0.0) is None
    assert transit.late(AGENT, SKEW + 10.0, 0.2) is not None
