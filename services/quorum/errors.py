"""The quorum service's error hierarchy, rooted in `QuorumError`.

The classes are defined in `client_types` so that the worker, which may import only a service's
client modules, catches the very same classes the server raises; this module is the server-side
name for them. `server.ERROR_TABLE` maps each to a gRPC status; `client_codec` maps back."""

from __future__ import annotations

from services.quorum.client_types import (
    AuthError,
    InternalError,
    InvalidRequestError,
    QuorumError,
    QuorumTimeoutError,
    QuorumUnavailableError,
    StaleIncarnationError,
    SupersededRequestError,
    UnknownReplicaError,
    WorldSizeMismatchError,
)


class ShuttingDownError(QuorumError):
    """The service is draining; the caller should retry (against a standby) (gRPC UNAVAILABLE)."""


__all__ = [
    "AuthError",
    "InternalError",
    "InvalidRequestError",
    "QuorumError",
    "QuorumTimeoutError",
    "QuorumUnavailableError",
    "ShuttingDownError",
    "StaleIncarnationError",
    "SupersededRequestError",
    "UnknownReplicaError",
    "WorldSizeMismatchError",
]
