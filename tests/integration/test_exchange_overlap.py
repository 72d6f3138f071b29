"""Overlapping the cross-replica exchange with backward gives bitwise the same training as
exchanging after backward: 2 replicas x 2 ranks (gloo inside a replica, real FTAR rings over
loopback), one process per rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fthsdp.worker.exchange import GradientExchange
from fthsdp.worker.ftar import FtarRing
from fthsdp.worker.replica_group import ReplicaGroup
from tests.integration.exchange_support import RANKS, REPLICAS, TIMEOUT, rank_with_ring

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def _train(
    ring: FtarRing, group: ReplicaGroup, replica: int, *, overlap: bool
) -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    exchange = GradientExchange(list(model.parameters()), group, bucket_bytes=256)
    buckets = exchange.bucket_params
    assert len(buckets) > 2  # several buckets, so the overlap path really interleaves
    remaining: list[int] = []
    hooks = []
    if overlap:

        def on_grad(index: int) -> None:
            remaining[index] -= 1
            if remaining[index] == 0:
                exchange.capture_bucket(index)
                ready[index] = True
                while exchange.launched < len(buckets) and ready[exchange.launched]:
                    exchange.launch_through(exchange.launched)

        for index, params in enumerate(buckets):
            for p in params:
                hooks.append(
                    p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda _p, index=index: on_grad(index)
                    )
                )
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * step + 10 * replica + group.rank)
        x = torch.randn(8, 16, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        remaining[:] = [len(params) for params in buckets]
        ready = [False] * len(buckets)
        if overlap:
            exchange.begin(ring, contribute=True, num_contributors=REPLICAS)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if overlap:
            assert exchange.launched > 0  # some buckets went out during backward
            error = exchange.wait(TIMEOUT)
        else:
            exchange.capture()
            error = exchange.exchange(
                ring, contribute=True, num_contributors=REPLICAS, timeout=TIMEOUT
            )
        assert error is None
        exchange.apply()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    for hook in hooks:
        hook.remove()
    return [p.detach().clone() for p in model.parameters()]


def _worker(index: int, tmp: Path) -> None:
    with rank_with_ring(index, tmp) as (replica, rank, group, ring):
        plain = _train(ring, group, replica, overlap=False)
        overlapped = _train(ring, group, replica, overlap=True)
        for a, b in zip(plain, overlapped, strict=True):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b) for a, b in zip(plain, _model().parameters(), strict=True))
        torch.save(overlapped, tmp / f"params-r{replica}-k{rank}.pt")


def test_overlapped_exchange_matches_exchange_after_backward(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(tmp_path,), nprocs=REPLICAS * RANKS, join=True)
    results = [
        torch.load(tmp_path / f"params-r{r}-k{k}.pt") for r in range(REPLICAS) for k in range(RANKS)
    ]
    for other in results[1:]:  # I1: every rank of every replica holds the same parameters
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def _sharded_manager(_index: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fthsdp.worker.config import ManagerConfig
    from fthsdp.worker.manager import Manager

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.data, mesh, [Shard(0)]))
        model.bias = torch.nn.Parameter(distribute_tensor(model.bias.data, mesh, [Shard(0)]))
        config = ManagerConfig(
            job_id="job",
            replica_id="r0",
            replica_index=0,
            total_replicas=1,
            quorum_address="127.0.0.1:1",
            checkpoint_url="http://127.0.0.1:1",
            token="t",
            overlap_backward=True,
        )
        with pytest.raises(ValueError, match="overlap_backward"):
            Manager(
                config=config,
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                group=ReplicaGroup(None, 0, 1),
                samples_per_step=1,
            )
    finally:
        dist.destroy_process_group()


def test_overlap_is_refused_for_sharded_params(tmp_path: Path) -> None:
    mp.spawn(_sharded_manager, args=(tmp_path,), nprocs=1, join=True)
