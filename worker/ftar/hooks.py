"""A DDP communication hook that averages gradient buckets across replicas through FTAR.

Usage::

    state = FtarHookState(ring=ring)
    ddp.register_comm_hook(state, ftar_comm_hook)
    for step in ...:
        state.begin_step(contribute=healthy, num_contributors=len(healthy_replicas))
        loss.backward()                      # buckets go through FTAR while backward runs
        if state.vote():                     # every bucket exchanged: commit
            optimizer.step()

The hook exchanges a *copy* of each bucket (kept per bucket index and reused), so a failed
exchange leaves DDP's gradients intact. A recoverable failure is latched in the state and the
bucket is returned unchanged; the caller votes "no", reconfigures and retries. A fatal failure
is latched too and raised into DDP (backward fails; the rank is meant to crash).
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at runtime
# and accepts only the real ``dist.GradBucket`` / ``Future[Tensor]`` objects.
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fthsdp.worker.ftar.errors import FatalFtarError, FtarError, RecoverableFtarError
from fthsdp.worker.ftar.ring import FtarRing

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

__all__ = ["FtarHookState", "ftar_comm_hook"]


@dataclass(kw_only=True, slots=True)
class FtarHookState:
    """Mutable per-step state shared by the training loop and the comm hook."""

    ring: FtarRing
    """The rank's FTAR ring (reconfigured by the caller when the quorum changes)."""

    contribute: bool = True
    """False on a recovering replica: its buckets count as zeros and are never read."""

    num_contributors: int = 1
    """Number of replicas contributing this step (the divisor of the average)."""

    error: FtarError | None = None
    """First error latched since ``begin_step`` (None means every bucket went through)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _copies: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def begin_step(self, *, contribute: bool, num_contributors: int) -> None:
        """Clear the latched error and set this step's contribution."""
        with self._lock:
            self.error = None
        self.contribute = contribute
        self.num_contributors = num_contributors

    def vote(self) -> bool:
        """The commit vote: True iff no exchange failed since ``begin_step``."""
        with self._lock:
            return self.error is None

    def latch(self, error: FtarError) -> None:
        """Record ``error`` (the first one wins; a fatal one always overrides)."""
        with self._lock:
            if self.error is None or isinstance(error, FatalFtarError):
                self.error = error

    def copy_of(self, index: int, buf: torch.Tensor) -> torch.Tensor:
        """The reusable exchange copy for bucket ``index`` (reallocated if the bucket changed)."""
        copy = self._copies.get(index)
        if (
            copy is None
            or copy.shape != buf.shape
            or copy.dtype != buf.dtype
            or copy.device != buf.device
        ):
            copy = self._copies[index] = torch.empty_like(buf)
        return copy


def ftar_comm_hook(state: FtarHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` across the ring; unchanged bucket on recoverable error."""
    buf = bucket.buffer()
    copy = state.copy_of(bucket.index(), buf)
    if state.contribute:
        copy.copy_(buf)
    try:
        work = state.ring.allreduce(
            [copy], contribute=state.contribute, num_contributors=state.num_contributors
        )
    except FatalFtarError as exc:
        state.latch(exc)
        raise

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            fut.value()
        except RecoverableFtarError as exc:
            state.latch(exc)
            return buf
        except FtarError as exc:
            state.latch(exc)
            raise
        return copy

    return work.get_future().then(finish)
