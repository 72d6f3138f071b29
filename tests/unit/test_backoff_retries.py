"""Retries: failures in a row draw growing jittered delays; a success starts afresh."""

from __future__ import annotations

import random

from fthsdp.services.common.backoff import Retries


def test_failures_in_a_row_grow_to_the_cap_and_a_success_starts_afresh() -> None:
    retries = Retries.after(0.2, 5.0, random.Random(7))
    bounds = [0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    for _ in range(50):
        delays = [retries.failed() for _ in bounds]
        assert all(0.0 <= d <= b for d, b in zip(delays, bounds, strict=True))
        retries.succeeded()
        assert retries.failed() <= 0.4  # a new run of failures starts from the first bound
        retries.succeeded()


def test_a_cadence_past_the_cap_keeps_its_first_bound() -> None:
    retries = Retries.after(4.0, 5.0, random.Random(7))
    delays = [retries.failed() for _ in range(20)]
    assert all(0.0 <= d <= 8.0 for d in delays) and max(delays) > 5.0


def test_a_capped_draw_stays_under_the_cap_while_the_bound_grows_on() -> None:
    retries = Retries.after(0.2, 30.0, random.Random(3))
    capped = [retries.failed(cap_s=1.0) for _ in range(8)]
    assert all(0.0 <= d <= 1.0 for d in capped)
    # the run's bound went on growing under the cap: the next uncapped draw may use it all
    assert max(retries.failed() for _ in range(30)) > 10.0
