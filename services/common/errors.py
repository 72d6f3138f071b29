"""One error convention for every fthsdp wire, gRPC and HTTP.

Each service has one error root (`QuorumError`, `HealthError`, `CheckpointError`) under
`ServiceError`. An error class names its stable wire `code` and the gRPC and HTTP statuses it
travels as, so a server answers with what the error it raised says, and a client's `ErrorWire`
maps the code (or, without one, the status) back to the same class: both directions come from
the classes, and no table repeats them. A failed gRPC call carries the code in trailing metadata
under `ERROR_CODE_KEY`; an HTTP error body is `{"error": code, "detail": message}`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import grpc

ERROR_CODE_KEY = "fthsdp-error"
"""gRPC trailing metadata key naming the error behind a failed call."""


class ServiceError(Exception):
    """Root of every error an fthsdp service or client raises on purpose."""

    code: ClassVar[str] = "internal"
    """Stable wire name; unique among the classes of one service's `ErrorWire`."""
    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500


class AuthError(ServiceError):
    """No valid bearer token. Each service's own `AuthError` is also one of these, so a caller of
    several services may catch them all with this class."""

    code = "unauthorized"
    grpc_status = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


def grpc_failure(exc: BaseException, service: str) -> tuple[grpc.StatusCode, str, str]:
    """(status, code, message) a gRPC server answers for `exc`. Anything but a ServiceError is
    INTERNAL with a generic message: its traceback stays in `service`'s log, off the wire."""
    if isinstance(exc, ServiceError):
        return exc.grpc_status, exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal", f"internal error (see the {service} log)"


def code_in(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The error code in a failed call's trailing metadata, if any."""
    for key, value in metadata or ():
        if key == ERROR_CODE_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None


class ErrorWire:
    """A client's way back from a wire error to the class the server raised.

    `classes` are every error the service sends: a code maps to its class; a status without a
    known code (a proxy's answer, an older server) maps to the first listed class with that
    status, then to `transport` (statuses no handler raises: a deadline the client set, a server
    that stopped mid-call), else to `fallback`."""

    def __init__(
        self,
        classes: Sequence[type[ServiceError]],
        *,
        fallback: type[ServiceError],
        grpc_transport: Mapping[grpc.StatusCode, type[ServiceError]] | None = None,
        http_transport: Mapping[int, type[ServiceError]] | None = None,
    ) -> None:
        self.classes = tuple(classes)
        self._fallback = fallback
        self._by_code: dict[str, type[ServiceError]] = {}
        self._by_grpc: dict[grpc.StatusCode, type[ServiceError]] = {}
        self._by_http: dict[int, type[ServiceError]] = {}
        for cls in classes:
            if self._by_code.setdefault(cls.code, cls) is not cls:
                raise ValueError(f"error code {cls.code!r} is used twice")
            self._by_grpc.setdefault(cls.grpc_status, cls)
            self._by_http.setdefault(cls.http_status, cls)
        for status, cls in (grpc_transport or {}).items():
            self._by_grpc.setdefault(status, cls)
        for code, cls in (http_transport or {}).items():
            self._by_http.setdefault(code, cls)

    def from_grpc(self, status: grpc.StatusCode, details: str, code: str | None) -> ServiceError:
        """The error a failed gRPC call stands for."""
        cls = self._by_code.get(code or "") or self._by_grpc.get(status, self._fallback)
        return cls(details or status.name)

    def from_http(self, status: int, detail: str, code: str | None) -> ServiceError:
        """The error an HTTP error response (its status and body's `error`) stands for."""
        cls = self._by_code.get(code or "") or self._by_http.get(status, self._fallback)
        return cls(detail)
