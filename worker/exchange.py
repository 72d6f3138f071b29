"""The cross-replica gradient exchange of one rank (DESIGN.md step 3).

The replica's gradient is kept intact in flat buffers, one per bucket of parameters; each attempt
exchanges a *copy*, so a failed exchange is retried on a new ring without recomputing forward and
backward. Buckets can be captured and sent while backward still runs (`overlap_backward`).
Two layouts inside a replica:

- replicated (DDP-style): every rank holds the whole gradient of its micro-batch. The ranks sum it
  inside the replica; rank i then owns slice i of every bucket and exchanges it on ring i, and
  the averaged slices are gathered back inside the replica.
- sharded (FSDP2 `fully_shard`, HSDP): FSDP has already reduce-scattered the gradient inside the
  replica, so rank i holds shard i and exchanges exactly that shard on ring i.

Either way each FTAR ring moves 1/W of the gradient."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fthsdp.worker.dtensor import is_dtensor, like, local
from fthsdp.worker.ftar import FtarRing, FtarWork, RecoverableFtarError
from fthsdp.worker.replica_group import ReplicaGroup


@dataclass(slots=True)
class _Bucket:
    params: list[torch.nn.Parameter]
    """In the order they sit in the buffers (reverse registration order)."""
    replica: torch.Tensor
    """The replica's gradient of these params (replicated layout: summed over its ranks), padded
    to a multiple of the world size; intact across retries."""
    result: torch.Tensor
    """The averaged gradient of the current attempt."""


@dataclass(slots=True)
class _Round:
    """One attempt's FTAR works, launched strictly in bucket order."""

    ring: FtarRing
    contribute: bool
    num_contributors: int
    starting: Callable[[], None] | None
    works: list[FtarWork] = field(default_factory=list)


