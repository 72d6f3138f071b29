"""The training state as named tensors: what catch-up transfers and checkpoints persist.

Model parameters and buffers are named `model/<name>`; optimizer state `optim/<param index>/<key>`.
With FSDP2 (HSDP inside a replica) each rank holds shards: the tensors here are this rank's local
shards, and rank i of one replica exchanges state with rank i of another. Non-tensor optimizer
state is refused: everything on the wire is raw tensor bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fthsdp.worker.exchange import local

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer tensors by name, without copying."""
    tensors = {MODEL_PREFIX + name: local(t).detach() for name, t in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {index}/{key} is not a tensor: {type(value)}")
            tensors[f"{OPTIM_PREFIX}{index}/{key}"] = local(value).detach()
    return tensors


def load_state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Loads tensors produced by `state_tensors` on the same rank of an identical replica."""
    current = model.state_dict()
    expected = {MODEL_PREFIX + name for name in current}
    given = {name for name in tensors if name.startswith(MODEL_PREFIX)}
    if given != expected:
        raise ValueError(
            f"model state mismatch: missing {expected - given}, extra {given - expected}"
        )
    with torch.no_grad():
        for name, target in current.items():
            local(target).copy_(tensors[MODEL_PREFIX + name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(OPTIM_PREFIX):
            continue
        index_text, _, key = name[len(OPTIM_PREFIX) :].partition("/")
        index = int(index_text)
        if not 0 <= index < len(params):
            raise ValueError(f"optimizer state for unknown parameter {index}")
        optim_state.setdefault(index, {})[key] = _like_param(params[index], tensor.clone())
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": optim_state, "param_groups": groups})


def _like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Optimizer state shaped like its parameter (a DTensor shard for FSDP2); scalars stay."""
    if isinstance(param, DTensor) and value.dim() > 0:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes in name order: equal iff bitwise equal."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()
