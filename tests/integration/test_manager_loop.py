"""The Manager driven as a user's plain PyTorch loop drives it (`OptimizerWrapper`), with real
services: schedulers keep their say over the learning rate, the averaged gradient is in `.grad`
when backward returns, user state travels with catch-up (I1), skipped and accumulated steps."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from fthsdp.worker.manager import Manager
from fthsdp.worker.optim import OptimizerWrapper
from tests.integration.manager_support import (
    batch,
    control_plane,
    lone_replica,
    run_replicas,
    tiny_model,
)

pytestmark = pytest.mark.timeout(120)


def _loss(model: torch.nn.Module, index: int, step: int) -> torch.Tensor:
    x, y = batch(index, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _train_step(manager: Manager, optimizer: OptimizerWrapper, index: int) -> None:
    optimizer.zero_grad()
    _loss(manager.model, index, manager.step).backward()
    optimizer.step()


def _recorded_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    return seen


class Tracker:
    """A user object with tensor and JSON state (tuples included) that must travel."""

    def __init__(self) -> None:
        self.steps = 0
        self.total = torch.zeros(3)
        self.history: tuple[int, ...] = ()

    def update(self, step: int) -> None:
        self.steps += 1
        self.total += step
        self.history = (*self.history[-3:], step)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "total": self.total, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.history = state["steps"], state["history"]
        self.total.copy_(state["total"])


def test_the_schedulers_learning_rate_is_the_one_the_optimizer_steps_with(tmp_path: Path) -> None:
    """Regression: the Manager once reset every group's lr to its initial value before each
    optimizer step, so a LambdaLR's 0.1, 0.05, 0.033... stepped with 0.1 every time."""
    with control_plane(tmp_path, total_replicas=1) as stack:
        model = tiny_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
        seen = _recorded_lrs(inner)
        manager = stack.manager("r0", 0, model, inner, state={"scheduler": scheduler})
        optimizer = OptimizerWrapper(manager)
        try:
            for _ in range(4):
                _train_step(manager, optimizer, 0)
                scheduler.step()
        finally:
            manager.shutdown()
    assert seen == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert manager.step == 4


@pytest.mark.parametrize(("policy", "factor"), [("sqrt", 0.5**0.5), ("linear", 0.5), ("none", 1)])
def test_the_lr_policy_scales_the_schedulers_value_for_a_shrunken_step(
    tmp_path: Path, policy: str, factor: float
) -> None:
    """One of two replicas trains: the step's lr is the scheduler's times the policy's factor,
    and the scheduler's own value is back in the param group right after the step."""
    with control_plane(tmp_path, total_replicas=2) as stack:
        model = tiny_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
        seen = _recorded_lrs(inner)
        manager = stack.manager("r0", 0, model, inner, lr_policy=policy)
        optimizer = OptimizerWrapper(manager)
        try:
            for _ in range(3):
                _train_step(manager, optimizer, 0)
                scheduler.step()
        finally:
            manager.shutdown()
    assert seen == pytest.approx([0.2 * factor, 0.1 * factor, 0.05 * factor])
    assert inner.param_groups[0]["lr"] == pytest.approx(0.025)
    assert manager.last_outcome is not None and manager.last_outcome.healthy == ("r0",)


def test_backward_returns_the_cross_replica_average_and_no_sync_accumulates(
    tmp_path: Path,
) -> None:
    """Two replicas, each accumulating two micro-batches (the first inside `no_sync`): when
    the last backward returns, `.grad` is the average over replicas of each one's sum, so
    clipping sees what the optimizer will apply."""

    def reference(index: int) -> list[torch.Tensor]:
        model = tiny_model()
        for micro in range(2):
            _loss(model, index, 10 + micro).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = [(a + b) / 2 for a, b in zip(reference(0), reference(1), strict=True)]
    with control_plane(tmp_path, total_replicas=2, min_replicas=2) as stack:

        def replica(replica_id: str, index: int) -> list[torch.Tensor]:
            model = tiny_model()
            manager = stack.manager(replica_id, index, model, torch.optim.SGD(model.parameters()))
            optimizer = OptimizerWrapper(manager)
            try:
                optimizer.zero_grad()
                with manager.no_sync():
                    _loss(model, index, 10).backward()
                _loss(model, index, 11).backward()
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                optimizer.step()
                return grads
            finally:
                manager.shutdown()

        got = run_replicas(lambda: replica("r0", 0), lambda: replica("r1", 1))
    for grads in got:
        for actual, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(actual, want)


