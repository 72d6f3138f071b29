"""Faults for real Managers in one process (`manager_support`'s harness): what `worker.faults`
does to a process (SIGKILL at a point of the step, a hang, a slow fetch), done to one Manager
among several in the same process, plus the bookkeeping the state-machine tests share.

A killed Manager is shut down without leaving the quorum service, as a SIGKILLed process is:
its sockets close (FTAR peers see the connection go), its heartbeats stop (the service evicts it
after the heartbeat timeout), its quorum request in flight is cancelled with its channel, and the
training thread ends at the point of the kill. The only seam is the `FaultPlan` the Manager is
built with (a public constructor argument) and, for the missing Leave, the quorum client's
`leave`; everything else is the real Manager, quorum service and checkpoint sidecar."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from fthsdp.services.quorum.client import QuorumClient
from fthsdp.worker.faults import FaultPlan
from fthsdp.worker.manager import Manager
from fthsdp.worker.optim import OptimizerWrapper
from fthsdp.worker.replica_group import ReplicaGroup
from fthsdp.worker.step import StepOutcome
from tests.integration.manager_support import JOIN_S, Stack, batch, control_plane, tiny_model

LR = 0.1
MOMENTUM = 0.9
"""SGD with momentum: the optimizer has state (momentum buffers) that catch-up must carry."""


def poll(check: Callable[[], bool], *, within_s: float = JOIN_S, what: str) -> None:
    """Waits until `check()` holds; fails naming `what` after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within_s} s: {what}")
        time.sleep(0.01)


class Killed(BaseException):
    """Ends a killed replica's training thread at the point of the kill. A BaseException, so
    nothing in the Manager that latches an `Exception` into the vote can go on past it."""


