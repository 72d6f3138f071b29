"""The one error root of the checkpoint service, shared by the sidecar and its clients.

Each error names its stable `code` and its statuses (`services.common.errors`): the sidecar
answers with them, `{"error": code, "detail": message}`, and the client maps the code back to the
same class (`ERROR_WIRE`), so callers on both sides see the same typed errors, never HTTP types."""

from __future__ import annotations

import grpc

from fthsdp.services.common import errors as common_errors


class CheckpointError(common_errors.ServiceError):
    """Root of every error the checkpoint service or its clients raise on purpose."""


class InvalidArgumentError(CheckpointError):
    """A request or a value that can never succeed as given (bad name, dtype, layout, range...)."""

    code = "invalid_argument"
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class AuthError(CheckpointError, common_errors.AuthError):
    """The bearer token is missing or wrong."""


class NotFoundError(CheckpointError):
    """The snapshot, checkpoint or record does not exist (yet)."""

    code = "not_found"
    grpc_status = grpc.StatusCode.NOT_FOUND
    http_status = 404


class GoneError(NotFoundError):
    """The step existed but was garbage-collected by retention."""

    code = "gone"
    grpc_status = grpc.StatusCode.NOT_FOUND
    http_status = 410


class ConflictError(CheckpointError):
    """The step is already published: a snapshot is immutable."""

    code = "conflict"
    grpc_status = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class RangeNotSatisfiableError(CheckpointError):
    """A byte range outside the object, or larger than one request may carry."""

    code = "range_not_satisfiable"
    grpc_status = grpc.StatusCode.OUT_OF_RANGE
    http_status = 416


class PayloadTooLargeError(CheckpointError):
    """A request body over the configured bound, refused before it is read."""

    code = "too_large"
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class NotReadyError(CheckpointError):
    """The sidecar cannot answer yet (checksums still being computed, or it is draining); retry."""

    code = "not_ready"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class CorruptionError(CheckpointError):
    """Bytes that do not match their checksums: silent data corruption or a broken file."""

    code = "data_corrupted"
    grpc_status = grpc.StatusCode.DATA_LOSS
    http_status = 500


class SourcesDisagreeError(CorruptionError):
    """Replicas that must be bitwise identical published different layouts or checksums."""

    code = "sources_disagree"
    grpc_status = grpc.StatusCode.DATA_LOSS
    http_status = 500


class SourceUnavailableError(CheckpointError):
    """No source could deliver (all dead, refused, or truncated their responses)."""

    code = "unavailable"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 502


ERROR_WIRE = common_errors.ErrorWire(
    (
        CheckpointError,
        InvalidArgumentError,
        AuthError,
        NotFoundError,
        GoneError,
        ConflictError,
        RangeNotSatisfiableError,
        PayloadTooLargeError,
        NotReadyError,
        CorruptionError,
        SourcesDisagreeError,
        SourceUnavailableError,
    ),
    # FastAPI's own request validation, and a proxy's answers.
    http_transport={422: InvalidArgumentError},
    fallback=CheckpointError,
)
"""How a client maps an error response back to its class."""
