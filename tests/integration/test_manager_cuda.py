"""The worker library on a GPU: a CUDA model's gradients cross replicas through FTAR's staging
path, catch-up loads CPU-received state into CUDA params and optimizer state, replicas end
identical (I1). Skipped without CUDA."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fthsdp.worker.optim import OptimizerWrapper
from tests.integration.manager_support import batch, control_plane, run_replicas, tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


DEVICE = torch.device("cuda", 0)


def _loss(model: torch.nn.Module, index: int, step: int) -> torch.Tensor:
    x, y = batch(index, step)
    return torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))


def test_cuda_replicas_average_gradients_and_catch_up_identically(tmp_path: Path) -> None:
    joined, ready = threading.Event(), threading.Event()
    stop_at = 6

    def reference(model: torch.nn.Module) -> list[torch.Tensor]:
        """The two replicas' gradients at this state, averaged, computed locally."""
        grads = []
        for index in range(2):
            # Not a deepcopy: that would copy the Manager's gradient hooks along.
            twin = tiny_model().to(DEVICE)
            twin.load_state_dict(model.state_dict())
            _loss(twin, index, 100).backward()
            grads.append([p.grad.clone() for p in twin.parameters()])
        return [(a + b) / 2 for a, b in zip(*grads, strict=True)]

    with control_plane(tmp_path, total_replicas=2) as stack:

        def replica(replica_id: str, index: int) -> dict[str, Any]:
            model = tiny_model().to(DEVICE)
            inner = torch.optim.AdamW(model.parameters(), lr=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
            if replica_id == "r1":
                assert joined.wait(60)
            manager = stack.manager(replica_id, index, model, inner, state={"s": scheduler})
            if replica_id == "r1":
                ready.set()  # joined the service: r0's next quorum waits for it
            optimizer = OptimizerWrapper(manager)
            averaged = expected = None
            try:
                while manager.step < stop_at:
                    if replica_id == "r0" and manager.step == 2 and not joined.is_set():
                        joined.set()
                        assert ready.wait(60)
                    optimizer.zero_grad()
                    both = manager.step == 4  # r1 caught up at step 2 or 3: both train it
                    if both:
                        expected = reference(model)
                    _loss(model, index, 100 if both else manager.step).backward()
                    if both:
                        averaged = [p.grad.clone() for p in model.parameters()]
                    optimizer.step()
                    scheduler.step()
                fingerprint = manager.fingerprint()
                assert all(p.device == DEVICE for p in model.parameters())
                assert all(
                    v.device == DEVICE
                    for state in inner.state.values()
                    for k, v in state.items()
                    if k != "step"
                )
            finally:
                manager.shutdown()
            return {
                "fingerprint": fingerprint,
                "averaged": averaged,
                "expected": expected,
                "lr": inner.param_groups[0]["lr"],
            }

        r0, r1 = run_replicas(lambda: replica("r0", 0), lambda: replica("r1", 1), timeout_s=150)
    assert r0["fingerprint"] == r1["fingerprint"]  # I1
    assert r0["lr"] == r1["lr"]
    for result in (r0, r1):
        assert result["averaged"] is not None and result["expected"] is not None
        for got, want in zip(result["averaged"], result["expected"], strict=True):
            torch.testing.assert_close(got, want)
