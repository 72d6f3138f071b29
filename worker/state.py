"""The training state as named tensors: what catch-up transfers and checkpoints persist.

Model parameters and buffers are named `model/<name>`; optimizer state `optim/<param index>/<key>`.
Non-tensor optimizer state (rare) is refused: everything on the wire is raw tensor bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors by name, without copying."""
    tensors = {MODEL_PREFIX + name: t.detach() for name, t in model.state_dict().items()}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {index}/{key} is not a tensor: {type(value)}")
            tensors[f"{OPTIM_PREFIX}{index}/{key}"] = value.detach()
    return tensors


def load_state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Loads tensors produced by `state_tensors` of an identically built model and optimizer."""
    model_state = {
        name[len(MODEL_PREFIX) :]: t for name, t in tensors.items() if name.startswith(MODEL_PREFIX)
    }
    model.load_state_dict(model_state, strict=True)
    optim_state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(OPTIM_PREFIX):
            continue
        index_text, _, key = name[len(OPTIM_PREFIX) :].partition("/")
        optim_state.setdefault(int(index_text), {})[key] = tensor.clone()
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": optim_state, "param_groups": groups})


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
