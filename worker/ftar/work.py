"""The handle of one queued exchange."""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from fthsdp.worker.ftar.errors import FtarError, FtarTimeoutError

__all__ = ["FtarWork"]


class FtarWork:
    """One enqueued ``FtarRing.allreduce``; completed by the ring's comm thread.

    Thread-safe: any thread may ``wait``, poll ``done``/``exception`` or ``get_future``. A
    recoverable failure is *latched* here (returned by ``exception``, raised by ``wait``) so the
    caller can turn it into its commit vote instead of unwinding user code.
    """

    __slots__ = (
        "_device",
        "_done",
        "_done_event",
        "_error",
        "_future",
        "_lock",
        "_side",
        "_tensors",
    )

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self._tensors = tensors
        self._device = device
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: FtarError | None = None
        self._done_event: torch.cuda.Event | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._side: torch.cuda.Stream | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The caller's tensors, which receive the averaged result in place."""
        return self._tensors

    def done(self) -> bool:
        """True once the exchange finished, successfully or not (never blocks)."""
        return self._done.is_set()

    def exception(self) -> FtarError | None:
        """The latched error, or None if the work succeeded or is still running."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until done (at most ``timeout`` seconds) and raise the latched error, if any.

        On CUDA tensors this only makes the caller's *current stream* wait for the copy back;
        it never blocks the CPU on the GPU. A ``FtarTimeoutError`` here means the work is still
        in flight: call ``FtarRing.abort()`` before touching its tensors.
        """
        if not self._done.wait(timeout):
            raise FtarTimeoutError(f"FtarWork.wait timed out after {timeout}s; still in flight")
        if self._error is not None:
            raise self._error
        if self._done_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done_event)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A torch Future completed with the result tensors or the latched error (for hooks).

        For CUDA tensors it is a device-aware future: its consumers' streams are ordered after
        the copy back, as with NCCL work futures.
        """
        with self._lock:
            if self._future is None:
                devices: list[int | str | torch.device] = (
                    [self._device] if self._device.type == "cuda" else []
                )
                self._future = torch.futures.Future(devices=devices)
                if self._done.is_set():
                    self._complete_future(in_comm_thread=False)
            return self._future

    def _complete_future(self, *, in_comm_thread: bool) -> None:
        fut = self._future
        assert fut is not None
        if self._error is not None:
            cast(Any, fut).set_exception(self._error)
        elif self._done_event is None:
            fut.set_result(self._tensors)
        elif in_comm_thread and self._side is not None:
            # A device-aware future records an event on the current stream at set_result: make
            # that the side stream, right after the copy back.
            with torch.cuda.device(self._device), torch.cuda.stream(self._side):
                fut.set_result(self._tensors)
        else:
            with torch.cuda.device(self._device):
                torch.cuda.current_stream().wait_event(self._done_event)
                fut.set_result(self._tensors)

    def _finish(
        self,
        error: FtarError | None,
        done_event: torch.cuda.Event | None = None,
        side: torch.cuda.Stream | None = None,
    ) -> None:
        """Called exactly once by the comm thread (or by allreduce for an already-failed work)."""
        with self._lock:
            self._error = error
            self._done_event = done_event
            self._side = side
            self._done.set()
            if self._future is not None:
                self._complete_future(in_comm_thread=True)
