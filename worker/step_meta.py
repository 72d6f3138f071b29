"""What a replica's published state says about itself besides its tensors: the step it is at and
its data positions, and when a step is also written as a durable checkpoint."""

from __future__ import annotations

from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.data import DataPositions
from fthsdp.worker.peer_state import StateFetchError
from fthsdp.worker.plan import StepPlan

POSITIONS_META = "positions"
STEP_META = "step"


def state_meta(step: int, positions: DataPositions) -> dict[str, str | int]:
    """The metadata published with a replica's state at `step`."""
    return {STEP_META: step, POSITIONS_META: positions.to_json()}


def read_state_meta(meta: dict[str, str | int], *, expected_step: int) -> DataPositions:
    """The data positions of fetched state; raises StateFetchError if it is not at
    `expected_step` (a source that moved on, or a stale snapshot)."""
    step = int(meta[STEP_META])
    if step != expected_step:
        raise StateFetchError(f"fetched state is at step {step}, expected {expected_step}")
    return DataPositions.from_json(str(meta[POSITIONS_META]))


def durable_due(config: ManagerConfig, step: int, plan: StepPlan) -> bool:
    """Whether this replica writes `step` as a durable checkpoint: every `durable_every_steps`,
    by the first healthy replica alone, so one copy is written."""
    every = config.durable_every_steps
    return (
        every > 0
        and step > 0
        and step % every == 0
        and bool(plan.healthy)
        and min(plan.healthy) == config.replica_id
    )
