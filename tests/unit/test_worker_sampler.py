"""The exactly-once sampler and loader against a stand-in Manager (positions set by the test):
batches follow the committed position through prefetching workers, restarts and jumps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from fthsdp.worker.data import DataPositions
from fthsdp.worker.sampler import ExactlyOnceDataLoader, ExactlyOnceSampler


class Indexed(Dataset[torch.Tensor]):
    """Each sample is its own index."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def _manager(index: int, total: int, rank: int = 0, world: int = 1, batch: int = 2) -> Any:
    return SimpleNamespace(
        config=SimpleNamespace(replica_index=index, total_replicas=total, replica_id=f"r{index}"),
        group=SimpleNamespace(rank=rank, world_size=world),
        samples_per_step=batch * world,
        positions=DataPositions(),
        step=0,
    )


def test_every_index_is_trained_once_per_epoch_across_replicas_and_ranks() -> None:
    size, total, world, batch = 60, 3, 2, 5
    seen: list[int] = []
    for index in range(total):
        for rank in range(world):
            sampler = ExactlyOnceSampler(
                _manager(index, total, rank, world, batch), size, batch_size=batch, shuffle=True
            )
            for step in range(2):  # 2 steps x 10 samples x 3 replicas = one epoch of 60
                seen += sampler.indices(step * batch * world)
    assert sorted(seen) == list(range(size))
    assert seen[:10] != sorted(seen[:10])  # shuffled
    next_epoch = ExactlyOnceSampler(_manager(0, total), size, batch_size=2, shuffle=True)
    assert next_epoch.indices(20) != next_epoch.indices(0)  # epoch 1 draws another order


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_follows_the_committed_position(workers: int) -> None:
    manager = _manager(0, 2)
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["prefetch_factor"] = 3
    loader = ExactlyOnceDataLoader(Indexed(100), manager, batch_size=2, **options)
    batches = iter(loader)

    def take() -> list[int]:
        return [int(i) for i in next(batches)]

    def commit(position: int) -> None:
        manager.positions = DataPositions({"r0": position})
        manager.step += 1

    assert take() == [0, 2]
    commit(2)
    assert take() == [4, 6]
    commit(2)
    # That step was a catch-up: it trained none of r0's samples, so r0 still stands at 2
    # and the same samples come again, although later ones were prefetched.
    assert take() == [4, 6]
    commit(4)
    assert take() == [8, 10]
    commit(20)  # a catch-up loaded a table where r0 stands far ahead
    assert take() == [40, 42]
    commit(22)
    assert take() == [44, 46]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_of_several_micro_steps_takes_consecutive_batches(workers: int) -> None:
    """Uneven micro-steps (fail-slow rebalancing): a step trains any number of micro-batches,
    none included, and the next step continues after what the commit recorded."""
    manager = _manager(0, 2)
    loader = ExactlyOnceDataLoader(Indexed(100), manager, batch_size=2, num_workers=workers)
    batches = iter(loader)

    def take(count: int) -> list[list[int]]:
        return [[int(i) for i in next(batches)] for _ in range(count)]

    def commit(position: int) -> None:
        manager.positions = DataPositions({"r0": position})
        manager.step += 1

    assert take(3) == [[0, 2], [4, 6], [8, 10]]
    commit(6)  # three micro-steps of 2 samples
    assert take(1) == [[12, 14]]
    commit(8)
    commit(8)  # a step with no micro-step of r0's
    assert take(2) == [[16, 18], [20, 22]]
    commit(10)  # it trained only the first: the second comes again
    assert take(1) == [[20, 22]]


def test_bad_loader_options_are_refused() -> None:
    manager = _manager(0, 2)
    with pytest.raises(ValueError, match="sampler"):
        ExactlyOnceDataLoader(Indexed(10), manager, batch_size=2, sampler=range(10))
    with pytest.raises(ValueError, match="in_order"):
        ExactlyOnceDataLoader(Indexed(10), manager, batch_size=2, in_order=False)
    with pytest.raises(ValueError, match="samples per micro-step"):
        ExactlyOnceDataLoader(Indexed(10), manager, batch_size=3)
    with pytest.raises(ValueError, match="empty"):
        ExactlyOnceSampler(manager, 0, batch_size=2)


def test_reloading_at_a_new_position_leaves_the_global_generator_alone() -> None:
    """A reload happens on one replica only (its step committed without its batch): drawing
    the workers' seed from torch's global generator would set that replica's state (which
    RNGState carries) apart from the others'."""
    manager = _manager(0, 2)
    loader = ExactlyOnceDataLoader(Indexed(100), manager, batch_size=2)
    batches = iter(loader)
    before = torch.get_rng_state()
    next(batches)
    manager.positions = DataPositions({"r0": 20})  # a jump: the loader reloads
    assert [int(i) for i in next(batches)] == [40, 42]
    assert torch.equal(torch.get_rng_state(), before)
