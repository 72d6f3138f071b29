"""Bearer-token authentication for fthsdp's grpc.aio servers: one interceptor refuses every RPC
(streaming ones included) without `authorization: Bearer <token>`, while the gRPC health and
reflection services stay open for probes and tooling."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from fthsdp.services.common.tokens import Token

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_MESSAGE = "missing or invalid bearer token"

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # the runtime class is not generic
    _Interceptor = grpc.aio.ServerInterceptor


class BearerAuth(_Interceptor):
    """UNAUTHENTICATED for a missing or wrong token; `on_refused` counts refusals, and
    `trailing` (key, value) pairs go with each refusal (a service's error-kind metadata)."""

    def __init__(
        self,
        token: Token,
        *,
        on_refused: Callable[[], None] = lambda: None,
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._token = token
        self._on_refused = on_refused
        self._trailing = trailing

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
            return handler
        self._on_refused()
        return self._refusal(handler)

    def _refusal(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        trailing = self._trailing

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
            if trailing:
                context.set_trailing_metadata(trailing)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
            raise AssertionError("abort returned")  # pragma: no cover

        async def refuse_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await refuse(request, context)
            yield None  # pragma: no cover  (makes this an async generator)

        kwargs: dict[str, Any] = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
