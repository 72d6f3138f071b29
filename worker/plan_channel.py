"""A replica's step plans: the leader asks the quorum service (off the training thread, so the
request overlaps the forward pass) and broadcasts the answer; every rank derives its own plan.

In the steady state (only `max_step` moved on) the ranks exchange just that number, in one
small collective, and reuse their previous plan; any other change sends the whole plan."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

from fthsdp.services.quorum.client import StepWork
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.plan import StepPlan, decode_plan, fallback_payload, steady_max_step
from fthsdp.worker.quorum_link import QuorumLink
from fthsdp.worker.replica_group import ReplicaGroup

_STEADY = -1
"""Plan header kind: the previous plan with a new max_step (no payload follows)."""


class PlanChannel:
    """One rank's end of its replica's plan broadcast (the leader's also asks the service)."""

    def __init__(
        self,
        config: ManagerConfig,
        group: ReplicaGroup,
        link: QuorumLink | None,
    ) -> None:
        if group.is_leader != (link is not None):
            raise ValueError("the replica leader, and only it, has a quorum link")
        self._config = config
        self._group = group
        self._link = link
        # Its own thread: a quorum request never queues behind a catch-up fetch or a record.
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fthsdp-quorum")
            if link is not None
            else None
        )
        self._pending: Future[bytes] | None = None
        self.plan: StepPlan | None = None
        """The plan received last (None before the first)."""
        self._sent: bytes | None = None
        """Leader: the last payload broadcast in full."""

    def request(
        self, step: int, *, commit_failed: bool = False, work: StepWork | None = None
    ) -> None:
        """Leader: asks for `step`'s quorum in the background unless a request is out already
        (`work`: the replica's micro-steps and speed, for the fail-slow planner); other ranks:
        nothing."""
        if self._executor is not None and self._pending is None:
            self._pending = self._executor.submit(self._ask, step, commit_failed, work)

    def _ask(self, step: int, commit_failed: bool, work: StepWork | None) -> bytes:
        assert self._link is not None
        fallback = None
        if not commit_failed and self._config.control_plane_grace is not None:
            fallback = fallback_payload(self.plan, self._sent, step)
        return self._link.request(step, commit_failed=commit_failed, fallback=fallback, work=work)

    def receive(self) -> StepPlan:
        """The leader's answer to the last request, on every rank (a collective)."""
        payload = None
        header = None
        if self._link is not None:
            assert self._pending is not None, "receive() without request()"
            payload = self._pending.result()
            self._pending = None
            steady = None if self.plan is None else steady_max_step(self._sent, payload)
            header = [_STEADY, steady] if steady is not None else [len(payload), 0]
        kind, max_step = self._group.broadcast_ints(header, 2)
        if kind == _STEADY:
            if self.plan is None:
                raise RuntimeError("the leader sent a steady-state plan before any plan")
            plan = dataclasses.replace(self.plan, max_step=max_step)
        else:
            plan = decode_plan(
                self._group.broadcast_payload(payload, kind),
                replica_id=self._config.replica_id,
                rank=self._group.rank,
            )
            self._sent = payload
        self.plan = plan
        return plan

    def close(self) -> None:
        """Drops a request not started yet; one in flight ends with the quorum link's close."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
