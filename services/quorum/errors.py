"""The quorum service's error hierarchy, rooted in `QuorumError`.

The classes are defined in `client_types` so that the worker, which may import only a service's
client modules, catches the very same classes the server raises; this module is the server-side
name for them. `server.ERROR_TABLE` maps each to a gRPC status; `client_codec` maps back."""

from __future__ import annotations

from fthsdp.services.quorum.client_types import (
    AuthError,
    InternalError,
    InvalidRequestError,
    MembershipTooLargeError,
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


class NotLeaderError(QuorumError):
    """This instance is a standby (or just stepped down): ask another address (gRPC
    UNAVAILABLE, so clients fail over by themselves)."""


class StoreUnavailableError(QuorumError):
    """The leader cannot write a new quorum to its store (gRPC UNAVAILABLE): it must not answer
    with an epoch the store could lose (I3), so callers treat it as an unreachable service and
    go on with the quorum they have while the membership is unchanged."""


class FencedError(NotLeaderError):
    """A store write was refused because another instance took the lease since this one was
    elected: this instance must stop deciding at once."""


__all__ = [
    "AuthError",
    "FencedError",
    "InternalError",
    "InvalidRequestError",
    "MembershipTooLargeError",
    "NotLeaderError",
    "QuorumError",
    "QuorumTimeoutError",
    "QuorumUnavailableError",
    "ShuttingDownError",
    "StaleIncarnationError",
    "StoreUnavailableError",
    "SupersededRequestError",
    "UnknownReplicaError",
    "WorldSizeMismatchError",
]
