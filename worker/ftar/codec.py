"""Which dtype an exchange's ring runs in (memory, wire and adds), and what that does to numbers.

Default (``wire_compression="none"``): the ring runs in float32. float32 inputs are reduced in
place and exactly as IEEE float32 adds in ring order; bfloat16/float16 inputs are staged into a
float32 buffer, so their sums accumulate in float32 and are rounded once at the end. What needs
no float32 still travels in the input's dtype (raw inputs at the first reduce step, rounded
results in all-gather: :func:`worker.ftar.engine.carrier`), so with 2 ranks an exact half
exchange moves as few bytes as a half-precision one.

Opt-in ``wire_compression="bf16"`` (or ``"fp16"``): the ring runs in that half dtype, so every
payload is half the bytes. Inputs already in that dtype are reduced in place (no staging at
all); other inputs are rounded to it once on entry (staged) and the result is widened back on
exit. Like gloo and NCCL on half-precision tensors, each ring hop rounds the running partial sum
to the half dtype. The contract, asserted bitwise by the tests (``reference_allreduce``): piece
``q`` of each column is summed in ring order starting at rank ``q``::

    acc = x[q];  for j in 1..n-1: acc = half(x[q + j] + acc);  result = half(acc / k)

computed once by the rank that finishes it and copied to every other rank, so all ranks still
hold bitwise-identical results (invariant I1). The error against the exact float32 average is
at most about ``n`` half-precision roundings (bf16: 2^-8 relative each, of the partial sums'
magnitude), and fp16 overflows to inf past 65504: use it only for bounded values.
"""

from __future__ import annotations

from typing import Literal

import torch

from fthsdp.worker.ftar.errors import FatalFtarError

__all__ = ["Compression", "reference_allreduce", "ring_dtype", "wire_code", "wire_dtype_of"]

Compression = Literal["none", "bf16", "fp16"]

_RING_DTYPES: dict[str, torch.dtype] = {
    "none": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def ring_dtype(compression: str) -> torch.dtype:
    """The dtype an exchange runs in under ``compression``."""
    try:
        return _RING_DTYPES[compression]
    except KeyError:
        raise FatalFtarError(f"unknown wire compression {compression!r}") from None


def wire_code(dtype: torch.dtype) -> int:
    """The 2-bit code of a ring dtype in the exchange header (neighbours must agree)."""
    return _CODES[dtype]


def wire_dtype_of(code: int) -> str:
    """A header's wire dtype code, for error messages."""
    for dtype, c in _CODES.items():
        if c == code:
            return str(dtype)
    return f"unknown code {code}"


def reference_allreduce(
    inputs: list[torch.Tensor], num_contributors: int, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """What every rank must hold after an exchange in ``dtype`` of the flat 1-D ``inputs`` (one
    per ring position, already in ``dtype``), chunked as :class:`engine.RingPlan` with ``chunk``
    elements per piece: the sum order of the module docstring, for tests."""
    from fthsdp.worker.ftar.engine import RingPlan  # the plan defines the pieces

    n = len(inputs)
    plan = RingPlan(inputs[0].numel(), n, 0, chunk)
    out = torch.empty_like(inputs[0])
    for column in range(plan.columns):
        for q in range(n):
            lo, hi = plan.piece(column, q)
            acc = inputs[q][lo:hi].clone()
            for j in range(1, n):
                acc = inputs[(q + j) % n][lo:hi] + acc
            out[lo:hi] = acc.div_(num_contributors)
    assert out.dtype == dtype
    return out
