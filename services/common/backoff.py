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

    def bounds(self) -> Iterator[float]:
        """Endless upper bounds of the delays in seconds, growing from `initial` to `maximum`."""
        bound = self.initial.total_seconds()
        cap = self.maximum.total_seconds()
        while True:
            yield bound
            bound = min(cap, bound * self.multiplier)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """Endless delays in seconds: uniform in [0, bound], for each of `bounds()`."""
        draw = rng or random.Random()
        return (draw.uniform(0.0, bound) for bound in self.bounds())


class Retries:
    """The delays of a loop that retries after failures in a row: each failure draws the next
    delay of a `Backoff` run, and a success makes the next failure start a fresh run."""

    def __init__(self, backoff: Backoff, rng: random.Random | None = None) -> None:
        self._backoff = backoff
        self._rng = rng or random.Random()
        self._run: Iterator[float] | None = None
        """The bounds of the current run (None: no failure since the last success)."""

    @classmethod
    def after(cls, interval_s: float, cap_s: float, rng: random.Random | None = None) -> Retries:
        """Retries of a loop that runs every `interval_s`: the first delay up to twice that,
        the bound growing to `cap_s` (or twice the interval, if that is more)."""
        first = timedelta(seconds=2 * interval_s)
        return cls(Backoff(initial=first, maximum=max(first, timedelta(seconds=cap_s))), rng)

    def failed(self, cap_s: float | None = None) -> float:
        """The delay before the next try, in seconds: uniform up to the run's bound, or up to
        `cap_s` if that is less (the bound grows all the same)."""
        if self._run is None:
            self._run = self._backoff.bounds()
        bound = next(self._run)
        return self._rng.uniform(0.0, bound if cap_s is None else min(bound, cap_s))

    def succeeded(self) -> None:
        """The failures in a row are over."""
        self._run = None


def sleep_before_retry(delays: Iterator[float], deadline: float) -> bool:
    """Sleeps the next delay, clipped to the deadline (a `time.monotonic()` value).

    Returns False, without sleeping, once the deadline has passed: the caller gives up."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    time.sleep(min(next(delays), remaining))
    return True
