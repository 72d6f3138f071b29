"""The HTTP error contract every fthsdp FastAPI service shares: a JSON body
`{"error": <code>, "detail": <text>}` with the status the domain error names
(`services.common.errors`), and the handlers that apply it (request validation is 400, unknown
errors 500 without a traceback on the wire)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fthsdp.services.common.errors import ServiceError

log = logging.getLogger(__name__)

_MAX_VALIDATION_ERRORS = 5


def error_response(status: int, code: str, detail: str) -> JSONResponse:
    """The JSON error body (with `WWW-Authenticate` on 401)."""
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    # A detail may echo the client's input, lone surrogates included ("\ud800" is valid JSON):
    # escaped, they cannot make the error itself fail to encode (a 500 instead of the 400).
    detail = detail.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, root: type[ServiceError]) -> None:
    """Answers `root` and its subclasses with the status and code each names, and every other
    failure by the shared contract."""

    async def domain(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return error_response(exc.http_status, exc.code, str(exc))

    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        parts = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
            for e in exc.errors()[:_MAX_VALIDATION_ERRORS]
        ]
        return error_response(400, "invalid_argument", "; ".join(parts))

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    async def unknown(_: Request, exc: Exception) -> Response:
        log.error("unhandled error: %s", type(exc).__name__, exc_info=exc)
        return error_response(500, "internal", "internal error")

    app.add_exception_handler(root, domain)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unknown)
