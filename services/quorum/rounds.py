"""The records of a quorum round in flight: a replica's ask, the waiter holding its long-poll, the
tally of a formed round still being answered, and the round's server-side latency."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fthsdp.services.quorum.core import Formation
from fthsdp.services.quorum.domain import StepWork


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumAsk:
    """A Quorum call as the coordinator sees it."""

    replica_id: str
    """The asking replica."""
    incarnation: int
    """Its incarnation."""
    step: int
    """The step it is about to train."""
    commit_failed: bool = False
    """Its previous attempt failed to commit."""
    attempt_id: int = 0
    """Client id of the logical call (0 = none); a retry with it gets the same answer."""
    work: StepWork = field(default_factory=StepWork)
    """Its micro-steps and speed (fail-slow mitigation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundTiming:
    """Server-side latency of one round."""

    round: int
    """Formation counter."""
    participants: int
    """How many replicas it answered."""
    seconds: float
    """From the round's last arrival (or the timer that formed it) to every participant answered."""


class Tally:
    """Counts the participants of a formed round that still have to be answered."""

    __slots__ = ("pending", "round", "size", "started")

    def __init__(self, round_: int, started: float, size: int) -> None:
        self.round = round_
        self.started = started
        self.size = size
        self.pending = size


class Waiter:
    __slots__ = ("arrived", "ask", "future", "tally")

    def __init__(self, ask: QuorumAsk, future: asyncio.Future[Formation], arrived: float) -> None:
        self.ask = ask
        self.future = future
        self.arrived = arrived
        self.tally: Tally | None = None
