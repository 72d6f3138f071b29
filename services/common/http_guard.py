"""The one front check of the FastAPI services (health, checkpoint), as pure ASGI middleware so a
streamed body or response stays cheap: the bearer token outside the open paths
(`http_auth.OPEN_PATHS`), a bound on request bodies, and one count per request.

The body bound is checked twice: the declared Content-Length before anything is read, and the
bytes actually received while the app reads them (a chunked upload declares none). A body over
the bound is answered 413 `too_large` whichever way it is caught."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fthsdp.services.common.http_auth import OPEN_PATHS
from fthsdp.services.common.http_errors import error_response
from fthsdp.services.common.parse import ascii_int
from fthsdp.services.common.tokens import Token


def _uncounted() -> None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardRules:
    """What one service's guard checks and where it reports."""

    token: Token
    max_body_bytes: int
    """Largest request body accepted, declared or streamed."""
    count: Callable[[str, int, float], None]
    """Called once per request with (route name, status, seconds); "unmatched" for a request
    no route took (refused, or not found)."""
    is_open: Callable[[str], bool] = OPEN_PATHS.__contains__
    """Paths answered without the token."""
    on_auth_failure: Callable[[], None] = _uncounted
    require_length: bool = False
    """Refuse a PUT or POST without Content-Length (411) instead of bounding it as it streams."""


class _BodyTooLarge(Exception):
    """Raised into the app by the bounded receive; the guard answers it with a 413."""


class HttpGuard:
    """`app.add_middleware(HttpGuard, rules=GuardRules(...))`."""

    def __init__(self, app: ASGIApp, rules: GuardRules) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refuse(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            self._count(scope, refusal.status_code, 0.0)
            return
        exchange = _Exchange(send, self.rules.max_body_bytes)
        start = _now()
        try:
            await self.app(scope, exchange.bounded(receive), exchange.send)
        except _BodyTooLarge:
            pass  # answered below: the app let the bound's error through (a streaming route)
        finally:
            if exchange.too_large and not exchange.started:
                await self._too_large()(scope, receive, send)
                exchange.status = 413
            self._count(scope, exchange.status, _now() - start)

    def _refuse(self, scope: Scope) -> JSONResponse | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if not self.rules.is_open(scope["path"]) and not self.rules.token.accepts(
            headers.get("authorization")
        ):
            self.rules.on_auth_failure()
            return error_response(401, "unauthorized", "missing or wrong bearer token")
        length = headers.get("content-length")
        size = None if length is None else ascii_int(length)
        if length is not None and (size is None or size > self.rules.max_body_bytes):
            return self._too_large()
        if self.rules.require_length and scope["method"] in ("PUT", "POST") and length is None:
            return error_response(411, "length_required", "send a Content-Length")
        return None

    def _too_large(self) -> JSONResponse:
        limit = self.rules.max_body_bytes
        return error_response(413, "too_large", f"request bodies are limited to {limit} bytes")

    def _count(self, scope: Scope, status: int, seconds: float) -> None:
        route = getattr(scope.get("endpoint"), "__name__", "unmatched")
        self.rules.count(route, status, seconds)


class _Exchange:
    """One request's state: the status sent, and whether its body broke the bound."""

    def __init__(self, send: Send, limit: int) -> None:
        self._send = send
        self._limit = limit
        self.status = 500
        self.started = False
        self.too_large = False

    def bounded(self, receive: Receive) -> Receive:
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self._limit:
                self.too_large = True
                raise _BodyTooLarge
            return message

        return bounded

    async def send(self, message: Message) -> None:
        if self.too_large:
            # The framework turns an error raised while it parses a body into its own 400; the
            # client sent too much, and the guard tells it so instead (see HttpGuard.__call__).
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.started = True
        await self._send(message)


def _now() -> float:
    return asyncio.get_running_loop().time()
