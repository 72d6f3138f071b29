"""The commit vote fused with the gather of the averaged slices (`GradientExchange.agree`): a
single "no" fails the vote on every rank of the replica and leaves the local gradients intact for
a retry; a unanimous vote hands every rank the same averaged gradient. 2 replicas x 2 ranks (gloo
inside a replica, real FTAR rings over loopback), one process per rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fthsdp.worker.exchange import GradientExchange
from fthsdp.worker.ftar import FtarRing
from fthsdp.worker.replica_group import ReplicaGroup
from tests.integration.test_exchange_overlap import RANKS, REPLICAS, TIMEOUT, _model, _peer_address
from tests.integration.test_ftar_support import FAST


def _grads(replica: int, rank: int) -> list[torch.Tensor]:
    model = _model()
    generator = torch.Generator().manual_seed(10 * replica + rank)
    x = torch.randn(8, 16, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _worker(index: int, tmp: Path) -> None:
    replica, rank = divmod(index, RANKS)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv-r{replica}", rank=rank, world_size=RANKS
    )
    group = ReplicaGroup(dist.group.WORLD, rank, RANKS)
    ring = FtarRing(replace(FAST, chunk_bytes=4096))
    try:
        (tmp / f"addr-r{replica}-k{rank}.tmp").write_text(ring.address)
        (tmp / f"addr-r{replica}-k{rank}.tmp").rename(tmp / f"addr-r{replica}-k{rank}")
        ring.reconfigure([_peer_address(tmp, r, rank) for r in range(REPLICAS)], replica, 1)
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
    finally:
        ring.close()
        group.close()


def test_fused_vote_gates_and_gathers(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(tmp_path,), nprocs=REPLICAS * RANKS, join=True)
    grads = [torch.load(tmp_path / f"grads-{i}.pt") for i in range(REPLICAS * RANKS)]
    for other in grads[1:]:  # bitwise the same on every rank of every replica (I1)
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))
