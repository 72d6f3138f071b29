"""The training state as named tensors: what catch-up transfers and checkpoints persist.

Model parameters and buffers are named `model/<name>`; optimizer state `optim/<param index>/<key>`.
With FSDP2 (HSDP inside a replica) each rank holds shards: the tensors here are this rank's local
shards, and rank i of one replica exchanges state with rank i of another. Non-tensor optimizer
state is refused: everything on the wire is raw tensor bytes.

`ReplicatedState` adds what the model and the optimizer's tensors do not hold: the optimizer's
per-group hyperparameters (the learning rate a scheduler set) and the user's stateful objects (a
scheduler, a GradScaler, RNG state, a data loader), as tensors plus one JSON document
(`worker.state_codec`)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from fthsdp.services.checkpoint.client_fetch import TORCH_DTYPES
from fthsdp.services.common.crc import crc32
from fthsdp.worker.dtensor import is_dtensor, like, local
from fthsdp.worker.state_codec import decode_tree, document_tensor, encode_tree, read_document

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
EXTRA_PREFIX = "extra/"
"""Tensors of the optimizer's hyperparameters and of the user's objects."""
DOCUMENT = "document"
"""The JSON document (a uint8 tensor) of everything in `ReplicatedState` that is not a tensor."""
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DTYPES = frozenset(TORCH_DTYPES.values())
"""What the snapshot and checkpoint format carries."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with `state_dict()` / `load_state_dict()`: LR schedulers, GradScaler,
    `fthsdp.RNGState`, torchdata's StatefulDataLoader, or the user's own objects."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class ReplicatedState:
    """One rank's share of the replica's state: model, optimizer (tensors and per-group
    hyperparameters) and named user objects. Identical on every healthy replica (I1)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        objects: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.objects = dict(objects or {})
        for name, obj in self.objects.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(f"state name {name!r} must be 1..64 letters, digits, '_.-'")
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
                )
            if (
                isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
                and obj.optimizer is not optimizer
            ):
                raise ValueError(
                    f"state {name!r} is a scheduler of another optimizer than the Manager's"
                )
        self.tensors()  # an unsupported value fails here, at construction, naming its key

    def core_tensors(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors (what the I1 fingerprint covers), without copying."""
        return state_tensors(self.model, self.optimizer)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything, as named tensors (the document among them); tensors are not copied."""
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        document: dict[str, Any] = {}
        extra: dict[str, torch.Tensor] = {}
        document["optim_groups"], found = encode_tree(
            groups, prefix=f"{EXTRA_PREFIX}optim/", name="optimizer param_groups", dtypes=_DTYPES
        )
        extra.update(found)
        objects = {}
        for name, obj in self.objects.items():
            objects[name], found = encode_tree(
                obj.state_dict(), prefix=f"{EXTRA_PREFIX}{name}/", name=name, dtypes=_DTYPES
            )
            extra.update(found)
        document["objects"] = objects
        return {
            **self.core_tensors(),
            **{k: local(v) for k, v in extra.items()},
            DOCUMENT: document_tensor(document),
        }

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Loads what `tensors()` produced on the same rank of an identical replica."""
        if DOCUMENT not in tensors and self.objects:
            raise ValueError("the received state has no document for the user's objects")
        document = read_document(tensors[DOCUMENT]) if DOCUMENT in tensors else {}
        if not isinstance(document, dict):
            raise ValueError("the replicated state document must be an object")
        extra = {k: v for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}
        groups = decode_tree(
            document.get("optim_groups", [{}] * len(self.optimizer.param_groups)), extra
        )
        objects = decode_tree(document.get("objects", {}), extra)
        if not isinstance(groups, list) or len(groups) != len(self.optimizer.param_groups):
            raise ValueError("optimizer param_groups differ from the source's")
        if not isinstance(objects, dict) or set(objects) != set(self.objects):
            raise ValueError(
                f"user state names differ: here {sorted(self.objects)}, "
                f"source {sorted(objects) if isinstance(objects, dict) else objects!r}"
            )
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            # Only hyperparameters this optimizer has: a peer's document never swaps `params`.
            if not isinstance(saved, dict) or not set(saved) <= set(group) - {"params"}:
                raise ValueError("a received param group holds keys this optimizer does not")
        core = {k: v for k, v in tensors.items() if k.startswith((MODEL_PREFIX, OPTIM_PREFIX))}
        load_state_tensors(self.model, self.optimizer, core)
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                current = group.get(key)
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                    current.copy_(value)
                else:
                    group[key] = value
        for name, obj in self.objects.items():
            obj.load_state_dict(objects[name])


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
    if is_dtensor(param) and value.dim() > 0:
        # Received state is on the CPU; a plain tensor is moved by `load_state_dict`, a DTensor
        # must be built on its mesh's device.
        return like(param, value.to(param.to_local().device))
    return value


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A cheap digest for the health service's divergence check (`Manager` sends one every
    `fingerprint_every_steps`, on the training thread): CRC-32 over the same names, dtypes,
    shapes and raw bytes as `fingerprint`, at memory speed (ISA-L: 0.05 s per GiB here, where
    sha256 takes 0.6 s). It tells a silently corrupted replica from the others (every error
    burst of up to 32 bits changes it, other corruption does with probability 1 - 2^-32), but
    it is no defence against a rank that forges its digest; `fingerprint` is the exact one."""
    value = 0
    total = 0
    for name in sorted(tensors):
        tensor = tensors[name].cpu()
        value = crc32(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode(), value)
        data = _raw_bytes(tensor)
        value = crc32(data, value)
        total += data.nbytes
    return f"crc32-{total:x}-{value:08x}"


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes in name order: equal iff bitwise equal."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()