class GradientExchange:
    """Flattens, exchanges and writes back gradients of a fixed parameter list.

    The unit is a bucket: trainable params, in reverse registration order (roughly the order
    backward produces their gradients), grouped into contiguous single-dtype buffers of about
    `bucket_bytes`. In the replicated layout rank i owns slice i of every bucket; each bucket's
    slice is one FTAR work. Whether buckets are captured all at once after backward (`capture`)
    or one by one while it runs (`capture_bucket`), the layout and hence the result are the same."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], group: ReplicaGroup, *, bucket_bytes: int
    ) -> None:
        trainable = [p for p in params if p.requires_grad]
        kinds = {is_dtensor(p) for p in trainable}
        if len(kinds) > 1:
            raise ValueError("mix of sharded (DTensor) and plain parameters is not supported")
        self.sharded = kinds == {True}
        devices = {local(p).device for p in trainable}
        if len(devices) > 1:
            names = ", ".join(sorted(map(str, devices)))
            raise ValueError(
                f"trainable parameters lie on several devices ({names}): a rank exchanges one "
                "device's gradients; move the model to one device"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        """Where the gradient buffers live (CUDA buffers go through FTAR's staging path)."""
        self._group = group
        self._parts = 1 if self.sharded else group.world_size
        self._buckets: list[_Bucket] = []
        pending: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(trainable):
            if pending and (p.dtype != pending[0].dtype or size >= bucket_bytes):
                self._buckets.append(self._bucket(pending))
                pending, size = [], 0
            pending.append(p)
            size += local(p).numel() * p.element_size()
        if pending:
            self._buckets.append(self._bucket(pending))
        self._round: _Round | None = None
        # Replicated layout, one dtype: the commit vote rides along with the gather of the
        # averaged slices (one collective instead of two). Per rank: [vote, slice of bucket 0,
        # slice of bucket 1, ...]; allocated once, reused every step.
        self._ballots: torch.Tensor | None = None
        self._gathered = False
        dtypes = {b.replica.dtype for b in self._buckets}
        if not self.sharded and group.world_size > 1 and len(dtypes) == 1:
            per_rank = 1 + sum(b.replica.numel() // self._parts for b in self._buckets)
            self._ballots = torch.zeros(
                per_rank * self._parts, dtype=dtypes.pop(), device=self.device
            )

    def _bucket(self, params: list[torch.nn.Parameter]) -> _Bucket:
        numel = sum(local(p).numel() for p in params)
        padded = max(1, -(-numel // self._parts)) * self._parts
        dtype = params[0].dtype
        return _Bucket(
            params=params,
            replica=torch.zeros(padded, dtype=dtype, device=self.device),
            result=torch.zeros(padded, dtype=dtype, device=self.device),
        )

    @property
    def share_bytes(self) -> int:
        """Bytes this rank exchanges across replicas per attempt (its slice of every bucket)."""
        return sum(b.result.numel() // self._parts * b.result.element_size() for b in self._buckets)

    @property
    def bucket_params(self) -> list[list[torch.nn.Parameter]]:
        """The params of each bucket, in bucket order."""
        return [bucket.params for bucket in self._buckets]

    def capture(self) -> None:
        """Copies local gradients into the replica buffers (replicated: summed over the ranks)."""
        for index in range(len(self._buckets)):
            self.capture_bucket(index)

    def capture_bucket(self, index: int) -> None:
        """`capture` for one bucket; a collective inside the replica in the replicated layout."""
        bucket = self._buckets[index]
        offset = 0
        for p in bucket.params:
            n = local(p).numel()
            if p.grad is None:
                bucket.replica[offset : offset + n].zero_()
            else:
                bucket.replica[offset : offset + n].copy_(local(p.grad).reshape(-1))
            offset += n
        if not self.sharded:
            self._group.sum_(bucket.replica)

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self._parts)[self._group.rank] if self._parts > 1 else tensor

    def begin(
        self,
        ring: FtarRing,
        *,
        contribute: bool,
        num_contributors: int,
        starting: Callable[[], None] | None = None,
    ) -> None:
        """Starts an attempt on `ring`; its buckets go out with `launch_through` and `wait`.

        `starting` runs right before the first bucket goes out (fault injection: a rank dying
        there leaves its peers mid-exchange)."""
        if self._round is not None:
            raise RuntimeError("an exchange attempt is already in progress")
        self._round = _Round(ring, contribute, num_contributors, starting)

    @property
    def launched(self) -> int:
        """Buckets of the current attempt already launched (they go out in bucket order)."""
        return 0 if self._round is None else len(self._round.works)

    def launch_through(self, index: int) -> None:
        """Launches every not yet launched bucket up to and including `index`, in order; their
        replica buffers must be captured."""
        current = self._round
        if current is None:
            raise RuntimeError("no exchange attempt in progress")
        while len(current.works) <= index:
            if not current.works and current.starting is not None:
                current.starting()
            bucket = self._buckets[len(current.works)]
            mine = self._mine(bucket.result)
            mine.copy_(self._mine(bucket.replica))
            current.works.append(
                current.ring.allreduce(
                    [mine],
                    contribute=current.contribute,
                    num_contributors=current.num_contributors,
                )
            )

    def wait(self, timeout: float) -> RecoverableFtarError | None:
        """Launches the attempt's remaining buckets and waits for all; returns the latched error,
        if any. Fatal FTAR errors (bad arguments, layout mismatch) propagate: retrying cannot fix
        them."""
        current = self._round
        if current is None:
            raise RuntimeError("no exchange attempt in progress")
        try:
            self.launch_through(len(self._buckets) - 1)
        finally:
            self._round = None
        error: RecoverableFtarError | None = None
        for work in current.works:
            try:
                work.wait(timeout)
            except RecoverableFtarError as exc:
                error = error or exc
        return error

    def abandon(self) -> None:
        """Forgets the current attempt without launching more (its ring failed to come up)."""
        self._round = None

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

        `starting` runs once the ring is up, right before the first bucket goes out. All
        buckets must be captured."""
        self.begin(
            ring, contribute=contribute, num_contributors=num_contributors, starting=starting
        )
        return self.wait(timeout)

    def agree(self, vote: bool) -> bool:
        """The replica's commit vote: True only if every rank voted True. Every rank calls it
        once per attempt, whatever its vote, so the replica's collectives stay matched.

        Replicated layout: the same collective also gathers the averaged slices that each rank
        owns, so a committing `apply` needs no further collective. They are used only when the
        vote is unanimous (a failed attempt's slices are discarded with it)."""
        self._gathered = False
        ballots = self._ballots
        if ballots is None:
            return self._group.all_agree(vote)
        rows = list(ballots.chunk(self._parts))
        mine = rows[self._group.rank]
        mine[0] = 1 if vote else 0
        offset = 1
        for bucket in self._buckets:
            part = self._mine(bucket.result)
            mine[offset : offset + part.numel()].copy_(part)
            offset += part.numel()
        self._group.all_gather_(rows)
        if not all(bool(row[0] == 1) for row in rows):
            return False
        offset = 1
        for bucket in self._buckets:
            n = bucket.result.numel() // self._parts
            for rank, piece in enumerate(bucket.result.chunk(self._parts)):
                if rank != self._group.rank:
                    piece.copy_(rows[rank][offset : offset + n])
            offset += n
        self._gathered = True
        return True

    def apply(self, scale: float = 1.0) -> None:
        """Writes the averaged gradient, times `scale`, into `.grad` (replicated: gathered
        inside the replica, by `agree` unless it could not, and divided by its ranks). `scale`
        weighs uneven micro-steps (`StepPlan.gradient_scale`)."""
        gathered, self._gathered = self._gathered, False
        if not self.sharded:
            scale /= self._group.world_size
        for bucket in self._buckets:
            if not self.sharded and not gathered:
                self._group.gather_slices_(bucket.result)
            if scale != 1.0:
                bucket.result.mul_(scale)
            offset = 0
            for p in bucket.params:
                target = local(p)
                n = target.numel()
                grad = bucket.result[offset : offset + n].view_as(target)
                if p.grad is None:
                    p.grad = like(p, grad.clone())
                else:
                    local(p.grad).copy_(grad)
                offset += n
