"""The cross-replica gradient exchange of one rank (DESIGN.md step 3).

The replica's gradient is kept intact in flat buffers, one per dtype; each attempt exchanges a
*copy*, so a failed exchange is retried on a new ring without recomputing forward and backward.
Two layouts inside a replica:

- replicated (DDP-style): every rank holds the whole gradient of its micro-batch. The ranks sum it
  inside the replica; rank i then owns slice i of every buffer and exchanges it on ring i, and
  the averaged slices are gathered back inside the replica.
- sharded (FSDP2 `fully_shard`, HSDP): FSDP has already reduce-scattered the gradient inside the
  replica, so rank i holds shard i and exchanges exactly that shard on ring i.

Either way each FTAR ring moves 1/W of the gradient."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from worker.ftar import FtarRing, FtarWork, RecoverableFtarError
from worker.replica_group import ReplicaGroup


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's part) shaped like `param`: a DTensor with the same sharding if it is."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value


@dataclass(slots=True)
class _Flat:
    params: list[torch.nn.Parameter]
    replica: torch.Tensor
    """The replica's gradient (replicated layout: summed over its ranks); intact across retries."""
    result: torch.Tensor
    """The averaged gradient of the current attempt."""


class GradientExchange:
    """Flattens, exchanges and writes back gradients of a fixed parameter list."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], group: ReplicaGroup, *, bucket_bytes: int
    ) -> None:
        trainable = [p for p in params if p.requires_grad]
        kinds = {isinstance(p, DTensor) for p in trainable}
        if len(kinds) > 1:
            raise ValueError("mix of sharded (DTensor) and plain parameters is not supported")
        self.sharded = kinds == {True}
        self._group = group
        self._bucket_bytes = bucket_bytes
        self._parts = 1 if self.sharded else group.world_size
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        self._flats: list[_Flat] = []
        for dtype, group_params in by_dtype.items():
            numel = sum(local(p).numel() for p in group_params)
            padded = -(-numel // self._parts) * self._parts
            self._flats.append(
                _Flat(
                    params=group_params,
                    replica=torch.zeros(padded, dtype=dtype),
                    result=torch.zeros(padded, dtype=dtype),
                )
            )

    def capture(self) -> None:
        """Copies local gradients into the replica buffers (replicated: summed over the ranks)."""
        for flat in self._flats:
            offset = 0
            for p in flat.params:
                n = local(p).numel()
                if p.grad is None:
                    flat.replica[offset : offset + n].zero_()
                else:
                    flat.replica[offset : offset + n].copy_(local(p.grad).reshape(-1))
                offset += n
            if not self.sharded:
                self._group.sum_(flat.replica)

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self._parts)[self._group.rank] if self._parts > 1 else tensor

    def _buckets(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        per_bucket = max(1, self._bucket_bytes // tensor.element_size())
        return [tensor[i : i + per_bucket] for i in range(0, tensor.numel(), per_bucket)]

    def exchange(
        self,
        ring: FtarRing,
        *,
        contribute: bool,
        num_contributors: int,
        timeout: float,
        starting: Callable[[], None] | None = None,
    ) -> RecoverableFtarError | None:
        """Averages this rank's part across the ring; returns the latched error, if any.

        `starting` runs once the ring is up, right before the first bucket goes out (fault
        injection: a rank dying there leaves its peers mid-exchange). Fatal FTAR errors (bad
        arguments, layout mismatch) propagate: retrying cannot fix them."""
        if starting is not None:
            starting()
        works: list[FtarWork] = []
        for flat in self._flats:
            mine = self._mine(flat.result)
            mine.copy_(self._mine(flat.replica))
            for bucket in self._buckets(mine):
                works.append(
                    ring.allreduce(
                        [bucket], contribute=contribute, num_contributors=num_contributors
                    )
                )
        error: RecoverableFtarError | None = None
        for work in works:
            try:
                work.wait(timeout)
            except RecoverableFtarError as exc:
                error = error or exc
        return error

    def apply(self) -> None:
        """Writes the averaged gradient into `.grad` (replicated: gathered inside the replica)."""
        for flat in self._flats:
            if not self.sharded:
                self._group.gather_slices_(flat.result)
                if self._group.world_size > 1:
                    flat.result.mul_(1.0 / self._group.world_size)
            offset = 0
            for p in flat.params:
                target = local(p)
                n = target.numel()
                grad = flat.result[offset : offset + n].view_as(target)
                if p.grad is None:
                    p.grad = _like(p, grad.clone())
                else:
                    local(p.grad).copy_(grad)
                offset += n
