"""The one error convention: each service's classes carry their code and statuses, and a client's
`ErrorWire` maps every code, over gRPC and HTTP, back to the class the server raised."""

from __future__ import annotations

import grpc
import pytest

from fthsdp.services.checkpoint import client_errors as checkpoint
from fthsdp.services.common import errors
from fthsdp.services.health import domain as health
from fthsdp.services.quorum import domain as quorum

WIRES = {
    "quorum": quorum.ERROR_WIRE,
    "health": health.ERROR_WIRE,
    "checkpoint": checkpoint.ERROR_WIRE,
}


@pytest.mark.parametrize("service", sorted(WIRES))
def test_every_error_a_service_sends_comes_back_as_its_class(service: str) -> None:
    wire = WIRES[service]
    for cls in wire.classes:
        status, code, message = errors.grpc_failure(cls("why"), service)
        assert type(wire.from_grpc(status, message, code)) is cls
        assert type(wire.from_http(cls.http_status, "why", cls.code)) is cls
        assert str(wire.from_http(cls.http_status, "why", cls.code)) == "why"


def test_every_services_auth_error_is_the_common_one() -> None:
    for cls in (quorum.AuthError, health.AuthError, checkpoint.AuthError):
        assert issubclass(cls, errors.AuthError)
        assert (cls.code, cls.grpc_status, cls.http_status) == (
            "unauthorized",
            grpc.StatusCode.UNAUTHENTICATED,
            401,
        )


def test_without_a_known_code_the_status_decides_then_the_fallback() -> None:
    wire = health.ERROR_WIRE
    assert isinstance(wire.from_http(503, "x", None), health.HealthUnavailableError)
    assert isinstance(wire.from_http(400, "x", "no_such_code"), health.InvalidReportError)
    assert type(wire.from_http(418, "x", None)) is health.HealthError
    assert isinstance(
        quorum.ERROR_WIRE.from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "x", None),
        quorum.StaleIncarnationError,  # the first listed class with that status
    )


def test_a_code_used_twice_is_refused() -> None:
    class First(errors.ServiceError):
        code = "same"

    class Second(errors.ServiceError):
        code = "same"

    with pytest.raises(ValueError, match="used twice"):
        errors.ErrorWire((First, Second), fallback=errors.ServiceError)


def test_an_unexpected_exception_is_internal_without_its_text() -> None:
    status, code, message = errors.grpc_failure(KeyError("secret"), "quorum service")
    assert (status, code) == (grpc.StatusCode.INTERNAL, "internal")
    assert "secret" not in message
