"""Where an exchange's flat vector lives, per kind of input. The vector is in the ring's dtype
(float32, or the half dtype of an opt-in wire compression: :mod:`worker.ftar.codec`).

* CPU tensors already in the ring's dtype: the caller's tensors themselves (sent from and
  received into in place).
* other CPU tensors (bfloat16/float16 in a float32 ring, or anything in a compressed one): one
  host buffer in the ring's dtype owned by the comm thread (so half inputs of a float32 ring
  accumulate in float32 and are rounded once at the end).
* CUDA tensors: a pinned host buffer per queued work and a side stream per device. At
  enqueue the side stream waits on an event recorded on the caller's current stream and copies
  device -> host; the comm thread polls that copy's event (never blocking the GPU or the caller);
  after the ring it queues the host -> device copy on the side stream and the work completes with
  its event, which ``FtarWork.wait`` makes the caller's current stream wait on.

Pinned buffers return to the pool as soon as the copy back is *queued*: every later use of the
buffer is ordered after it, on the GPU by the side stream and on the CPU by the comm thread waiting
for the staging event of the next work (recorded on the same side stream).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from fthsdp.worker.ftar.engine import FlatBuffer
from fthsdp.worker.ftar.errors import FtarAbortedError, FtarTimeoutError

__all__ = ["CudaPools", "CudaStage", "DirectStage", "HostBuffer", "HostStage", "Stage"]

_CUDA: Any = torch.cuda  # torch.cuda's Event/Stream constructors are untyped


def _event() -> torch.cuda.Event:
    return cast(torch.cuda.Event, _CUDA.Event())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    out = [0]
    for t in tensors:
        out.append(out[-1] + t.numel())
    return out


class Stage:
    """Base: ``begin`` yields the flat buffer to run the ring on, ``end`` publishes the result."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.offsets = _offsets(tensors)
        self.numel = self.offsets[-1]

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        raise NotImplementedError

    def gather_into(self) -> FlatBuffer | None:
        """Where a multi-rank ring's all-gather should land results directly (``end`` then
        copies nothing), or None: into the flat buffer of ``begin``. Called after ``begin``."""
        return None

    def end(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        """Copy the result out (after success); returns the CUDA completion event and stream."""
        return None, None

    def release(self) -> None:
        """Give staging memory back (always called once, success or not)."""


class DirectStage(Stage):
    """CPU tensors in the ring's dtype: the ring works in the caller's tensors."""

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        segments = [_flat(t) for t in self.tensors]
        if not contribute:
            for s in segments:
                s.zero_()
        return FlatBuffer(segments)


class HostBuffer:
    """A CPU byte buffer that grows to the largest exchange and is then reused (comm thread)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype)


class HostStage(Stage):
    """CPU tensors not in the ring's dtype, reduced in a staging buffer of that dtype."""

    def __init__(self, tensors: list[torch.Tensor], host: HostBuffer, dtype: torch.dtype) -> None:
        super().__init__(tensors)
        self._host = host
        self._dtype = dtype
        self._buf: torch.Tensor | None = None
        dtypes = {t.dtype for t in tensors}
        # One input dtype narrower than the ring's: it can travel as is (see gather_into).
        self._narrow = len(dtypes) == 1 and next(iter(dtypes)).itemsize < dtype.itemsize
        self._gathered = False

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        buf = self._buf = self._host.get(self.numel, self._dtype)
        if not contribute:
            buf.zero_()
            if self._narrow:  # its raw input may travel narrow from here: zeros too
                for t in self.tensors:
                    t.detach().zero_()
        else:
            for t, a, b in zip(self.tensors, self.offsets, self.offsets[1:], strict=False):
                buf[a:b].copy_(_flat(t))
        return FlatBuffer([buf])

    def gather_into(self) -> FlatBuffer | None:
        """The caller's tensors when they share one dtype narrower than the ring's: RS step 0
        sends raw inputs from them, and each rank rounds the pieces it finished into them for
        all-gather (the numbers are the same as rounding everything at the end, at half those
        bytes). Those tensors are then written before the exchange completes (a
        non-contributor's zeroed), as in-place ones are."""
        if not self._narrow:
            return None
        self._gathered = True
        return FlatBuffer([_flat(t) for t in self.tensors])

    def end(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        assert self._buf is not None
        if self._gathered:
            return None, None
        for t, a, b in zip(self.tensors, self.offsets, self.offsets[1:], strict=False):
            _flat(t).copy_(self._buf[a:b])
        return None, None


class CudaPools:
    """Per-device side streams and pinned host byte buffers, shared by a ring's works."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._free: dict[int, list[torch.Tensor]] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                self._streams[index] = cast(torch.cuda.Stream, _CUDA.Stream(device=index))
            return self._streams[index]

    def acquire(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes`` (view it as the ring's dtype)."""
        index = device.index or 0
        with self._lock:
            free = self._free.setdefault(index, [])
            fits = [b for b in free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                free.remove(best)
                return best
        return torch.empty(max(nbytes, 4), dtype=torch.uint8, pin_memory=True)

    def release(self, device: torch.device, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(device.index or 0, []).append(buf)


class CudaStage(Stage):
    """CUDA tensors via a pinned host buffer, ordered with events on a side stream."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        pools: CudaPools,
        *,
        contribute: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(tensors)
        self.device = tensors[0].device
        self._pools = pools
        self._side = pools.stream(self.device)
        self._raw = pools.acquire(self.device, self.numel * dtype.itemsize)
        self._pinned = self._raw[: self.numel * dtype.itemsize].view(dtype)
        ready = _event()
        ready.record(torch.cuda.current_stream(self.device))
        self._staged = _event()
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            self._side.wait_event(ready)
            if contribute:  # a non-contributor's input must not be read at all
                for t, a, b in zip(tensors, self.offsets, self.offsets[1:], strict=False):
                    self._pinned[a:b].copy_(_flat(t), non_blocking=True)
                    t.record_stream(self._side)
            self._staged.record(self._side)

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        delay = 20e-6
        while not cast(Any, self._staged).query():
            if cancelled():
                raise FtarAbortedError("aborted while waiting for the device-to-host copy")
            if time.monotonic() > deadline:
                raise FtarTimeoutError("device-to-host staging copy did not finish in time")
            time.sleep(delay)  # polling a CUDA event; the GPU and the caller never block
            delay = min(delay * 2, 1e-3)
        flat = self._pinned[: self.numel]
        if not contribute:
            flat.zero_()
        return FlatBuffer([flat])

    def end(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        done = _event()
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            for t, a, b in zip(self.tensors, self.offsets, self.offsets[1:], strict=False):
                _flat(t).copy_(self._pinned[a:b], non_blocking=True)
                t.record_stream(self._side)
            done.record(self._side)
        return done, self._side

    def release(self) -> None:
        self._pools.release(self.device, self._raw)
