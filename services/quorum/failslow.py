"""Fail-slow mitigation across replicas (ResiHP's data-parallel level): how many micro-steps each
replica trains next, so that one slow replica does not pace the whole job.

Every step waits for the slowest replica at the cross-replica exchange. With the global batch
split into micro-steps (forward and backward passes accumulated into one gradient), the planner
can move micro-steps from a slow replica to the fast ones (`rebalance`), or drop the slow
replica from the quorum (`evict`: it is torn down, restarts and comes back through catch-up),
or do nothing (`keep`). `choose` is the pure decision; `FailSlowPlanner` holds the measured
speeds and the current choice, and is driven by the coordinator, the single writer of shares.

A replica's speed is micro-steps per second of compute, from what its leader reports with each
Quorum call (its last committed step's busy time and micro-steps): the median of its last few.
Predicted throughput of a split is total micro-steps / the slowest replica's time. Among the
options the policy allows, the planner takes the one with the highest predicted micro-steps per
second over `horizon_s`, where an eviction costs `evict_cost_s` of the whole job's progress, and
it changes the current choice only for a predicted gain of at least `min_gain`, and not within
`dwell_steps` of its last change: measurements are noisy, and a choice that flips every step is
worse than either. Leaving the even split takes more: the same move (same action, same replicas
losing micro-steps) must have been the best for `confirm_rounds` rounds in a row. On shared
hosts a healthy replica is now and then a third slower for a few steps; a fail-slow lasts."""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Literal

from fthsdp.services.quorum import core
from fthsdp.services.quorum.core import CoreState
from fthsdp.services.quorum.domain import FAILSLOW_POLICIES, FailSlowDecision, StepWork

Policy = Literal["off", "rebalance", "evict", "auto"]
Action = Literal["keep", "rebalance", "evict"]

