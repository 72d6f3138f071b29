"""The quorum service's error hierarchy, rooted in `QuorumError`.

The classes are defined in `domain` so that the worker, which may import only a service's
client modules and its domain, catches the very same classes the server raises; this module is the
server-side name for them. Each class names its code and statuses (`services.common.errors`); the
server-only ones below arrive at clients as what their status says: unavailable, ask another
instance."""

from __future__ import annotations

import grpc

from fthsdp.services.quorum.domain import (
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

    code = "shutting_down"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class NotLeaderError(QuorumError):
    """This instance is a standby (or just stepped down): ask another address (gRPC
    UNAVAILABLE, so clients fail over by themselves)."""

    code = "not_leader"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class StoreUnavailableError(QuorumError):
    """The leader cannot write a new quorum to its store (gRPC UNAVAILABLE): it must not answer
    with an epoch the store could lose (I3), so callers treat it as an unreachable service and
    go on with the quorum they have while the membership is unchanged."""

    code = "store_unavailable"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


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
