"""Real Managers in one process: replicas of one rank each, one thread per replica, against a real
quorum service (embedded) and a real checkpoint sidecar process. Cheap enough to drive the
Manager's state machine (commit, catch-up, user state, the optimizer wrapper) in seconds."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from fthsdp.deploy.stack import LocalStack
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.manager import Manager
from fthsdp.worker.optim import OptimizerWrapper
from fthsdp.worker.replica_group import ReplicaGroup

JOIN_S = 60.0


@dataclass
class Stack:
    """The control plane of one test job."""

    local: LocalStack
    token: str
    total_replicas: int

    def config(self, replica_id: str, index: int, **overrides: Any) -> ManagerConfig:
        sidecar = self.local.sidecars["host"]
        fields: dict[str, Any] = {
            "job_id": "job",
            "replica_id": replica_id,
            "replica_index": index,
            "total_replicas": self.total_replicas,
            "quorum_address": self.local.quorum_address,
            "checkpoint_url": sidecar.url,
            "shm_dir": str(sidecar.shm_dir),
            "token": self.token,
            "position_record_interval": None,
            "control_plane_grace": None,
            **overrides,
        }
        return ManagerConfig(**fields)

    def manager(
        self,
        replica_id: str,
        index: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        samples_per_step: int = 1,
        state: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> Manager:
        return Manager(
            config=self.config(replica_id, index, **overrides),
            model=model,
            optimizer=optimizer,
            group=ReplicaGroup(None, 0, 1),
            samples_per_step=samples_per_step,
            state=state,
        )


@contextmanager
def control_plane(tmp_path: Path, *, total_replicas: int, min_replicas: int = 1) -> Iterator[Stack]:
    """Quorum service + one checkpoint sidecar (every replica's "host")."""
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    local = LocalStack(
        run_dir=tmp_path,
        token_file=token_file,
        hosts=["host"],
        checkpoint_dir=tmp_path / "checkpoints",
        min_replicas=min_replicas,
        join_timeout=timedelta(milliseconds=500),
        health=False,
    )
    with local:
        yield Stack(local=local, token=token, total_replicas=total_replicas)


@contextmanager
def lone_replica(tmp_path: Path, **overrides: Any) -> Iterator[tuple[Manager, OptimizerWrapper]]:
    """A job of one replica: `tiny_model` under SGD (lr 0.1), its Manager and optimizer wrapper."""
    with control_plane(tmp_path, total_replicas=1) as stack:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = stack.manager("r0", 0, model, optimizer, **overrides)
        try:
            yield manager, OptimizerWrapper(manager)
        finally:
            manager.shutdown()


def run_replicas(*bodies: Callable[[], Any], timeout_s: float = JOIN_S) -> list[Any]:
    """Runs each replica's body in its own thread; returns their results, re-raises the first
    error, and fails if one is still running after `timeout_s`."""
    results: list[Any] = [None] * len(bodies)
    errors: list[BaseException] = []

    def target(i: int, body: Callable[[], Any]) -> None:
        try:
            results[i] = body()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=target, args=(i, body), daemon=True, name=f"replica-{i}")
        for i, body in enumerate(bodies)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"replicas still running after {timeout_s} s: {alive}"
    return results


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The same small model on every replica (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def batch(replica_index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data of a replica's step."""
    generator = torch.Generator().manual_seed(1000 * replica_index + step)
    x = torch.randn(2, 4, generator=generator)
    return x, x.sum(dim=1, keepdim=True)