_ALLOWED: dict[Policy, tuple[Action, ...]] = {
    "off": ("keep",),
    "rebalance": ("keep", "rebalance"),
    "evict": ("keep", "evict"),
    "auto": ("keep", "rebalance", "evict"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One option the planner weighed."""

    action: Action
    shares: Mapping[str, int]
    """Micro-steps per replica in the next step (the evicted ones absent)."""
    evicted: tuple[str, ...] = ()
    rate: float = 0.0
    """Predicted micro-steps per second over the horizon."""


def step_time(shares: Mapping[str, int], speeds: Mapping[str, float]) -> float:
    """Seconds of the slowest replica's compute under `shares`."""
    return max((k / speeds[r] for r, k in shares.items() if k), default=0.0)


def _rate(shares: Mapping[str, int], speeds: Mapping[str, float]) -> float:
    seconds = step_time(shares, speeds)
    return sum(shares.values()) / seconds if seconds > 0 else 0.0


def balanced(speeds: Mapping[str, float], total: int, cap: int) -> dict[str, int]:
    """Integer shares summing to `total` (if the cap allows), each in [1, cap], that minimise the
    slowest replica's time: every replica starts with one micro-step (so it stays measured and
    the even split can come back), then each further micro-step goes to the replica that would
    finish it first. Ties go to the lower replica id, so the result is deterministic."""
    shares = dict.fromkeys(speeds, 1)
    heap = [((1 + 1) / speed, rid) for rid, speed in speeds.items() if cap > 1]
    heapq.heapify(heap)
    for _ in range(total - len(speeds)):
        if not heap:
            break
        _, rid = heapq.heappop(heap)
        shares[rid] += 1
        if shares[rid] < cap:
            heapq.heappush(heap, ((shares[rid] + 1) / speeds[rid], rid))
    return shares


def settled(speeds: Mapping[str, float], margin: float) -> dict[str, float]:
    """`speeds` with every replica that is not slow set to the typical speed: the median of the
    faster half. Slow means below that by more than `margin` (a fraction). Healthy replicas
    differ by noise, and shares chased after noise would move back and forth every few steps
    between replicas that are all fine."""
    ordered = sorted(speeds.values())
    typical = statistics.median(ordered[len(ordered) // 2 :])
    return {r: s if s < (1 - margin) * typical else typical for r, s in speeds.items()}


def options(
    speeds: Mapping[str, float],
    *,
    even: int,
    max_micro_steps: int,
    evict_cost_s: float,
    horizon_s: float,
    min_replicas: int,
    protected: frozenset[str] = frozenset(),
) -> dict[Action, Choice]:
    """Every option with its predicted rate, for replicas with known speeds (> 0). The slowest
    replica is the eviction candidate unless it is `protected` (evicted within the horizon)."""
    total = even * len(speeds)
    cap = max_micro_steps or total
    keep = dict.fromkeys(speeds, even)
    out: dict[Action, Choice] = {
        "keep": Choice(action="keep", shares=keep, rate=_rate(keep, speeds))
    }
    if len(speeds) >= 2:
        shares = balanced(speeds, total, max(cap, even))
        out["rebalance"] = Choice(action="rebalance", shares=shares, rate=_rate(shares, speeds))
    slowest = min(speeds, key=lambda r: (speeds[r], r))
    if len(speeds) > max(1, min_replicas) and slowest not in protected:
        rest = {r: s for r, s in speeds.items() if r != slowest}
        kept = dict.fromkeys(rest, even)
        amortised = max(0.0, 1.0 - evict_cost_s / horizon_s) if horizon_s > 0 else 0.0
        out["evict"] = Choice(
            action="evict", shares=kept, evicted=(slowest,), rate=_rate(kept, rest) * amortised
        )
    return out


def choose(
    policy: Policy,
    options_: Mapping[Action, Choice],
    current: Choice | None,
    *,
    min_gain: float,
) -> Choice:
    """The allowed option with the best predicted rate; `current` (re-rated for the latest
    speeds) stays unless the best beats it by `min_gain` (a fraction)."""
    allowed = [options_[a] for a in _ALLOWED[policy] if a in options_]
    best = max(allowed, key=lambda c: c.rate)
    if current is None or current.action not in _ALLOWED[policy]:
        return options_["keep"] if best.rate <= options_["keep"].rate * (1 + min_gain) else best
    if best.rate > current.rate * (1 + min_gain):
        return best
    return current


def _describe(chosen: Choice, options_: Mapping[Action, Choice]) -> str:
    rates = ", ".join(f"{a} {c.rate:.2f}" for a, c in sorted(options_.items()))
    return f"predicted micro-steps/s: {rates}; chose {chosen.action}"


@dataclass(slots=True)
class _Speed:
    incarnation: int
    samples: int = 0
    recent: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=_WINDOW))
    """Seconds per micro-step of its latest steps."""

    @property
    def seconds_per_micro_step(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


_WINDOW = 7
"""Steps a speed is the median of: a step's compute time on a shared host jumps by tens of
percent now and then, and one such step must not move micro-steps; four slow steps in a row
turn the median (and a move then stands once confirmed: `FailSlowPlanner` confirm_rounds)."""


class FailSlowPlanner:
    """The coordinator's planner: speeds from Quorum calls, shares for each round."""

    WARMUP_STEPS = 2
    """Measurements ignored after a (re)join: the first steps pay one-time costs."""

    def __init__(
        self,
        policy: Policy,
        *,
        horizon_s: float = 60.0,
        evict_cost_s: float = 10.0,
        min_gain: float = 0.15,
        margin: float = 0.3,
        dwell_steps: int = 8,
        confirm_rounds: int = 8,
        min_replicas: int = 1,
        history: int = 32,
    ) -> None:
        if policy not in FAILSLOW_POLICIES:
            raise ValueError(f"fail-slow policy must be one of {', '.join(FAILSLOW_POLICIES)}")
        self.policy = policy
        self._horizon = horizon_s
        self._evict_cost = evict_cost_s
        self._min_gain = min_gain
        self._margin = margin
        self._dwell = dwell_steps
        self._changed_step = -dwell_steps
        self._confirm = confirm_rounds
        self._candidate: tuple[tuple[Action, frozenset[str]], int] | None = None
        """A departure from the even split that was the best in the last rounds, and how many."""
        self._min_replicas = min_replicas
        self._speeds: dict[str, _Speed] = {}
        self._current: Choice | None = None
        self._evicted_at: dict[str, float] = {}
        self.decisions: deque[FailSlowDecision] = deque(maxlen=history)

    def observe(self, replica_id: str, incarnation: int, work: StepWork) -> None:
        """A Quorum call's report of its last committed step."""
        if self.policy == "off":
            return
        speed = self._speeds.get(replica_id)
        if speed is None or speed.incarnation != incarnation:
            speed = self._speeds[replica_id] = _Speed(incarnation)
        if work.busy_seconds <= 0 or work.busy_micro_steps <= 0:
            return
        speed.samples += 1
        if speed.samples <= self.WARMUP_STEPS:
            return
        speed.recent.append(work.busy_seconds / work.busy_micro_steps)

    def forget(self, replica_id: str) -> None:
        """The replica left or was evicted."""
        self._speeds.pop(replica_id, None)

    def speeds(self, replicas: Iterable[str]) -> dict[str, float]:
        """Micro-steps per second of each replica; a replica not measured yet counts as the
        median of the measured ones (empty when none is measured)."""
        known = {
            r: 1.0 / s.seconds_per_micro_step
            for r in replicas
            if (s := self._speeds.get(r)) is not None and s.seconds_per_micro_step > 0
        }
        if not known:
            return {}
        median = statistics.median(known.values())
        return {r: known.get(r, median) for r in replicas}

    def plan_round(self, state: CoreState, now: float) -> tuple[dict[str, int], tuple[str, ...]]:
        """`plan` for the round that would form now: its replicas at the largest step, the even
        share most of them declare, and the smallest limit any of them declares."""
        asks = state.waiting.values()
        step = max(a.step for a in asks)
        healthy = tuple(sorted(a.replica_id for a in asks if a.step == step))
        limits = [a.work.max_micro_steps for a in asks if a.work.max_micro_steps]
        return self.plan(healthy, core.even_share(asks), min(limits, default=0), step, now)

    def plan(
        self, healthy: tuple[str, ...], even: int, max_micro_steps: int, step: int, now: float
    ) -> tuple[dict[str, int], tuple[str, ...]]:
        """(next shares of the healthy replicas, replicas to evict now) for a round at `now`
        (monotonic seconds). A replica it evicted comes back as a new incarnation and is not
        evicted again within the horizon: only a measure taken back in the quorum tells whether
        it recovered, and evicting it at once again would cost the job every time."""
        if self.policy == "off" or not healthy:
            return dict.fromkeys(healthy, even), ()
        speeds = self.speeds(healthy)
        if len(speeds) != len(healthy):
            return dict.fromkeys(healthy, even), ()
        speeds = settled(speeds, self._margin)
        opts = options(
            speeds,
            even=even,
            max_micro_steps=max_micro_steps,
            evict_cost_s=self._evict_cost,
            horizon_s=self._horizon,
            min_replicas=self._min_replicas,
            protected=frozenset(r for r, t in self._evicted_at.items() if now - t < self._horizon),
        )
        current = self._current
        if current is not None and set(current.shares) != set(healthy):
            current = None  # the membership changed: start from the even split
        elif current is not None:
            current = dataclasses.replace(current, rate=_rate(current.shares, speeds))
        if current is not None and step - self._changed_step < self._dwell:
            chosen = current  # a choice stands a few steps before it is weighed again
        else:
            chosen = choose(self.policy, opts, current, min_gain=self._min_gain)
            chosen = self._confirmed(chosen, current, opts["keep"], even)
        changed = current is None or chosen.shares != current.shares or chosen.evicted
        before = current.shares if current is not None else dict.fromkeys(healthy, even)
        if chosen.shares != before or chosen.evicted:
            self._changed_step = step
        previous = self._current
        self._current = dataclasses.replace(chosen, evicted=())
        if changed and not (previous is None and chosen.action == "keep"):
            self._record(step, chosen, opts, even)
        if chosen.evicted:
            for rid in chosen.evicted:
                self.forget(rid)
                self._evicted_at[rid] = now
            self._current = None
        return dict(chosen.shares), chosen.evicted

    def _confirmed(self, chosen: Choice, current: Choice | None, keep: Choice, even: int) -> Choice:
        """`chosen`, unless it leaves the even split before the same move was the best for
        `confirm_rounds` rounds in a row (then the even split stays)."""
        if chosen.action == "keep" or (current is not None and current.action != "keep"):
            self._candidate = None
            return chosen
        losing = frozenset(r for r, k in chosen.shares.items() if k < even) | set(chosen.evicted)
        key = (chosen.action, losing)
        rounds = self._candidate[1] + 1 if self._candidate and self._candidate[0] == key else 1
        if rounds < self._confirm:
            self._candidate = (key, rounds)
            return current if current is not None else keep
        self._candidate = None
        return chosen

    def _record(self, step: int, chosen: Choice, opts: Mapping[Action, Choice], even: int) -> None:
        if self.decisions and chosen.action == "keep" and self.decisions[-1].action == "keep":
            return
        self.decisions.append(
            FailSlowDecision(
                decided_at=datetime.now(UTC),
                step=step,
                action=chosen.action,
                shares=MappingProxyType({r: k for r, k in chosen.shares.items() if k != even}),
                evicted=chosen.evicted,
                reason=_describe(chosen, opts),
            )
        )
