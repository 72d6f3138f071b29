"""FTAR on CUDA tensors (pinned staging, side stream, events). Skipped without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fthsdp.worker.ftar import FtarAbortedError
from fthsdp.worker.ftar.codec import reference_allreduce
from tests.integration.test_ftar_support import FAST, ring_set

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_exchange_is_ordered_with_the_callers_stream(dtype: torch.dtype) -> None:
    device = torch.device("cuda", 0)
    with ring_set(3) as rings:
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # a non-default current stream, as in training
            base = [
                torch.full((1000, 33), float(i + 1), device=device, dtype=dtype) for i in range(3)
            ]
            grads = [torch.zeros(1000, 33, device=device, dtype=dtype) for _ in range(3)]
            extra = [torch.zeros(7, device=device, dtype=dtype) for _ in range(3)]
            works = []
            for i, ring in enumerate(rings):
                # Written by a kernel queued right before allreduce: the exchange must wait for it.
                torch.cuda._sleep(2_000_000)
                grads[i].copy_(base[i])
                extra[i].fill_(float("nan") if i == 2 else 2.0)
                works.append(
                    ring.allreduce([grads[i], extra[i]], contribute=i < 2, num_contributors=2)
                )
            for w in works:
                w.wait(timeout=30)
            # wait() only ordered this stream after the copy back; the kernels below see results.
            results = [g.float().sum().item() for g in grads]
            extras = [e.float().sum().item() for e in extra]
        assert results == [pytest.approx(1.5 * 33_000)] * 3
        assert extras == [pytest.approx(7 * 2.0)] * 3


def test_cuda_future_for_comm_hooks() -> None:
    device = torch.device("cuda", 0)
    with ring_set(2) as (a, b):
        xs = [torch.full((4096,), v, device=device) for v in (1.0, 3.0)]
        futs = [
            r.allreduce([x], num_contributors=2).get_future()
            for r, x in zip((a, b), xs, strict=True)
        ]
        doubled = [f.then(lambda f: f.value()[0] * 2) for f in futs]
        for d in doubled:
            assert torch.equal(d.wait(), torch.full((4096,), 4.0, device=device))


def test_cuda_failure_leaves_tensors_untouched() -> None:
    device = torch.device("cuda", 0)
    with ring_set(2) as (a, _):
        x = torch.arange(100.0, device=device)
        work = a.allreduce([x], num_contributors=2)
        a.abort()
        with pytest.raises(FtarAbortedError):
            work.wait(timeout=10)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.arange(100.0, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_exchange_with_a_bf16_wire_matches_the_reference(dtype: torch.dtype) -> None:
    """The pinned staging buffer is in the ring's dtype: bf16, converted on the copy."""
    device = torch.device("cuda", 0)
    config = dataclasses.replace(FAST, wire_compression="bf16")
    gen = torch.Generator().manual_seed(5)
    cpu = [torch.randn(1001, generator=gen).to(dtype) for _ in range(3)]
    with ring_set(3, config) as rings:
        xs = [x.to(device) for x in cpu]
        works = [r.allreduce([x], num_contributors=3) for r, x in zip(rings, xs, strict=True)]
        for w in works:
            w.wait(timeout=30)
        torch.cuda.synchronize()
    chunk = FAST.chunk_bytes // 2
    want = reference_allreduce([x.bfloat16() for x in cpu], 3, chunk, torch.bfloat16).to(dtype)
    for x in xs:
        assert torch.equal(x.cpu(), want)
