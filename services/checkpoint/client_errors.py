"""The one error root of the checkpoint service, shared by the sidecar and its clients.

Each error carries a stable `code`; the sidecar's single error table (`app.ERROR_STATUS`) maps the
class to an HTTP status and sends `{"error": code, "detail": message}`, and the client maps the code
back to the same class, so callers on both sides see the same typed errors and never HTTP types."""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error the checkpoint service or its clients raise on purpose."""

    code = "internal"


class InvalidArgumentError(CheckpointError):
    """A request or a value that can never succeed as given (bad name, dtype, layout, range...)."""

    code = "invalid_argument"


class UnauthorizedError(CheckpointError):
    """The bearer token is missing or wrong."""

    code = "unauthorized"


class NotFoundError(CheckpointError):
    """The snapshot, checkpoint or record does not exist (yet)."""

    code = "not_found"


class GoneError(NotFoundError):
    """The step existed but was garbage-collected by retention."""

    code = "gone"


class ConflictError(CheckpointError):
    """The step is already published: a snapshot is immutable."""

    code = "conflict"


class RangeNotSatisfiableError(CheckpointError):
    """A byte range outside the object, or larger than one request may carry."""

    code = "range_not_satisfiable"


class PayloadTooLargeError(CheckpointError):
    """A request body over the configured bound, refused before it is read."""

    code = "too_large"


class NotReadyError(CheckpointError):
    """The sidecar cannot answer yet (checksums still being computed, or it is draining); retry."""

    code = "not_ready"


class CorruptionError(CheckpointError):
    """Bytes that do not match their checksums: silent data corruption or a broken file."""

    code = "data_corrupted"


class SourcesDisagreeError(CorruptionError):
    """Replicas that must be bitwise identical published different layouts or checksums."""

    code = "sources_disagree"


class SourceUnavailableError(CheckpointError):
    """No source could deliver (all dead, refused, or truncated their responses)."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[CheckpointError]] = {
    cls.code: cls
    for cls in (
        CheckpointError,
        InvalidArgumentError,
        UnauthorizedError,
        NotFoundError,
        GoneError,
        ConflictError,
        RangeNotSatisfiableError,
        PayloadTooLargeError,
        NotReadyError,
        CorruptionError,
        SourcesDisagreeError,
        SourceUnavailableError,
    )
}
