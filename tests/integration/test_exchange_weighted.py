"""Uneven micro-steps (fail-slow rebalancing): the exchanged gradient weighs every micro-step the
same, so a step whose micro-batches are split 3 + 1 between two replicas applies exactly the
update of the even 2 + 2 split of the same micro-batches. 2 replicas x 2 ranks (gloo inside a
replica, real FTAR rings over loopback), one process per rank.

The model is linear with integer data and a squared loss, so every per-sample gradient is a small
integer and every division is by a power of two: each floating-point operation on the way is
exact, and the two splits must agree bit for bit, not merely closely."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import torch
import torch.multiprocessing as mp

from fthsdp.services.quorum.client import MicroSteps
from fthsdp.worker.exchange import GradientExchange
from fthsdp.worker.ftar import FtarRing
from fthsdp.worker.plan import StepPlan
from fthsdp.worker.replica_group import ReplicaGroup
from tests.integration.exchange_support import RANKS, REPLICAS, TIMEOUT, rank_with_ring

MICRO_BATCH = 2
SPLITS = {"even": (2, 2), "uneven": (3, 1)}
"""Micro-steps of replica 0 and replica 1; both splits train the same 4 micro-steps."""


def _micro_batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-step `index` of the global batch, rank `rank`'s samples: small integers."""
    generator = torch.Generator().manual_seed(100 * index + rank)
    x = torch.randint(-4, 5, (MICRO_BATCH, 3), generator=generator).float()
    y = torch.randint(-4, 5, (MICRO_BATCH,), generator=generator).float()
    return x, y


def _plan(shares: tuple[int, int]) -> StepPlan:
    replicas = tuple(f"r{i}" for i in range(REPLICAS))
    return StepPlan(
        quorum_id=1,
        max_step=0,
        ring=(),
        ring_replicas=replicas,
        healthy=replicas,
        sources=(),
        serve=False,
        micro_steps=MicroSteps(
            even=2, trained=MappingProxyType(dict(zip(replicas, shares, strict=True)))
        ),
    )


def _step(
    group: ReplicaGroup, ring: FtarRing, replica: int, rank: int, split: str
) -> list[torch.Tensor]:
    """One step of `split`: this replica's micro-steps accumulated, exchanged, weighed."""
    shares = SPLITS[split]
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    exchange = GradientExchange(list(model.parameters()), group, bucket_bytes=1024)
    first = sum(shares[:replica])
    for index in range(first, first + shares[replica]):
        x, y = _micro_batch(index, rank)
        loss = ((model(x).squeeze(1) - y) ** 2).mean()  # the mean over the micro-batch only
        loss.backward()
    exchange.capture()
    error = exchange.exchange(ring, contribute=True, num_contributors=REPLICAS, timeout=TIMEOUT)
    assert error is None
    assert exchange.agree(True)
    exchange.apply(_plan(shares).gradient_scale())
    return [p.grad.detach().clone() for p in model.parameters()]


def _worker(index: int, tmp: Path) -> None:
    with rank_with_ring(index, tmp) as (replica, rank, group, ring):
        grads = {split: _step(group, ring, replica, rank, split) for split in SPLITS}
        torch.save(grads, tmp / f"grads-{index}.pt")


def _sum_of_per_sample_gradients_over_the_global_batch() -> torch.Tensor:
    total = torch.zeros(1, 3)
    for index in range(sum(SPLITS["even"])):
        for rank in range(RANKS):
            x, y = _micro_batch(index, rank)
            total += (-2 * y[:, None] * x).sum(0)  # d/dw (w.x - y)^2 at w = 0
    return total / (sum(SPLITS["even"]) * RANKS * MICRO_BATCH)


def test_an_uneven_split_applies_exactly_the_even_splits_update(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(tmp_path,), nprocs=REPLICAS * RANKS, join=True)
    expected = _sum_of_per_sample_gradients_over_the_global_batch()
    assert expected.abs().sum() > 0
    for index in range(REPLICAS * RANKS):
        grads = torch.load(tmp_path / f"grads-{index}.pt")
        assert torch.equal(grads["even"][0], expected), (index, grads["even"][0], expected)
        assert torch.equal(grads["uneven"][0], grads["even"][0]), index
