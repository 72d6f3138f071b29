"""The health service's gRPC wire: `fthsdp.v1.HealthService/Report` on grpc.aio, the bearer-token
interceptor, grpc.health.v1 and reflection; embeddable as `IngestServer`.

The handler only decodes and validates a batch (`client_codec.batch_from_pb`, which also rebases
the sender's times onto this host's clock), refuses one held up in the network (`transit`), and
hands it to an `IngestSink`: the central engine (`central.py`) or the node agent (`agent.py`).
Both modes serve the same API, so a rank reports to either without knowing which it talks to."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.common.errors import ERROR_CODE_KEY, grpc_failure
from fthsdp.services.common.grpc_auth import BearerAuth
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import ReportBatch, batch_from_pb
from fthsdp.services.health.domain import (
    MAX_MESSAGE_BYTES,
    HealthError,
    HealthTimeoutError,
    HealthUnavailableError,
)
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.transit import TransitDelays

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HealthService"].full_name


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, code, message) answered for an exception raised while handling a request."""
    return grpc_failure(exc, "health service")


class IngestSink(Protocol):
    """What receives validated batches (the central engine or the node agent)."""

    async def ingest(self, batch: ReportBatch) -> None:
        """Takes one batch; raises HealthError subclasses for the caller's mistakes."""

    def forward_interval_ms(self) -> int:
        """The interval a node agent is asked to forward at, in ms (0: its own)."""


class _Servicer:
    """`fthsdp.v1.HealthService` handlers."""

    def __init__(self, sink: IngestSink, metrics: HealthMetrics, serving: Callable[[], bool]):
        self._sink = sink
        self._metrics = metrics
        self._serving = serving
        self._transit = TransitDelays()

    def generic_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        handlers = {
            "Report": grpc.unary_unary_rpc_method_handler(
                self._report,
                request_deserializer=pb.ReportRequest.FromString,
                response_serializer=pb.ReportResponse.SerializeToString,
            )
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    async def _report(
        self, request: pb.ReportRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportResponse:
        try:
            if not self._serving():
                raise HealthUnavailableError("the health service is shutting down")
            now = time.time()
            batch = batch_from_pb(request, now)
            self._check_transit(request, batch, now)
            await self._sink.ingest(batch)
        except HealthError as exc:
            code, kind, message = status_for(exc)
        except Exception:
            log.exception("Report failed")
            code, kind, message = status_for(RuntimeError())
        else:
            self._metrics.requests.labels(method="Report", code="OK").inc()
            interval = self._sink.forward_interval_ms() if batch.node is not None else 0
            return pb.ReportResponse(accepted=batch.size(), forward_interval_ms=interval)
        self._metrics.requests.labels(method="Report", code=code.name).inc()
        context.set_trailing_metadata(((ERROR_CODE_KEY, kind),))
        await context.abort(code, message)
        raise AssertionError("abort returned")  # pragma: no cover

    def _check_transit(self, request: pb.ReportRequest, batch: ReportBatch, now: float) -> None:
        """Refuses a batch held up in the network (`transit`): its times would read as fresh."""
        if not request.sent_at:
            return
        late = self._transit.late((batch.host, batch.source), now - request.sent_at, now)
        if late is None:
            return
        log.info(
            "refused a batch from %s on %s: %.1f s late in transit", batch.source, batch.host, late
        )
        raise HealthTimeoutError(
            f"the batch arrived {late:.1f} s later than this sender's others: its sender gave "
            "up on it, and its times would read as fresh"
        )


class IngestServer:
    """The gRPC ingest endpoint, embeddable: `await start()` binds (port 0 allowed) and returns
    `address`; `await stop()` is idempotent (NOT_SERVING, refuse new calls, drain, cancel)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        token: Token,
        sink: IngestSink,
        metrics: HealthMetrics,
        grace: timedelta = timedelta(seconds=2),
    ) -> None:
        self._host = host
        self._port = port
        self._token = token
        self._sink = sink
        self._metrics = metrics
        self._grace = grace
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._serving = False
        self._stopping: asyncio.Future[None] | None = None
        self.address = ""
        """`host:port` the server is bound to (after start)."""

    def is_serving(self) -> bool:
        """Whether new batches are accepted."""
        return self._serving

    async def start(self) -> str:
        """Binds and starts serving; returns `address`."""
        if self._server is not None:
            raise RuntimeError("IngestServer.start() called twice")
        server = grpc.aio.server(
            interceptors=[BearerAuth(self._token, on_refused=self._metrics.auth_failures.inc)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", 1024 * 1024),
                ("grpc.so_reuseport", 0),
                # Agents ping every 2 s (`forward_pacing.CHANNEL_OPTIONS`) to notice a dead link.
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        servicer = _Servicer(self._sink, self._metrics, self.is_serving)
        server.add_generic_rpc_handlers((servicer.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = server.add_insecure_port(f"{self._host}:{self._port}")
        if port == 0:
            raise OSError(f"could not bind {self._host}:{self._port}")
        self._server = server
        await server.start()
        self.address = f"{self._host}:{port}"
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        return self.address

    async def stop(self) -> None:
        """Stops gracefully; idempotent and safe to call concurrently."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)
            return
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            self._serving = False
            if self._server is not None:
                await self._health.enter_graceful_shutdown()
                await self._server.stop(self._grace.total_seconds())
                await self._server.wait_for_termination(0)
        finally:
            self._stopping.set_result(None)
