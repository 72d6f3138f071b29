"""Where an exchange's flat float32 vector lives, per kind of input.

* float32 CPU tensors: the caller's tensors themselves (sent from and received into in place).
* bfloat16/float16 CPU tensors: one float32 host buffer owned by the comm thread, so sums
  accumulate in float32 and are rounded once at the end.
* CUDA tensors: a pinned float32 host buffer per queued work and a side stream per device. At
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

    def end(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        """Copy the result out (after success); returns the CUDA completion event and stream."""
        return None, None

    def release(self) -> None:
        """Give staging memory back (always called once, success or not)."""


class DirectStage(Stage):
    """float32 CPU: the ring works in the caller's tensors."""

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        segments = [_flat(t) for t in self.tensors]
        if not contribute:
            for s in segments:
                s.zero_()
        return FlatBuffer(segments)


class HostBuffer:
    """A float32 CPU buffer that grows to the largest exchange and is then reused."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]


class HostStage(Stage):
    """Half-precision CPU tensors, reduced in a float32 staging buffer."""

    def __init__(self, tensors: list[torch.Tensor], host: HostBuffer) -> None:
        super().__init__(tensors)
        self._host = host
        self._buf: torch.Tensor | None = None

    def begin(
        self, *, contribute: bool, deadline: float, cancelled: Callable[[], bool]
    ) -> FlatBuffer:
        buf = self._buf = self._host.get(self.numel)
        if not contribute:
            buf.zero_()
        else:
            for t, a, b in zip(self.tensors, self.offsets, self.offsets[1:], strict=False):
                buf[a:b].copy_(_flat(t))
        return FlatBuffer([buf])

    def end(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        assert self._buf is not None
        for t, a, b in zip(self.tensors, self.offsets, self.offsets[1:], strict=False):
            _flat(t).copy_(self._buf[a:b])
        return None, None


class CudaPools:
    """Per-device side streams and pinned float32 host buffers, shared by a ring's works."""

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

    def acquire(self, device: torch.device, numel: int) -> torch.Tensor:
        index = device.index or 0
        with self._lock:
            free = self._free.setdefault(index, [])
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                free.remove(best)
                return best
        return torch.empty(max(numel, 1), dtype=torch.float32, pin_memory=True)

    def release(self, device: torch.device, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(device.index or 0, []).append(buf)


class CudaStage(Stage):
    """CUDA tensors via a pinned host buffer, ordered with events on a side stream."""

    def __init__(self, tensors: list[torch.Tensor], pools: CudaPools, *, contribute: bool) -> None:
        super().__init__(tensors)
        self.device = tensors[0].device
        self._pools = pools
        self._side = pools.stream(self.device)
        self._pinned = pools.acquire(self.device, self.numel)
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
        self._pools.release(self.device, self._pinned)
