"""The optimizer as a user's loop sees it: `zero_grad()` starts the step, `step()` commits it.

    optimizer = fthsdp.OptimizerWrapper(manager)
    for batch in loader:
        optimizer.zero_grad()          # the quorum request overlaps the forward pass
        loss = model(batch)
        loss.backward()                # ends with the gradient averaged across replicas
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # optional
        optimizer.step()               # commits, then the wrapped optimizer's step
        scheduler.step()

A GradScaler works unchanged (`scaler.step(optimizer)`): when it skips the step on an overflow,
every replica skips it alike (their gradients are identical), and the step's samples still count
as trained. Gradient accumulation: all backward passes but the last inside `manager.no_sync()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fthsdp.worker.manager import Manager


class OptimizerWrapper(torch.optim.Optimizer):
    """Wraps `manager.optimizer`; param groups and state are the wrapped optimizer's own, so
    schedulers, GradScaler and checkpointing code see the same objects."""

    def __init__(self, manager: Manager) -> None:
        # Deliberately not Optimizer.__init__: the wrapped optimizer owns params and state.
        self.manager = manager
        self.optim = manager.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step (`Manager.start_step`) and clears the gradients."""
        self.manager.start_step()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Commits the step once the replica agrees (`Manager.should_commit`), then runs the
        wrapped optimizer's step with the learning rate scaled by `ManagerConfig.lr_policy`
        for a step trained by fewer replicas; the scheduler's value is restored right after."""
        if closure is not None:
            raise TypeError(
                "step(closure) re-evaluates the loss, which would need a new exchange; "
                "closure-based optimizers (LBFGS) are not supported"
            )
        if not self.manager.should_commit():
            return
        factor = self.manager.lr_factor()
        if factor == 1.0:
            self.optim.step()
            return
        saved = [group["lr"] for group in self.optim.param_groups]
        try:
            for group, lr in zip(self.optim.param_groups, saved, strict=True):
                group["lr"] = lr * factor
            self.optim.step()
        finally:
            for group, lr in zip(self.optim.param_groups, saved, strict=True):
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "the Manager exchanges a fixed set of parameters: add param groups before creating it"
        )

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"
