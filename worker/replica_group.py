"""Collectives inside one replica (its ranks), over a torch.distributed process group.

Only bytes and tensors cross the wire: the leader's quorum answer travels as UTF-8 JSON in a uint8
tensor, never pickled. With one rank per replica every call is local.

The backend follows the tensors: with CUDA present the group is `cpu:gloo,cuda:nccl`, so the
small control messages (plans, votes: CPU tensors) go over gloo and CUDA gradients over NCCL;
without CUDA it is gloo."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

_MAX_MESSAGE_BYTES = 64 << 20


class ReplicaGroup:
    """The ranks of one replica; rank 0 is the leader."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        if world_size > 1 and group is None:
            raise ValueError("a replica with more than one rank needs a process group")
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def init(
        cls,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        timeout: timedelta = timedelta(seconds=60),
        backend: str | None = None,
    ) -> ReplicaGroup:
        """Joins the replica's process group (one per replica; ranks of other replicas never
        join). `backend` defaults to `default_backend()`."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a replica of {world_size} ranks")
        if world_size == 1:
            return cls(None, 0, 1)
        dist.init_process_group(
            backend or default_backend(),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        return cls(dist.group.WORLD, rank, world_size)

    @classmethod
    def from_torch(cls, group: dist.ProcessGroup | None = None) -> ReplicaGroup:
        """The process group the script initialised itself, over the replica's ranks (under
        torchrun, one job per replica: the default group after `init_process_group()`)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group()")
        group = group or dist.group.WORLD
        assert group is not None
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        timeout: timedelta = timedelta(seconds=60),
        backend: str | None = None,
    ) -> ReplicaGroup:
        """The replica's group as torchrun describes it (one torchrun job per replica):
        `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; a single rank without them."""
        environ = os.environ if env is None else env
        rank = int(environ.get("RANK", "0"))
        world_size = int(environ.get("WORLD_SIZE", "1"))
        if world_size > 1 and "MASTER_PORT" not in environ:
            raise ValueError(
                "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (run under torchrun)"
            )
        address = environ.get("MASTER_ADDR", "127.0.0.1")
        if ":" in address:  # an IPv6 literal
            address = f"[{address.strip('[]')}]"
        init_method = f"tcp://{address}:{environ.get('MASTER_PORT', '0')}"
        return cls.init(
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            timeout=timeout,
            backend=backend,
        )

    @property
    def is_leader(self) -> bool:
        """Whether this rank talks to the quorum service for the replica."""
        return self.rank == 0

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The leader's payload on every rank (the leader passes it, the others pass None)."""
        if self.world_size == 1:
            assert payload is not None
            return payload
        length = self.broadcast_ints([len(payload)] if payload is not None else None, 1)[0]
        return self.broadcast_payload(payload, length)

    def broadcast_ints(self, values: list[int] | None, count: int) -> list[int]:
        """The leader's `count` int64 values on every rank (the others pass None): one small
        fixed-size collective."""
        if self.world_size == 1:
            assert values is not None
            return values
        if values is not None and len(values) != count:
            raise ValueError(f"expected {count} values, got {len(values)}")
        tensor = (
            torch.tensor(values, dtype=torch.int64)
            if values is not None
            else torch.empty(count, dtype=torch.int64)
        )
        dist.broadcast(tensor, src=0, group=self.group)
        return [int(v) for v in tensor.tolist()]

    def broadcast_payload(self, payload: bytes | None, length: int) -> bytes:
        """The leader's payload of a `length` every rank already knows (`broadcast_ints`)."""
        if self.world_size == 1:
            assert payload is not None
            return payload
        if not 0 <= length <= _MAX_MESSAGE_BYTES:
            raise ValueError(f"replica message of {length} bytes is out of bounds")
        if payload is not None:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.group)
        return buffer.numpy().tobytes()

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's payload, in rank order, on every rank."""
        if self.world_size == 1:
            return [payload]
        if len(payload) > _MAX_MESSAGE_BYTES:
            raise ValueError("payload too large")
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        return [g[: int(s.item())].numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)]

    def all_agree(self, vote: bool) -> bool:
        """The commit vote: True only if every rank voted True."""
        if self.world_size == 1:
            return vote
        ballot = torch.tensor([1 if vote else 0], dtype=torch.int32)
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        return bool(ballot.item())

    def sum_(self, tensor: torch.Tensor) -> None:
        """In-place sum over the replica's ranks (the replica's gradient before the exchange)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)

    def all_gather_(self, rows: list[torch.Tensor]) -> None:
        """In place: every rank's `rows[rank]` lands in `rows[rank]` on every rank (equal
        shapes; views into one buffer are fine)."""
        if self.world_size > 1:
            dist.all_gather(rows, rows[self.rank].clone(), group=self.group)

    def gather_slices_(self, flat: torch.Tensor) -> None:
        """Fills every rank's `flat` with the slices that each rank owns (slice i from rank i).

        `flat` has a length divisible by the world size."""
        if self.world_size == 1:
            return
        slices = list(flat.chunk(self.world_size))
        mine = slices[self.rank].clone()
        dist.all_gather(slices, mine, group=self.group)

    def abort(self) -> None:
        """Aborts the group's pending collectives where the backend can (NCCL ends them with
        an error); a blocked gloo call ends only with the process. Never raises."""
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                self.group.abort()

    def close(self) -> None:
        """Leaves the process group, and drops this object's handle to it, so the backend and
        its threads go now rather than whenever the interpreter tears down. Idempotent."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


def default_backend() -> str:
    """gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA is present."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
