"""Exactly-once data (I2) for map-style datasets through a normal `torch.utils.data.DataLoader`.

Replica k of R owns the global sample ids k, k+R, k+2R, ...; its rank r takes `batch_size` of
them per micro-step (`ShardSpec`), and a step trains `Manager.micro_steps` micro-steps (one
unless configured; the fail-slow planner may move some between replicas). Global id g is dataset
index `g mod N` of epoch `g // N`, shuffled per epoch with a seeded permutation when asked, so
across all replicas every index is trained once per epoch, whichever replicas were down when.
Positions are the replicated table the Manager commits with each step (they travel with catch-up
and durable checkpoints), so a restarted or recovering replica resumes exactly where its last
committed contribution ended. With uneven micro-steps a replica's stream runs ahead of or behind
the others' within an epoch; each stream is still trained once, in order.

A DataLoader with workers draws indices ahead of training (prefetch), before it is known whether
a step commits with this replica's contribution. `ExactlyOnceDataLoader` therefore checks each
batch against the committed position as it hands it out; when the position moved otherwise (a
catch-up step, which trains nothing of this replica's, or a restore), the prefetched batches are
dropped and loading restarts at the committed position. The stream is endless: stop by step."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fthsdp.worker.data import ShardSpec
from fthsdp.worker.loader_workers import end_with_this_process
from fthsdp.worker.manager import Manager

_FORBIDDEN = ("sampler", "batch_sampler", "drop_last")


class ExactlyOnceSampler(Sampler[list[int]]):
    """A batch sampler: this rank's micro-batch of dataset indices, step after step, from the
    replica's committed position. Use it through `ExactlyOnceDataLoader` (or, without workers,
    as `DataLoader(dataset, batch_sampler=sampler, num_workers=0)`, which draws lazily)."""

    def __init__(
        self,
        manager: Manager,
        dataset_size: int,
        *,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if dataset_size < 1:
            raise ValueError("the dataset is empty")
        self.spec = ShardSpec(
            replica_index=manager.config.replica_index,
            total_replicas=manager.config.total_replicas,
            rank=manager.group.rank,
            world_size=manager.group.world_size,
            micro_batch=batch_size,
        )
        if self.spec.samples_per_step != manager.samples_per_step:
            raise ValueError(
                f"batch_size {batch_size} x {manager.group.world_size} ranks = "
                f"{self.spec.samples_per_step} samples per micro-step, but the Manager "
                f"commits {manager.samples_per_step}"
            )
        self._manager = manager
        self._size = dataset_size
        self._shuffle = shuffle
        self._seed = seed
        self._perms: dict[int, torch.Tensor] = {}
        self._next_start: int | None = None

    def position(self) -> int:
        """The replica's committed position (samples of its stream trained)."""
        return self._manager.positions.get(self._manager.config.replica_id)

    def manager_step(self) -> int:
        """The step the replica trains now."""
        return self._manager.step

    def start_at(self, position: int) -> None:
        """The next iteration begins at `position` instead of the position at its first draw."""
        self._next_start = position

    def indices(self, position: int) -> list[int]:
        """Dataset indices this rank trains when its replica stands at `position`."""
        return [self._index(g) for g in self.spec.sample_ids(position)]

    def _index(self, sample: int) -> int:
        epoch, offset = divmod(sample, self._size)
        if not self._shuffle:
            return offset
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # a replica's stream spans at most two epochs at once
                self._perms.pop(min(self._perms))
            generator = torch.Generator().manual_seed(self._seed + epoch)
            perm = self._perms[epoch] = torch.randperm(self._size, generator=generator)
        return int(perm[offset])

    def __iter__(self) -> Iterator[list[int]]:
        start, self._next_start = self._next_start, None
        position = self.position() if start is None else start
        while True:
            yield self.indices(position)
            position += self.spec.samples_per_step


class HandedOut:
    """What a loader handed out since the replica's last commit: a step trains
    `Manager.micro_steps` consecutive micro-batches (any number, 0 included), and the next step
    must begin right after what the replica's position says it committed."""

    __slots__ = ("pending", "position", "step")

    def __init__(self, step: int, position: int) -> None:
        self.step = step
        self.position = position
        self.pending = 0
        """Micro-batches handed out in `step`."""

    def still_in_step(self, step: int, position: int, samples_per_batch: int) -> bool:
        """Whether the next micro-batch continues the stream: the same step, or a new one whose
        commit advanced the position by exactly the micro-batches handed out. False when a step
        committed otherwise (a catch-up step trains none of this replica's data, a restore
        moves the position): the loader reloads at the committed position."""
        if step == self.step:
            return position == self.position
        if position != self.position + self.pending * samples_per_batch:
            return False
        self.step, self.position, self.pending = step, position, 0
        return True


class ExactlyOnceDataLoader(DataLoader[Any]):
    """`DataLoader(dataset, batch_size=..., shuffle=..., num_workers=..., ...)` with batches at
    the replica's committed position (see the module doc). Every DataLoader option but
    `sampler`, `batch_sampler` and `drop_last` is accepted; iteration never ends. Workers start
    through `forkserver` unless `multiprocessing_context` says otherwise (so the dataset must
    pickle, as with spawn), and exit once their rank is gone, however it died."""

    def __init__(
        self,
        dataset: Dataset[Any],
        manager: Manager,
        batch_size: int,
        shuffle: bool = False,
        *,
        seed: int = 0,
        **options: Any,
    ) -> None:
        clash = [name for name in _FORBIDDEN if name in options]
        if clash:
            raise ValueError(f"{', '.join(clash)}: the exactly-once sampler decides the batches")
        if options.get("in_order") is False:
            raise ValueError("in_order=False would hand out batches out of position")
        if not isinstance(dataset, Sized):
            raise TypeError("a map-style dataset with __len__ is needed")
        self.exactly_once = ExactlyOnceSampler(
            manager, len(dataset), batch_size=batch_size, shuffle=shuffle, seed=seed
        )
        self._seed = seed
        self._own_generator = options.get("generator") is None
        if options.get("num_workers", 0) > 0:
            # A rank runs gRPC threads (the quorum and health clients): a worker forked from it
            # can crash in gRPC's state. forkserver forks workers from a clean server process.
            options.setdefault("multiprocessing_context", "forkserver")
            # Such a worker is not the rank's child: without this it outlives a killed rank.
            options["worker_init_fn"] = end_with_this_process(options.get("worker_init_fn"))
        super().__init__(dataset, batch_sampler=self.exactly_once, **options)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        step = self.exactly_once.spec.samples_per_step
        while True:
            start = self.exactly_once.position()
            self.exactly_once.start_at(start)
            if self._own_generator:
                # Each iterator draws its workers' base seed from `generator`, by default from
                # torch's global one: the user's, which travels with the replica's state
                # (RNGState). A reload this replica alone made would set it apart from the
                # others; a generator of the position gives every replica at that position
                # the same worker seeds instead.
                self.generator = torch.Generator().manual_seed(
                    (self._seed * 1_000_003 + start) % 2**63
                )
            batches = super().__iter__()
            handed = HandedOut(self.exactly_once.manager_step(), start)
            try:
                for batch in batches:
                    if not handed.still_in_step(
                        self.exactly_once.manager_step(), self.exactly_once.position(), step
                    ):
                        break  # a step committed without this replica's batches: reload
                    yield batch
                    handed.pending += 1
            finally:
                shutdown = getattr(batches, "_shutdown_workers", None)
                if shutdown is not None and not self.persistent_workers:
                    shutdown()
