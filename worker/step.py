"""What a step of the Manager is made of, as records: its outcome, and the state it passes
through between backward and commit."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fthsdp.worker.ftar import RecoverableFtarError
from fthsdp.worker.plan import StepPlan

WAITING_PHASES = ("quorum", "ring", "exchange", "fetch", "vote")
"""The parts of a step spent waiting on others: the quorum, the peers connecting a new ring,
the ring exchange, a catch-up fetch, and the replica's vote on the outcome (where a rank whose
ring was done waits for its replica's ranks still in theirs, e.g. behind another replica's
straggler)."""


class TooManyFailedCommits(RuntimeError):
    """The replica failed to commit `max_failed_commits` times in a row; it stops."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """What one committed step did (`Manager.should_commit`, the `on_commit` callback)."""

    step: int
    """The step that was committed (the replica now stands at step + 1)."""
    quorum_id: int
    """The quorum whose exchange committed."""
    healthy: tuple[str, ...]
    """The replicas whose gradients this step averaged."""
    recovered: bool
    """This replica caught up from peers in this step (it contributed zeros)."""
    trained: dict[str, tuple[int, int]]
    """Per contributing replica, the range of its shard's positions this step trained."""
    attempts: int
    """Exchanges tried (1 unless a peer failed mid-exchange)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of the phases: quorum, ring (rebuilding it for a new quorum), serve (publishing
    this rank's snapshot for recovering peers or a durable checkpoint; 0 when it published
    none), exchange, fetch, vote, commit."""
    without_control_plane: bool = False
    """Committed on the previous quorum while the quorum service was unreachable."""


@dataclass(kw_only=True, slots=True)
class OverlapState:
    """What the gradient hooks of the current step's backward did (`overlap_backward`)."""

    remaining: list[int]
    """Per bucket, the params whose gradient has not arrived yet."""
    captured: list[bool] = field(default_factory=list)
    plan: StepPlan | None = None
    quorum_s: float = 0.0
    ring_s: float = 0.0
    serve_s: float = 0.0
    ring_error: RecoverableFtarError | None = None
    launching: bool = False
    """The attempt has begun on the ring: captured buckets go out in bucket order."""
    error: Exception | None = None
    """Raised at the end of backward; the hooks do nothing more this step."""

    def __post_init__(self) -> None:
        if not self.captured:
            self.captured = [False] * len(self.remaining)


@dataclass(kw_only=True, slots=True)
class AgreedStep:
    """A step whose exchange the replica agreed on: `.grad` holds the averaged gradient and the
    step commits at `should_commit` (or at the next `start_step`, if the user skipped it)."""

    plan: StepPlan
    attempt: int
    recovered: bool
    seconds: dict[str, float]
    began: float
    """Monotonic time the step's exchange phase began."""

    def outcome(self, step: int, trained: dict[str, tuple[int, int]]) -> StepOutcome:
        """What committing it as `step` did, its total time ending now."""
        self.seconds["total"] = time.monotonic() - self.began
        return StepOutcome(
            step=step,
            quorum_id=self.plan.quorum_id,
            healthy=self.plan.healthy,
            recovered=self.recovered,
            trained=trained,
            attempts=self.attempt,
            seconds=self.seconds,
            without_control_plane=self.plan.fallback,
        )
