"""Exponential backoff with full jitter under an overall deadline, for every client's retries."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """How a client spaces its retries."""

    initial: timedelta = timedelta(milliseconds=50)
    """Upper bound of the first delay."""
    maximum: timedelta = timedelta(seconds=2)
    """Cap on any single delay."""
    multiplier: float = 2.0
    """Growth of the delay bound per attempt."""

    def __post_init__(self) -> None:
        if self.initial <= timedelta(0) or self.maximum < self.initial:
            raise ValueError("backoff needs 0 < initial <= maximum")
        if self.multiplier < 1.0:
            raise ValueError("backoff multiplier must be >= 1")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Endless delays in seconds: uniform in [0, bound], the bound growing to `maximum`."""
        draw = rng or random.Random()
        bound = self.initial.total_seconds()
        cap = self.maximum.total_seconds()
        while True:
            yield draw.uniform(0.0, bound)
            bound = min(cap, bound * self.multiplier)


def sleep_before_retry(delays: Iterator[float], deadline: float) -> bool:
    """Sleeps the next delay, clipped to the deadline (a `time.monotonic()` value).

    Returns False, without sleeping, once the deadline has passed: the caller gives up."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    time.sleep(min(next(delays), remaining))
    return True
