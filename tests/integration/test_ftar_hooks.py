"""The DDP comm hook: real DistributedDataParallel models (one per replica, threads of this
process, each over its own single-rank gloo group) averaging gradients through FTAR."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fthsdp.worker.ftar import FtarHookState, RecoverableFtarError, ftar_comm_hook
from tests.integration.test_ftar_support import ring_set


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """DDP needs a process group; each replica here is a world of one (the hook does the rest)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _backward(ddp: DistributedDataParallel, x: torch.Tensor, errors: list[BaseException]) -> None:
    try:
        ddp(x).square().sum().backward()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.usefixtures("single_rank_group")
def test_ddp_hook_averages_gradients_across_replicas() -> None:
    with ring_set(3) as rings:
        models = [_model(0) for _ in rings]  # identical replicas
        ddps = [DistributedDataParallel(m, bucket_cap_mb=1e-4) for m in models]  # many buckets
        states = [FtarHookState(ring=r) for r in rings]
        for ddp, state in zip(ddps, states, strict=True):
            ddp.register_comm_hook(state, ftar_comm_hook)
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        # Replica 2 is recovering: it contributes zeros; the mean is over the 2 healthy ones.
        for i, state in enumerate(states):
            state.begin_step(contribute=i < 2, num_contributors=2)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_backward, args=(d, x, errors))
            for d, x in zip(ddps, inputs, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert errors == []
        assert all(s.vote() for s in states)
        expected = []
        for x in inputs[:2]:
            ref = _model(0)
            ref(x).square().sum().backward()
            expected.append([p.grad for p in ref.parameters()])
        for m in models:
            for p, g0, g1 in zip(m.parameters(), *expected, strict=True):
                assert p.grad is not None
                torch.testing.assert_close(p.grad, (g0 + g1) / 2)
        for m in models[1:]:
            for p, q in zip(m.parameters(), models[0].parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)


def test_hook_latches_recoverable_errors_and_keeps_the_bucket() -> None:
    class Bucket:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def buffer(self) -> torch.Tensor:
            return self.t

        def index(self) -> int:
            return 0

    with ring_set(2) as (a, _):
        state = FtarHookState(ring=a)
        state.begin_step(contribute=True, num_contributors=2)
        a.abort("quorum changed")
        grads = torch.arange(6.0)
        fut = ftar_comm_hook(state, Bucket(grads))
        result = fut.wait()
        assert result is grads
        assert torch.equal(grads, torch.arange(6.0))
        assert not state.vote()
        assert isinstance(state.error, RecoverableFtarError)
        state.begin_step(contribute=True, num_contributors=2)
        assert state.vote()