class Killer:
    """Shuts Managers down as SIGKILL would: no Leave reaches the quorum service."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._silenced: set[str] = set()
        self._lock = threading.Lock()
        leave = QuorumClient.leave

        def quiet_leave(
            client: QuorumClient, replica_id: str, incarnation: int, reason: str = ""
        ) -> None:
            with self._lock:
                if replica_id in self._silenced:
                    return
            leave(client, replica_id, incarnation, reason)

        monkeypatch.setattr(QuorumClient, "leave", quiet_leave)

    def kill(self, manager: Manager) -> None:
        replica_id = manager.config.replica_id
        with self._lock:
            self._silenced.add(replica_id)
        try:
            manager.shutdown()
        finally:
            with self._lock:
                self._silenced.discard(replica_id)


@dataclass
class InProcessFaults(FaultPlan):
    """A `FaultPlan` whose faults act on this process's Manager instead of the process.

    `kill_at`: (point, step) where `hit` kills the Manager (`Killer.kill`) and ends its training
    thread with `Killed` (once `kill_after` is set, if given). `hang_at`: the step whose
    exchange the training thread does not enter until `release` is set. `stuck_fetch`: the
    first catch-up fetch stays stuck (a transfer that cannot see its cancellation) until
    `release` is set. Each fault fires once."""

    killer: Killer | None = None
    kill_at: tuple[str, int] | None = None
    kill_after: threading.Event | None = None
    hang_at: int | None = None
    stuck_fetch: bool = False
    release: threading.Event = field(default_factory=threading.Event)
    fired: threading.Event = field(default_factory=threading.Event)
    """Set when the planned fault fired (the kill is done, the hang or stuck fetch has begun)."""
    manager: Manager | None = None
    """The Manager to kill; set right after it is built."""

    def __post_init__(self) -> None:
        super().__init__([], None)

    def hit(self, point: str, step: int) -> None:
        if self.kill_at != (point, step) or self.fired.is_set():
            return
        assert self.killer is not None and self.manager is not None
        if self.kill_after is not None:
            assert self.kill_after.wait(JOIN_S), "the kill's precondition never came"
        self.killer.kill(self.manager)
        self.fired.set()
        raise Killed(f"{self.manager.config.replica_id} killed at {point} of step {step}")

    def hang(self, step: int) -> None:
        if self.hang_at == step and not self.fired.is_set():
            self.fired.set()
            self.release.wait()

    def delay(self, point: str, step: int) -> None:
        if point == "slow_fetch" and self.stuck_fetch and not self.fired.is_set():
            self.fired.set()
            self.release.wait()


@dataclass
class Replica:
    """One replica (one rank): its Manager under SGD with momentum, and what it committed."""

    replica_id: str
    index: int
    manager: Manager
    optimizer: OptimizerWrapper
    outcomes: list[StepOutcome] = field(default_factory=list)

    def train_step(self) -> None:
        self.optimizer.zero_grad()
        x, y = batch(self.index, self.manager.step)
        loss = torch.nn.functional.mse_loss(self.manager.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        outcome = self.manager.last_outcome
        assert outcome is not None
        self.outcomes.append(outcome)

    def train_until(self, step: int) -> None:
        while self.manager.step < step:
            self.train_step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.manager.model.parameters()]

    def committed(self) -> list[tuple[int, int, tuple[str, ...], bool, int]]:
        """Per committed step: (step, quorum_id, healthy, recovered, attempts)."""
        return [(o.step, o.quorum_id, o.healthy, o.recovered, o.attempts) for o in self.outcomes]


def replica(
    stack: Stack,
    replica_id: str,
    index: int,
    *,
    seed: int = 0,
    faults: FaultPlan | None = None,
    **overrides: Any,
) -> Replica:
    """Builds (and joins) a replica. `seed` sets its initial parameters: a restarted process
    may start from other values, which catch-up must replace. A torn-down replica never exits
    the test process (`exit_on_teardown=False`)."""
    model = tiny_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    config = stack.config(replica_id, index, **{"exit_on_teardown": False, **overrides})
    manager = Manager(
        config=config,
        model=model,
        optimizer=optimizer,
        group=ReplicaGroup(None, 0, 1),
        samples_per_step=1,
        faults=faults,
    )
    if isinstance(faults, InProcessFaults):
        faults.manager = manager
    return Replica(replica_id, index, manager, OptimizerWrapper(manager))


class Runner:
    """Replica bodies in daemon threads; `join` re-raises the first unexpected error."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.killed: list[str] = []

    def start(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def target() -> None:
            try:
                body()
            except Killed:
                self.killed.append(name)
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def run(self, bodies: Mapping[str, Callable[[], None]]) -> None:
        """Starts every body under its name, then joins them all, checked."""
        for name, body in bodies.items():
            self.start(name, body)
        self.join()

    def join(self, timeout_s: float = JOIN_S, *, check: bool = True) -> None:
        """Waits for every body; with `check`, re-raises the first error and fails if one is
        still running (without: a cleanup after the test already failed)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if not check:
            return
        if self.errors:
            raise self.errors[0]
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"replicas still running after {timeout_s} s: {alive}"


def waiting_in_round(client: QuorumClient, replica_id: str) -> bool:
    """Whether the replica's quorum request waits in the service's current round."""
    return any(m.replica_id == replica_id and m.waiting for m in client.status().members)


def registered(client: QuorumClient, replica_id: str) -> bool:
    return any(m.replica_id == replica_id for m in client.status().members)


def reference(schedule: Sequence[Sequence[int]], *, seed: int = 0) -> list[torch.Tensor]:
    """The parameters after training `tiny_model(seed)` step by step, each step on the mean of
    the gradients of the replicas (indices) listed for it, computed as FTAR does (the sum, then
    divided by the number of contributors): what every healthy replica must hold (I1)."""
    model = tiny_model(seed)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step, contributors in enumerate(schedule):
        total: list[torch.Tensor] | None = None
        for index in contributors:
            model.zero_grad(set_to_none=True)
            x, y = batch(index, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            grads = [p.grad.detach().clone() for p in params if p.grad is not None]
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        assert total is not None, f"step {step} has no contributor"
        for p, g in zip(params, total, strict=True):
            p.grad = g.div_(len(contributors))
        optimizer.step()
    return [p.detach().clone() for p in params]


def assert_bitwise_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs: {a} != {b}"


def trained_ranges(outcomes: Sequence[StepOutcome], replica_id: str) -> list[tuple[int, int]]:
    """The position ranges of `replica_id`'s shard that these committed steps trained."""
    return [o.trained[replica_id] for o in outcomes if replica_id in o.trained]


def contiguous(ranges: Sequence[tuple[int, int]]) -> Iterator[bool]:
    """Per consecutive pair, whether the second starts where the first ended."""
    return (a[1] == b[0] for a, b in itertools.pairwise(ranges))


def quorum_port(stack: Stack) -> int:
    return int(stack.local.quorum_address.rsplit(":", 1)[1])


# ---- scenarios shared by several tests ----------------------------------------------------


def kill_and_rejoin(
    tmp_path: Path, killer: Killer, *, kill_at: tuple[str, int], joins_at: int
) -> tuple[Replica, Replica, Replica, int]:
    """r0 survives; r1 starts with it (`joins_at` 0) or joins at r0's step `joins_at`, and is
    killed at `kill_at`; r0 trains on alone to step 5, where r1 comes back as a new incarnation
    (other initial values) and catches up; both train to step 8. Returns r0, the killed r1,
    the new r1, and the new r1's shard position right after its catch-up."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        client = stack.local.quorum_client()
        r0 = replica(stack, "r0", 0)
        kill = InProcessFaults(killer=killer, kill_at=kill_at)
        first: list[Replica] = [replica(stack, "r1", 1, faults=kill)] if joins_at == 0 else []
        join, rejoin = threading.Event(), threading.Event()
        new: list[Replica] = []
        resumed_at: list[int] = []
        runner = Runner()

        def victim() -> None:
            if not first:
                assert join.wait(JOIN_S)
                first.append(replica(stack, "r1", 1, faults=kill))
            first[0].train_until(8)

        def comeback() -> None:
            assert rejoin.wait(JOIN_S)
            back = replica(stack, "r1", 1, seed=7)
            new.append(back)
            back.train_step()
            resumed_at.append(back.manager.positions.get("r1"))
            back.train_until(8)

        def survivor() -> None:
            for step, event in ((joins_at, join), (5, rejoin)):
                r0.train_until(step)
                event.set()
                poll(lambda: waiting_in_round(client, "r1"), what="r1 asks for a quorum")
            r0.train_until(8)

        try:
            runner.run({"r0": survivor, "r1": victim, "r1'": comeback})
            assert runner.killed == ["r1"]
            assert r0.manager.fingerprint() == new[0].manager.fingerprint()
        finally:
            for r in (r0, *new):
                r.manager.shutdown()
            client.close()
    return r0, first[0], new[0], resumed_at[0]


def source_killed_while_serving(
    tmp_path: Path,
    killer: Killer,
    *,
    r1_faults: InProcessFaults | None = None,
    while_alone: Callable[[Replica], None] | None = None,
) -> tuple[Replica, Replica, Replica, int]:
    """r0 trains steps 0-2 alone; r1 joins at step 3 to catch up from r0, which dies right
    after publishing its state for it (with `r1_faults`: once r1's fetch has begun). r1 trains
    on alone from its own step 0 (r0 held the only copy of steps 0-2); the test thread runs
    `while_alone(r1)` meanwhile. At r1's step 3, r0 comes back as a new incarnation, catches up
    from r1, and both train to step 6. Returns r1, the killed r0, the new r0, and the new r0's
    shard position after its catch-up."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        client = stack.local.quorum_client()
        kill = InProcessFaults(
            killer=killer,
            kill_at=("serve", 3),
            kill_after=None if r1_faults is None else r1_faults.fired,
        )
        r0 = replica(stack, "r0", 0, faults=kill)
        join, rejoin = threading.Event(), threading.Event()
        joined: list[Replica] = []
        new: list[Replica] = []
        resumed_at: list[int] = []
        runner = Runner()

        def survivor() -> None:
            assert join.wait(JOIN_S)
            r1 = replica(stack, "r1", 1, faults=r1_faults, fetch_timeout=timedelta(seconds=60))
            joined.append(r1)
            r1.train_until(3)
            rejoin.set()
            poll(lambda: waiting_in_round(client, "r0"), what="r0 asks for a quorum")
            r1.train_until(6)

        def victim() -> None:
            r0.train_until(3)
            join.set()
            poll(lambda: waiting_in_round(client, "r1"), what="r1 asks for a quorum")
            r0.train_until(6)

        def comeback() -> None:
            assert rejoin.wait(JOIN_S)
            back = replica(stack, "r0", 0, seed=7)
            new.append(back)
            back.train_step()
            resumed_at.append(back.manager.positions.get("r0"))
            back.train_until(6)

        try:
            for name, body in (("r0", victim), ("r1", survivor), ("r0'", comeback)):
                runner.start(name, body)
            if while_alone is not None:
                poll(lambda: bool(joined), what="r1 joins")
                while_alone(joined[0])
            runner.join()
            assert runner.killed == ["r0"]
            assert joined[0].manager.fingerprint() == new[0].manager.fingerprint()
        finally:
            if r1_faults is not None:
                r1_faults.release.set()
            for r in (*joined, *new):
                r.manager.shutdown()
            client.close()
    return joined[0], r0, new[0], resumed_at[0]