def test_user_state_travels_with_catch_up_and_replicas_end_identical(tmp_path: Path) -> None:
    """I1 with user state: r1 joins after r0 trained three steps alone. Its first step catches up
    from r0 (model, optimizer, the optimizer's scheduled lr, a StepLR and a user object with
    tensors, ints and tuples); afterwards both are bitwise identical and so are their objects."""
    joined, ready = threading.Event(), threading.Event()
    stop_at = 8
    with control_plane(tmp_path, total_replicas=2) as stack:

        def replica(replica_id: str, index: int) -> dict[str, Any]:
            model = tiny_model()
            inner = torch.optim.AdamW(model.parameters(), lr=0.05)
            scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
            tracker = Tracker()
            if replica_id == "r1":
                assert joined.wait(30)
            manager = stack.manager(
                replica_id, index, model, inner, state={"scheduler": scheduler, "t": tracker}
            )
            if replica_id == "r1":
                ready.set()  # joined the service: r0's next quorum waits for it
            optimizer = OptimizerWrapper(manager)
            recovered: list[bool] = []
            served: list[int] = []
            steps: list[int] = []
            try:
                while manager.step < stop_at:
                    if replica_id == "r0" and manager.step == 3 and not joined.is_set():
                        joined.set()
                        assert ready.wait(30)
                    _train_step(manager, optimizer, index)
                    scheduler.step()
                    tracker.update(manager.step)
                    outcome = manager.last_outcome
                    assert outcome is not None
                    recovered.append(outcome.recovered)
                    if outcome.seconds["serve"] > 0:  # published a snapshot for a peer
                        served.append(outcome.step)
                    steps.append(outcome.step)
                fingerprint = manager.fingerprint()
            finally:
                manager.shutdown()
            return {
                "fingerprint": fingerprint,
                "scheduler": scheduler.state_dict(),
                "lr": inner.param_groups[0]["lr"],
                "tracker": tracker.state_dict(),
                "recovered": recovered,
                "served": served,
                "steps": steps,
            }

        r0, r1 = run_replicas(lambda: replica("r0", 0), lambda: replica("r1", 1))
    assert r1["recovered"][0] is True and not any(r0["recovered"])
    # The step r1 caught up in is the one r0 published its snapshot for, and no other.
    assert r0["served"] == [r1["steps"][0]] and r1["served"] == []
    assert r0["fingerprint"] == r1["fingerprint"]
    assert r0["scheduler"] == r1["scheduler"]
    assert r0["lr"] == r1["lr"] == pytest.approx(0.05 * 0.5**4)
    assert r0["tracker"]["steps"] == r1["tracker"]["steps"] == stop_at
    assert r0["tracker"]["history"] == r1["tracker"]["history"] == (5, 6, 7, 8)
    torch.testing.assert_close(r0["tracker"]["total"], r1["tracker"]["total"])


def test_a_skipped_optimizer_step_still_commits_its_samples(tmp_path: Path) -> None:
    """What a GradScaler does on an overflow: backward, then no optimizer step. The next
    zero_grad commits the step (its samples were trained, with no update)."""
    with lone_replica(tmp_path) as (manager, optimizer):
        model = manager.model
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        _loss(model, 0, 0).backward()
        optimizer.zero_grad()  # the step is skipped
        assert manager.step == 1
        assert manager.positions.get("r0") == 1
        for p, old in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, old)
        _loss(model, 0, 1).backward()
        optimizer.step()
        assert manager.step == 2


def test_misuse_raises_at_the_call(tmp_path: Path) -> None:
    with lone_replica(tmp_path) as (manager, optimizer):
        with pytest.raises(RuntimeError, match="no step in progress"):
            optimizer.step()
        optimizer.zero_grad()
        _loss(manager.model, 0, 0).backward()
        with pytest.raises(RuntimeError, match="second backward"):
            _loss(manager.model, 0, 0).backward()
        optimizer.step()
        with pytest.raises(RuntimeError, match="no step in progress"):
            optimizer.step()
        with pytest.raises(TypeError, match="closure"):
            optimizer.step(lambda: 0.0)
        with pytest.raises(RuntimeError, match="param groups"):
            optimizer.add_param_group({"params": []})
        assert manager.step == 1


def test_the_leader_serves_prometheus_metrics_when_asked(tmp_path: Path) -> None:
    with lone_replica(tmp_path, metrics_port=0) as (manager, optimizer):
        for _ in range(3):
            _train_step(manager, optimizer, 0)
        assert manager.metrics is not None
        url = f"http://{manager.metrics.address}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        refused.value.close()
        assert refused.value.code == 401
        scrape = urllib.request.Request(
            url, headers={"authorization": f"Bearer {manager.config.token}"}
        )
        with urllib.request.urlopen(scrape, timeout=5) as response:  # noqa: S310
            text = response.read().decode()
    assert 'fthsdp_worker_commits_total{replica="r0"} 3.0' in text
    assert 'fthsdp_worker_step_seconds_count{replica="r0"} 3.0' in text
    assert 'fthsdp_worker_healthy_replicas{replica="r0"} 1.0' in text
    assert "fthsdp_worker_exchange_bytes_total" in text
