"""The worker's configuration and the Manager's argument checks (they fail before any network)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import torch

from fthsdp.worker.config import ManagerConfig, lr_factor
from fthsdp.worker.manager import Manager
from fthsdp.worker.replica_group import ReplicaGroup

TOKEN = "t" * 24
ENV = {
    "FTHSDP_REPLICA_ID": "r1",
    "FTHSDP_REPLICA_INDEX": "1",
    "FTHSDP_TOTAL_REPLICAS": "3",
    "FTHSDP_QUORUM": "q:7450,q2:7450",
    "FTHSDP_CHECKPOINT_URL": "http://127.0.0.1:7470",
    "FTHSDP_TOKEN": TOKEN,
}


def _config(**overrides: Any) -> ManagerConfig:
    return ManagerConfig.from_env(ENV, **overrides)


def test_from_env_reads_the_launchers_variables_and_keywords_win() -> None:
    config = ManagerConfig.from_env(
        {**ENV, "FTHSDP_LR_POLICY": "sqrt", "FTHSDP_METRICS_PORT": "9100"}, job_id="j"
    )
    assert (config.replica_id, config.replica_index, config.total_replicas) == ("r1", 1, 3)
    assert config.quorum_address == "q:7450,q2:7450" and config.job_id == "j"
    assert config.lr_policy == "sqrt" and config.metrics_port == 9100
    assert TOKEN not in repr(config)


def test_from_env_names_what_is_missing_or_malformed() -> None:
    env = {k: v for k, v in ENV.items() if k not in ("FTHSDP_QUORUM", "FTHSDP_REPLICA_ID")}
    with pytest.raises(ValueError, match="FTHSDP_REPLICA_ID, FTHSDP_QUORUM"):
        ManagerConfig.from_env(env)
    with pytest.raises(ValueError, match="FTHSDP_REPLICA_INDEX='one'"):
        ManagerConfig.from_env({**ENV, "FTHSDP_REPLICA_INDEX": "one"})
    with pytest.raises(ValueError, match="lr_policy"):
        ManagerConfig.from_env({**ENV, "FTHSDP_LR_POLICY": "cubic"})


def test_the_start_wait_comes_in_seconds_and_is_checked() -> None:
    assert _config().await_replicas == timedelta(0)
    config = ManagerConfig.from_env({**ENV, "FTHSDP_AWAIT_REPLICAS_S": "2.5"})
    assert config.await_replicas == timedelta(seconds=2.5)
    for bad in ("soon", "inf", "nan"):
        with pytest.raises(ValueError, match=f"FTHSDP_AWAIT_REPLICAS_S='{bad}' is not a valid "):
            ManagerConfig.from_env({**ENV, "FTHSDP_AWAIT_REPLICAS_S": bad})
    with pytest.raises(ValueError, match="await_replicas must not be negative"):
        ManagerConfig.from_env({**ENV, "FTHSDP_AWAIT_REPLICAS_S": "-1"})


def test_lr_factor_per_policy() -> None:
    assert lr_factor("sqrt", 2, 8) == pytest.approx(0.5)
    assert lr_factor("linear", 2, 8) == pytest.approx(0.25)
    assert lr_factor("none", 2, 8) == 1.0
    assert lr_factor("sqrt", 8, 8) == lr_factor("linear", 8, 8) == 1.0
    assert math.isclose(lr_factor("sqrt", 3, 4), math.sqrt(0.75))
    with pytest.raises(ValueError):
        lr_factor("sqrt", 0, 4)


def _manager(model: torch.nn.Module, **kwargs: Any) -> Manager:
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return Manager(
        config=_config(),
        model=model,
        optimizer=optimizer,
        group=ReplicaGroup(None, 0, 1),
        samples_per_step=kwargs.pop("samples_per_step", 1),
        **kwargs,
    )


def test_a_model_on_several_devices_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        _manager(model)


def test_bad_state_and_arguments_are_refused_before_connecting() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    foreign = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0
    )
    with pytest.raises(ValueError, match="another optimizer"):
        _manager(model, optimizer=optimizer, state={"sched": foreign})
    with pytest.raises(ValueError, match="samples_per_step"):
        _manager(model, samples_per_step=0)
