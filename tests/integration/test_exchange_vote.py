"""The commit vote fused with the gather of the averaged slices (`GradientExchange.agree`): a
single "no" fails the vote on every rank of the replica and leaves the local gradients intact for
a retry; a unanimous vote hands every rank the same averaged gradient. 2 replicas x 2 ranks (gloo
inside a replica, real FTAR rings over loopback), one process per rank."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from fthsdp.worker.exchange import GradientExchange
from tests.integration.exchange_support import RANKS, REPLICAS, TIMEOUT, rank_with_ring
from tests.integration.test_exchange_overlap import _model


def _grads(replica: int, rank: int) -> list[torch.Tensor]:
    model = _model()
    generator = torch.Generator().manual_seed(10 * replica + rank)
    x = torch.randn(8, 16, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _worker(index: int, tmp: Path) -> None:
    with rank_with_ring(index, tmp) as (replica, rank, group, ring):
        model = _model()
        exchange = GradientExchange(list(model.parameters()), group, bucket_bytes=1024)
        local = _grads(replica, rank)
        for p, g in zip(model.parameters(), local, strict=True):
            p.grad = g.clone()
        exchange.capture()
        # Attempt 1: rank 1 of every replica votes no; nobody may apply, gradients stay local.
        assert (
            exchange.exchange(ring, contribute=True, num_contributors=REPLICAS, timeout=TIMEOUT)
            is None
        )
        assert exchange.agree(rank != 1) is False
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local, strict=True))
        # Attempt 2 (no recompute): unanimous; every rank gets the average of all 4 gradients.
        assert (
            exchange.exchange(ring, contribute=True, num_contributors=REPLICAS, timeout=TIMEOUT)
            is None
        )
        assert exchange.agree(True) is True
        exchange.apply()
        every = [_grads(r, k) for r in range(REPLICAS) for k in range(RANKS)]
        for i, p in enumerate(model.parameters()):
            expected = sum(g[i] for g in every) / (REPLICAS * RANKS)
            assert torch.allclose(p.grad, expected, rtol=1e-5, atol=1e-7)
        torch.save([p.grad for p in model.parameters()], tmp / f"grads-{index}.pt")


def test_fused_vote_gates_and_gathers(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(tmp_path,), nprocs=REPLICAS * RANKS, join=True)
    grads = [torch.load(tmp_path / f"grads-{i}.pt") for i in range(REPLICAS * RANKS)]
    for other in grads[1:]:  # bitwise the same on every rank of every replica (I1)
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))
