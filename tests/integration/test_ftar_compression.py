"""FTAR's ring dtype: the exact float32 ring's sum order and the opt-in half-precision wire.

Results are checked bitwise against :func:`worker.ftar.codec.reference_allreduce` (the documented
sum order), with odd sizes and tiny chunks so that pieces of odd byte length straddle tensor
boundaries and land in odd-sized tails, received straight into the destination memory.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from fthsdp.worker.ftar import FatalFtarError, FtarConfig, FtarError, FtarRing
from fthsdp.worker.ftar.codec import reference_allreduce, ring_dtype
from tests.integration.test_ftar_support import exchange, reconfigure_all, ring_set

SHAPES = [(7,), (3, 5), (1,), (0,), (33,)]  # 56 elements: pieces of 1..3 elements, odd bytes
TIMEOUTS = {
    "chunk_timeout": timedelta(seconds=5),
    "exchange_timeout": timedelta(seconds=10),
    "connect_timeout": timedelta(seconds=5),
}


def _config(compression: str, chunk_bytes: int = 12) -> FtarConfig:
    return FtarConfig(
        chunk_bytes=chunk_bytes,
        chunks_in_flight=2,
        wire_compression=compression,  # type: ignore[arg-type]
        **TIMEOUTS,  # type: ignore[arg-type]
    )


def _inputs(n: int, dtype: torch.dtype, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=gen) * 3).to(dtype) for s in SHAPES] for _ in range(n)]


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _run(
    n: int, compression: str, dtype: torch.dtype, contribute: list[bool], chunk_bytes: int = 12
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    originals = _inputs(n, dtype, seed=n * 10 + len(compression))
    ins = [[t.clone() for t in x] for x in originals]
    with ring_set(n, _config(compression, chunk_bytes)) as rings:
        for w in exchange(rings, ins, contribute=contribute):
            w.wait(0)
    return originals, ins


def _expected(
    originals: list[list[torch.Tensor]],
    contribute: list[bool],
    compression: str,
    chunk_bytes: int = 12,
) -> torch.Tensor:
    ring = ring_dtype(compression)
    flats = [
        _flat(x, ring) if c else torch.zeros(sum(t.numel() for t in x), dtype=ring)
        for x, c in zip(originals, contribute, strict=True)
    ]
    return reference_allreduce(flats, sum(contribute), chunk_bytes // ring.itemsize, ring)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    ("compression", "dtype"),
    [
        ("none", torch.float32),  # in place, exact float32 adds in ring order
        ("none", torch.bfloat16),  # staged in float32, one rounding at the end
        ("bf16", torch.bfloat16),  # in place in bf16: no staging at all
        ("bf16", torch.float32),  # staged: rounded to bf16 on entry, widened on exit
        ("fp16", torch.float16),
        ("fp16", torch.bfloat16),
    ],
)
def test_result_is_the_documented_sum_order_bitwise(
    n: int, compression: str, dtype: torch.dtype
) -> None:
    contribute = [True] * n
    contribute[-1] = n == 2  # a non-contributor counts as zeros (and with 2 ranks: both count)
    originals, results = _run(n, compression, dtype, contribute)
    want = _expected(originals, contribute, compression).to(dtype)
    for member in results:
        assert [t.dtype for t in member] == [dtype] * len(SHAPES)
        assert [tuple(t.shape) for t in member] == SHAPES
        assert torch.equal(_flat(member, dtype), want)  # so every member holds the same bytes


def test_bf16_wire_stays_close_to_the_exact_mean() -> None:
    """The compressed ring's error bound: a few bf16 roundings of the partial sums."""
    n = 4
    originals, results = _run(n, "bf16", torch.float32, [True] * n)
    exact = sum(_flat(x, torch.float64) for x in originals) / n
    scale = sum(_flat(x, torch.float64).abs() for x in originals) / n
    got = _flat(results[0], torch.float64)
    assert bool(((got - exact).abs() <= (n + 1) * 2.0**-8 * scale + 1e-30).all())
    assert not torch.equal(got, exact)  # it is lossy: the flag is not a no-op


@pytest.mark.parametrize(
    ("n", "compression", "dtype", "share"),
    [
        (2, "bf16", torch.float32, 0.5),  # every step carries bf16
        # exact: raw inputs (RS step 0) and results (AG) travel as bf16, partial sums as float32;
        # with 2 ranks there are no partial sums, with 3 one step of 4 carries them
        (2, "none", torch.bfloat16, 0.5),
        (3, "none", torch.bfloat16, 0.625),
    ],
)
def test_bytes_moved_shrink_with_the_narrower_dtype(
    n: int, compression: str, dtype: torch.dtype, share: float
) -> None:
    sizes = {}
    for comp, kind in (("none", torch.float32), (compression, dtype)):
        with ring_set(n, _config(comp, chunk_bytes=4096)) as rings:
            ins = [[torch.randn(10_000).to(kind)] for _ in rings]
            for w in exchange(rings, ins):
                w.wait(0)
            sizes[comp, kind] = rings[0].stats().bytes_sent
    # payload shrinks; the per-chunk tags (22 bytes each) do not
    ratio = sizes[compression, dtype] / sizes["none", torch.float32]
    assert share <= ratio < share + 0.02


def test_mixed_dtypes_accumulate_in_float32_and_round_once() -> None:
    n, k = 3, 3
    gen = torch.Generator().manual_seed(11)
    xs = [
        [torch.randn(9, generator=gen), torch.randn(14, generator=gen).bfloat16()] for _ in range(n)
    ]
    ins = [[t.clone() for t in x] for x in xs]
    with ring_set(n, _config("none")) as rings:
        for w in exchange(rings, ins):
            w.wait(0)
    want = reference_allreduce([_flat(x, torch.float32) for x in xs], k, 3, torch.float32)
    for member in ins:
        assert torch.equal(member[0], want[:9])
        assert torch.equal(member[1], want[9:].bfloat16())


def test_neighbours_disagreeing_on_compression_is_fatal() -> None:
    rings = [FtarRing(_config("none")), FtarRing(_config("bf16"))]
    try:
        reconfigure_all(rings, epoch=1)
        works = exchange(rings, [[torch.ones(10)], [torch.ones(10)]])
        errors = [w.exception() for w in works]
        # Whoever reads the other's header first raises the fatal error and drops its links.
        assert any(isinstance(e, FatalFtarError) for e in errors), errors
        assert all(isinstance(e, FtarError) for e in errors)
        assert any("wire_compression" in str(e) for e in errors), errors
    finally:
        for r in rings:
            r.close()


def test_config_rejects_an_unknown_compression() -> None:
    with pytest.raises(ValueError, match="wire_compression"):
        FtarConfig(wire_compression="int8")  # type: ignore[arg-type]
