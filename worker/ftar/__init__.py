"""FTAR: the fault-tolerant ring allreduce between replicas (rank i of every replica).

Public API::

    ring = FtarRing(FtarConfig(...))          # binds the listener; publish ring.address
    ring.reconfigure(peers, my_index, epoch)  # per new quorum; keeps unchanged connections
    work = ring.allreduce(tensors, contribute=True, num_contributors=k)
    work.wait()                               # raises the latched FtarError, if any
    ring.abort()                              # from any thread: fail in-flight work now
    ring.broken                               # True: reconfigure before the next exchange
    ring.close()

See :mod:`worker.ftar.ring` for the connection scheme, :mod:`worker.ftar.engine` for the
chunked algorithm and :mod:`worker.ftar.codec` for the ring's dtype (exact float32 by default,
an opt-in half-precision wire) and its sum order; :mod:`worker.ftar.hooks` adapts it to DDP
comm hooks.
"""

from fthsdp.worker.ftar.config import FtarConfig
from fthsdp.worker.ftar.errors import (
    FatalFtarError,
    FtarAbortedError,
    FtarEpochMismatchError,
    FtarError,
    FtarLayoutMismatchError,
    FtarPeerError,
    FtarTimeoutError,
    RecoverableFtarError,
)
from fthsdp.worker.ftar.hooks import FtarHookState, ftar_comm_hook
from fthsdp.worker.ftar.ring import FtarRing, FtarStats
from fthsdp.worker.ftar.work import FtarWork

__all__ = [
    "FatalFtarError",
    "FtarAbortedError",
    "FtarConfig",
    "FtarEpochMismatchError",
    "FtarError",
    "FtarHookState",
    "FtarLayoutMismatchError",
    "FtarPeerError",
    "FtarRing",
    "FtarStats",
    "FtarTimeoutError",
    "FtarWork",
    "RecoverableFtarError",
    "ftar_comm_hook",
]
