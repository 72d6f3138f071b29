"""fthsdp: fault-tolerant hybrid-sharded data-parallel training, replicas as the unit of failure.

The worker library, for a training script (see the README's "Your own training loop"):

    import fthsdp
    group = fthsdp.ReplicaGroup.from_env()                 # the replica's ranks (torchrun)
    manager = fthsdp.Manager(config=fthsdp.ManagerConfig.from_env(), model=model,
                             optimizer=optimizer, group=group, samples_per_step=...,
                             state={"scheduler": scheduler, "rng": fthsdp.RNGState(seed=0)})
    optimizer = fthsdp.OptimizerWrapper(manager)
    loader = fthsdp.ExactlyOnceDataLoader(dataset, manager, batch_size=..., num_workers=2)

A script that may run as a warm spare calls `fthsdp.take_identity()` before
`init_process_group` (see `fthsdp.worker.spare`).

Names load on first use, so `import fthsdp.services.quorum` never imports torch. The services and
launchers live under `fthsdp.services`, `fthsdp.deploy`; benchmarks under `fthsdp.bench`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fthsdp.worker.config import ManagerConfig, lr_factor
    from fthsdp.worker.ftar import FtarConfig
    from fthsdp.worker.manager import Manager
    from fthsdp.worker.optim import OptimizerWrapper
    from fthsdp.worker.plan import NoQuorumError
    from fthsdp.worker.replica_group import ReplicaGroup
    from fthsdp.worker.rng_state import RNGState
    from fthsdp.worker.sampler import ExactlyOnceDataLoader, ExactlyOnceSampler
    from fthsdp.worker.spare import take_identity
    from fthsdp.worker.state import Stateful
    from fthsdp.worker.step import StepOutcome, TooManyFailedCommits

_EXPORTS = {
    "ExactlyOnceDataLoader": "fthsdp.worker.sampler",
    "ExactlyOnceSampler": "fthsdp.worker.sampler",
    "FtarConfig": "fthsdp.worker.ftar",
    "Manager": "fthsdp.worker.manager",
    "ManagerConfig": "fthsdp.worker.config",
    "NoQuorumError": "fthsdp.worker.plan",
    "OptimizerWrapper": "fthsdp.worker.optim",
    "RNGState": "fthsdp.worker.rng_state",
    "ReplicaGroup": "fthsdp.worker.replica_group",
    "StepOutcome": "fthsdp.worker.step",
    "Stateful": "fthsdp.worker.state",
    "TooManyFailedCommits": "fthsdp.worker.step",
    "lr_factor": "fthsdp.worker.config",
    "take_identity": "fthsdp.worker.spare",
}

__all__ = [
    "ExactlyOnceDataLoader",
    "ExactlyOnceSampler",
    "FtarConfig",
    "Manager",
    "ManagerConfig",
    "NoQuorumError",
    "OptimizerWrapper",
    "RNGState",
    "ReplicaGroup",
    "Stateful",
    "StepOutcome",
    "TooManyFailedCommits",
    "lr_factor",
    "take_identity",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fthsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
