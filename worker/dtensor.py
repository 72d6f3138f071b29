"""DTensor checks that never import `torch.distributed.tensor` themselves.

That package costs about 0.7 s of CPU to import (it pulls in sympy and the op registrations), paid
by every rank process at start and again at each restart, while a replica without FSDP2 never
holds a DTensor. A DTensor can only exist once its module has been imported by whoever built it
(FSDP2's `fully_shard` does), so a module that is absent answers "not a DTensor" for free.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's part, on its device) shaped like `param`: a DTensor with the same
    mesh and sharding if `param` is one, else `value` itself."""
    if not is_dtensor(param):
        return value
    return type(param).from_local(
        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
