"""Bearer-token authentication for fthsdp's grpc.aio servers: one interceptor refuses every RPC
(streaming ones included) without `authorization: Bearer <token>`, while the gRPC health and
reflection services stay open for probes and tooling.

It is also the front door for what a request costs: a refused request is never decoded (its
bytes are dropped as received: decoding a hostile protobuf costs many times its size, and the
token decides before that), and a request that does not decode is answered INVALID_ARGUMENT
with one rate-limited log line, instead of gRPC's UNKNOWN and a traceback per request."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from fthsdp.services.common.errors import ERROR_CODE_KEY, AuthError
from fthsdp.services.common.tokens import Token

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_MESSAGE = "missing or invalid bearer token"
_UNDECODABLE_LOG_EVERY_S = 10.0
_UNDECODABLE = object()
"""What a request that does not decode becomes (its handler then answers INVALID_ARGUMENT)."""

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # the runtime class is not generic
    _Interceptor = grpc.aio.ServerInterceptor


class BearerAuth(_Interceptor):
    """UNAUTHENTICATED for a missing or wrong token, with the `AuthError` code in its trailing
    metadata as every service's errors carry theirs; `on_refused` counts refusals."""

    def __init__(self, token: Token, *, on_refused: Callable[[], None] = lambda: None) -> None:
        self._token = token
        self._on_refused = on_refused
        self._guarded: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        """Method -> its guarded handler, built once (a service's handlers never change)."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode(errors="replace")
        if self._token.accepts(presented):
            method = handler_call_details.method
            guarded = self._guarded.get(method)
            if guarded is None:
                guarded = self._guarded[method] = _guarded(handler, method)
            return guarded
        self._on_refused()
        return self._refusal(handler)

    def _refusal(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
            context.set_trailing_metadata(((ERROR_CODE_KEY, AuthError.code),))
            await context.abort(AuthError.grpc_status, _MESSAGE)
            raise AssertionError("abort returned")  # pragma: no cover

        async def refuse_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await refuse(request, context)
            yield None  # pragma: no cover  (makes this an async generator)

        # No deserializer: the refused request stays the bytes it arrived as.
        kwargs: dict[str, Any] = {
            "request_deserializer": None,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)


class _Undecodable:
    """Counts requests that did not decode; logs one line per `_UNDECODABLE_LOG_EVERY_S`."""

    count = 0
    _last_log = -_UNDECODABLE_LOG_EVERY_S

    @classmethod
    def seen(cls, method: str, error: Exception) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls._last_log >= _UNDECODABLE_LOG_EVERY_S:
            cls._last_log = now
            log.warning(
                "%s: a request did not decode (%s; %d so far)",
                method,
                type(error).__name__,
                cls.count,
            )


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any], method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` answering INVALID_ARGUMENT for a unary request that does not decode."""
    decode = handler.request_deserializer
    if decode is None or handler.request_streaming:
        return handler

    def safe_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a decoder raises
            _Undecodable.seen(method, exc)
            return _UNDECODABLE

    async def reject(context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not decode")
        raise AssertionError("abort returned")  # pragma: no cover

    kwargs: dict[str, Any] = {
        "request_deserializer": safe_decode,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary  # the stubs type the blocking handlers only

        async def unary_call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if request is _UNDECODABLE:
                await reject(context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_call, **kwargs)
    stream: Any = handler.unary_stream
    assert stream is not None

    async def stream_call(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if request is _UNDECODABLE:
            await reject(context)
        async for item in stream(request, context):
            yield item

    return grpc.unary_stream_rpc_method_handler(stream_call, **kwargs)
