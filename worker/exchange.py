"""The cross-replica gradient exchange of one rank (DESIGN.md step 3).

The replica's gradient (its ranks' gradients summed inside the replica) is kept intact in flat
buffers, one per dtype; each attempt exchanges a *copy* of this rank's slice, so a failed exchange
is retried on a new ring without recomputing forward and backward. Rank i of the replica owns
slice i of every buffer and exchanges it on ring i; the slices are then gathered inside the
replica, so each FTAR ring moves 1/W of the gradient (the HSDP layout)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.ftar import FtarRing, FtarWork, RecoverableFtarError
from worker.replica_group import ReplicaGroup


@dataclass(slots=True)
class _Flat:
    params: list[torch.nn.Parameter]
    replica: torch.Tensor
    """Sum of the replica's local gradients; intact across retries."""
    result: torch.Tensor
    """The averaged gradient of the current attempt."""


class GradientExchange:
    """Flattens, exchanges and writes back gradients of a fixed parameter list."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], group: ReplicaGroup, *, bucket_bytes: int
    ) -> None:
        self._group = group
        self._bucket_bytes = bucket_bytes
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        self._flats: list[_Flat] = []
        for dtype, group_params in by_dtype.items():
            numel = sum(p.numel() for p in group_params)
            padded = -(-numel // group.world_size) * group.world_size
            self._flats.append(
                _Flat(
                    params=group_params,
                    replica=torch.zeros(padded, dtype=dtype),
                    result=torch.zeros(padded, dtype=dtype),
                )
            )

    @property
    def nbytes(self) -> int:
        """Bytes of one full gradient."""
        return sum(f.replica.numel() * f.replica.element_size() for f in self._flats)

    def capture(self) -> None:
        """Copies local gradients into the replica buffers and sums them inside the replica."""
        for flat in self._flats:
            offset = 0
            for p in flat.params:
                n = p.numel()
                if p.grad is None:
                    flat.replica[offset : offset + n].zero_()
                else:
                    flat.replica[offset : offset + n].copy_(p.grad.reshape(-1))
                offset += n
            self._group.sum_(flat.replica)

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
        launched: Callable[[], None] | None = None,
    ) -> RecoverableFtarError | None:
        """Averages this rank's slice across the ring; returns the latched error, if any.

        Fatal FTAR errors (bad arguments, layout mismatch) propagate: retrying cannot fix them."""
        works: list[FtarWork] = []
        for flat in self._flats:
            mine = flat.result.chunk(self._group.world_size)[self._group.rank]
            mine.copy_(flat.replica.chunk(self._group.world_size)[self._group.rank])
            for bucket in self._buckets(mine):
                works.append(
                    ring.allreduce(
                        [bucket], contribute=contribute, num_contributors=num_contributors
                    )
                )
        if launched is not None:
            launched()
        error: RecoverableFtarError | None = None
        for work in works:
            try:
                work.wait(timeout)
            except RecoverableFtarError as exc:
                error = error or exc
        return error

    def apply(self) -> None:
        """Gathers the averaged slices inside the replica and writes them into `.grad`."""
        scale = 1.0 / self._group.world_size
        for flat in self._flats:
            self._group.gather_slices_(flat.result)
            if self._group.world_size > 1:
                flat.result.mul_(scale)
            offset = 0
            for p in flat.params:
                n = p.numel()
                grad = flat.result[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = grad.clone()
                else:
                    p.grad.copy_(grad)
                offset += n
