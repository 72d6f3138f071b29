"""The FTAR error hierarchy: one root, split by what the caller must do next.

``RecoverableFtarError`` means the exchange did not complete but nothing local is wrong: a peer
closed, reset or timed out, a peer is at another epoch, or the ring was aborted. The work handle
latches it; the caller votes "no" in the commit, waits for the next quorum, calls
``FtarRing.reconfigure`` with the new epoch and retries the exchange from its intact gradients.

``FatalFtarError`` means retrying cannot help: bad arguments, a layout (dtype/shape) or topology
disagreement with a peer inside one epoch, or a local failure. It is raised at once to the caller
(synchronously from ``allreduce`` for argument errors, from ``FtarWork.wait`` otherwise) and the
process is expected to crash so that its replica restarts.
"""

from __future__ import annotations

__all__ = [
    "FatalFtarError",
    "FtarAbortedError",
    "FtarEpochMismatchError",
    "FtarError",
    "FtarLayoutMismatchError",
    "FtarPeerError",
    "FtarTimeoutError",
    "RecoverableFtarError",
]


class FtarError(Exception):
    """Root of every error raised by the FTAR data plane."""


class RecoverableFtarError(FtarError):
    """The exchange failed for a reason outside this process; reconfigure and retry."""


class FtarAbortedError(RecoverableFtarError):
    """``FtarRing.abort`` (or ``close``/a superseding ``reconfigure``) cancelled the work."""


class FtarTimeoutError(RecoverableFtarError, TimeoutError):
    """A bounded wait (chunk, exchange, connect, or ``FtarWork.wait``) ran out."""


class FtarPeerError(RecoverableFtarError):
    """A neighbour closed or reset its connection, or broke the wire protocol."""


class FtarEpochMismatchError(RecoverableFtarError):
    """A neighbour is at another epoch (one of the two is stale)."""


class FatalFtarError(FtarError):
    """Bad arguments, a disagreement inside one epoch, or a local failure: crash, do not retry."""


class FtarLayoutMismatchError(FatalFtarError):
    """A neighbour in the same epoch exchanges tensors of other dtypes/shapes/sizes."""
