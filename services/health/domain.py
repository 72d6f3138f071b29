"""Errors and wire bounds of the health service, shared by its clients and its servers.

One error root (`HealthError`): clients raise these typed errors and never gRPC or HTTP types.
Each class names its code and statuses (`services.common.errors`); the servers answer with them
and the clients map back through `ERROR_WIRE`."""

from __future__ import annotations

import grpc

from fthsdp.services.common import errors as common_errors
from fthsdp.services.common.parse import MAX_STEP

MAX_ID_CHARS = 128
"""replica_id and digests: the quorum service's limit, so an id the health service accepts can
always be reported to it."""
MAX_NAME_CHARS = 256
"""host, source, group names."""
MAX_OP_CHARS = 64
MAX_PROCESS_CHARS = 64
"""A heartbeat's process identifier."""
MAX_TEXT_CHARS = 1024
"""summaries and reasons."""
MAX_EVIDENCE_BYTES = 16384
MAX_RANK = 1 << 20
MAX_BATCH_RECORDS = 10000
"""Records of all kinds in one Report."""
MAX_NODE_RANKS = 4096
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""gRPC receive limit: 10000 records of a few hundred bytes fit with room to spare."""
MAX_CLOCK_VALUE = 1e11
"""Times are Unix seconds; anything beyond year 5138 is a unit mistake."""
MAX_LINK_BUSY_S = 3600.0
"""An exchange's link time: far past any exchange timeout."""


class HealthError(common_errors.ServiceError):
    """Root of every error the health service or its clients raise."""


class InvalidReportError(HealthError, ValueError):
    """A request is malformed or out of bounds (gRPC INVALID_ARGUMENT, HTTP 400)."""

    code = "invalid_argument"
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class AuthError(HealthError, common_errors.AuthError):
    """No valid bearer token (gRPC UNAUTHENTICATED, HTTP 401)."""


class HealthUnavailableError(HealthError, ConnectionError):
    """The service is unreachable, draining or overloaded (gRPC UNAVAILABLE, HTTP 503)."""

    code = "unavailable"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class HealthTimeoutError(HealthError, TimeoutError):
    """A call's deadline passed."""

    code = "timeout"
    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class NotFoundError(HealthError):
    """The resource does not exist (HTTP 404)."""

    code = "not_found"
    grpc_status = grpc.StatusCode.NOT_FOUND
    http_status = 404


class UpstreamError(HealthError):
    """A service the health service reads from (the quorum service) failed (HTTP 502)."""

    code = "upstream_unavailable"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 502


ERROR_WIRE = common_errors.ErrorWire(
    (
        HealthError,
        InvalidReportError,
        AuthError,
        HealthUnavailableError,
        HealthTimeoutError,
        NotFoundError,
        UpstreamError,
    ),
    fallback=HealthError,
)
"""How a client maps a failed call back to its class."""


def check_id(value: str, what: str = "replica_id") -> str:
    """A replica id or digest: 1..128 printable characters without whitespace."""
    if not value:
        raise InvalidReportError(f"{what} must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidReportError(f"{what} must have at most {MAX_ID_CHARS} characters")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise InvalidReportError(f"{what} must be printable and contain no whitespace")
    return value


def check_text(value: str, what: str, limit: int = MAX_NAME_CHARS) -> str:
    """Free text of at most `limit` printable characters (empty allowed)."""
    if len(value) > limit:
        raise InvalidReportError(f"{what} must have at most {limit} characters")
    if not value.isprintable():
        raise InvalidReportError(f"{what} must be printable")
    return value


def check_rank(rank: int) -> int:
    """A rank inside a replica."""
    if not 0 <= rank < MAX_RANK:
        raise InvalidReportError(f"rank must be in 0..{MAX_RANK - 1}, got {rank}")
    return rank


def check_step(step: int, what: str = "step", *, minimum: int = 0) -> int:
    """A step (or sequence number); heartbeats may say -1 (nothing committed yet)."""
    if not minimum <= step <= MAX_STEP:
        raise InvalidReportError(f"{what} must be in {minimum}..{MAX_STEP}, got {step}")
    return step


def check_time(value: float, what: str) -> float:
    """A Unix time in seconds: finite and plausible."""
    if not 0.0 <= value <= MAX_CLOCK_VALUE:  # also false for NaN
        raise InvalidReportError(f"{what} must be a Unix time in seconds, got {value!r}")
    return value


def check_duration(value: float, what: str) -> float:
    """A non-negative, finite number of seconds."""
    if not 0.0 <= value <= MAX_CLOCK_VALUE:
        raise InvalidReportError(f"{what} must be a non-negative number of seconds")
    return value


def check_count(value: int, what: str) -> int:
    """A non-negative 63-bit count."""
    if not 0 <= value < 1 << 63:
        raise InvalidReportError(f"{what} must be a non-negative count")
    return value
