"""What a replica's steps cost and carry, as the Manager accounts for them: when each step
started, the work the user reported (tokens, Σ seq_len², for the health service's fail-slow
predictor), how many micro-steps it trains (the quorum service's fail-slow planner may move
some) and how long its compute took (what the planner measures the replica's speed by)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from fthsdp.services.quorum.client import StepWork
from fthsdp.worker.step import WAITING_PHASES


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """A committed step, as the telemetry reports it."""

    started_at: float
    """Wall-clock time the step started (Unix seconds)."""
    waiting_s: float
    """Of its time, how long it waited on others (quorum, ring, exchange, vote, fetch)."""
    tokens: int
    sum_seq_len_sq: int


class StepAccount:
    """One rank's account of its replica's steps (every rank keeps the same one)."""

    def __init__(self, *, even: int, max_micro_steps: int) -> None:
        self._even = even
        self._max = max_micro_steps
        self.micro_steps = even
        """Micro-steps of the current step (`Manager.micro_steps`)."""
        self.started: float | None = None
        """Wall-clock start of the current step; None between steps."""
        self._work = (0, 0)
        self._busy = (0.0, 0)

    def start(self) -> None:
        """The step starts now, unless it started already."""
        if self.started is None:
            self.started = time.time()

    def report_work(self, tokens: int, sum_seq_len_sq: int) -> None:
        """The work of the current step (the last report counts)."""
        self._work = (tokens, sum_seq_len_sq)

    def request(self) -> StepWork:
        """What the leader tells the quorum service with the current step's request."""
        busy_seconds, busy_micro_steps = self._busy
        return StepWork(
            micro_steps=self.micro_steps,
            even=self._even,
            max_micro_steps=self._max,
            busy_seconds=busy_seconds,
            busy_micro_steps=busy_micro_steps,
        )

    def committed(self, seconds: Mapping[str, float], next_micro_steps: int) -> StepCost | None:
        """Closes the current step (its phases' `seconds`) and sets the next one's micro-steps;
        returns what it cost, or None for a step that never started here."""
        started, self.started = self.started, None
        (tokens, sum_seq_len_sq), self._work = self._work, (0, 0)
        trained, self.micro_steps = self.micro_steps, next_micro_steps
        if started is None:
            return None
        waiting = sum(seconds[phase] for phase in WAITING_PHASES)
        self._busy = (max(0.0, time.time() - started - waiting), trained)
        return StepCost(
            started_at=started, waiting_s=waiting, tokens=tokens, sum_seq_len_sq=sum_seq_len_sq
        )
