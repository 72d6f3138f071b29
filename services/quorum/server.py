"""The quorum service on the wire: grpc.aio handlers, bearer-token interceptor, the error table,
health, reflection, admin HTTP, graceful shutdown; and the embeddable `QuorumServer` /
`QuorumServerThread`.

Handlers only convert messages <-> domain objects and map errors; behaviour is in
`coordinator.py` and `core.py`. A formed round's answer is encoded once per round and sent as
bytes to every participant, with the few endpoints each needs appended (`answers.py`), so
answering N replicas costs N writes, not N encodings of an O(N) message."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.services.common.admin import AdminServer
from fthsdp.services.common.errors import ERROR_CODE_KEY, grpc_failure
from fthsdp.services.common.grpc_auth import BearerAuth
from fthsdp.services.common.tokens import Token
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum import core
from fthsdp.services.quorum.answers import Answers
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.coordinator import Coordinator
from fthsdp.services.quorum.domain import (
    InvalidRequestError,
    MembershipEvent,
    QuorumError,
    StepWork,
)
from fthsdp.services.quorum.election import CoordinatorSlot
from fthsdp.services.quorum.metrics import QuorumMetrics
from fthsdp.services.quorum.rounds import QuorumAsk, RoundTiming
from fthsdp.services.quorum.store import QuorumStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["QuorumService"].full_name
_MAX_PENDING_CALLS = 16384
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest answer (a Status listing every member's endpoints)."""
_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest request: a Join of 4096 ranks x 2 addresses x 256 characters is about 2.1 MiB. A cap
near what is needed bounds what anyone, token or not, can make the service receive."""
_REMEMBERED_EVENTS = 256
"""Encoded events kept for streams still behind (a queue holds at most the hub's queue size)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, code, message) answered for an exception raised by a handler."""
    return grpc_failure(exc, "quorum service")


def _work(request: pb.QuorumRequest) -> StepWork:
    try:
        return codec.work_from_pb(request)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def _encode(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class _Servicer:
    """`fthsdp.v1.QuorumService` handlers."""

    def __init__(
        self, leader: Callable[[], tuple[Coordinator, int]], metrics: QuorumMetrics
    ) -> None:
        """`leader()` returns the deciding coordinator and its lease epoch, or raises
        NotLeaderError on a standby."""
        self._leader = leader
        self._metrics = metrics
        self._answers = Answers()
        self._encoded_events: dict[int, tuple[MembershipEvent, bytes]] = {}

    def generic_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """Method handlers; responses may be pre-encoded bytes (see `_encode`)."""
        unary: dict[str, tuple[Callable[[Any], Awaitable[Message | bytes]], Any]] = {
            "Join": (self._join, pb.JoinRequest),
            "Quorum": (self._quorum, pb.QuorumRequest),
            "Heartbeat": (self._heartbeat, pb.HeartbeatRequest),
            "ReportFailure": (self._report_failure, pb.ReportFailureRequest),
            "Leave": (self._leave, pb.LeaveRequest),
            "Status": (self._status, pb.StatusRequest),
        }
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: grpc.unary_unary_rpc_method_handler(
                self._wrap(name, fn),
                request_deserializer=msg.FromString,
                response_serializer=_encode,
            )
            for name, (fn, msg) in unary.items()
        }
        handlers["Watch"] = grpc.unary_stream_rpc_method_handler(
            self._watch,
            request_deserializer=pb.WatchRequest.FromString,
            response_serializer=_encode,
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _wrap(
        self, name: str, fn: Callable[[Any], Awaitable[Message | bytes]]
    ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message | bytes]]:
        requests = self._metrics.requests

        async def handle(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Message | bytes:
            try:
                response = await fn(request)
            except QuorumError as exc:
                code, kind, message = status_for(exc)
            except Exception:
                log.exception("%s failed", name)
                code, kind, message = status_for(RuntimeError())
            else:
                requests.labels(method=name, code="OK").inc()
                return response
            requests.labels(method=name, code=code.name).inc()
            context.set_trailing_metadata(((ERROR_CODE_KEY, kind),))
            await context.abort(code, message)
            raise AssertionError("abort returned")  # pragma: no cover

        return handle

    async def _join(self, request: pb.JoinRequest) -> Message:
        coordinator, epoch = self._leader()
        incarnation, quorum_id = await coordinator.join(
            request.replica_id, request.world_size, codec.ranks_from_pb(request.ranks)
        )
        return pb.JoinResponse(incarnation=incarnation, quorum_id=quorum_id, leader_epoch=epoch)

    async def _quorum(self, request: pb.QuorumRequest) -> bytes:
        coordinator, epoch = self._leader()
        formation = await coordinator.quorum(
            QuorumAsk(
                replica_id=request.replica_id,
                incarnation=request.incarnation,
                step=request.step,
                commit_failed=request.commit_failed,
                attempt_id=request.attempt_id,
                work=_work(request),
            )
        )
        return self._answers.encode(
            formation, caller=request.replica_id, known=request.known_quorum_id, epoch=epoch
        )

    async def _heartbeat(self, request: pb.HeartbeatRequest) -> Message:
        coordinator, epoch = self._leader()
        quorum_id = coordinator.heartbeat(request.replica_id, request.incarnation)
        return pb.HeartbeatResponse(quorum_id=quorum_id, leader_epoch=epoch)

    async def _report_failure(self, request: pb.ReportFailureRequest) -> Message:
        incarnation = request.incarnation if request.HasField("incarnation") else None
        evicted = self._leader()[0].report_failure(
            request.replica_id,
            incarnation,
            request.reason,
            request.reporter,
            teardown=request.teardown,
            unless_heard_within=(
                request.unless_heard_within_ms / 1000 if request.unless_heard_within_ms else None
            ),
        )
        return pb.ReportFailureResponse(evicted=evicted)

    async def _leave(self, request: pb.LeaveRequest) -> Message:
        self._leader()[0].leave(request.replica_id, request.incarnation, request.reason)
        return pb.LeaveResponse()

    async def _status(self, request: pb.StatusRequest) -> Message:
        coordinator, epoch = self._leader()
        message = codec.status_to_pb(await coordinator.status(request.history_limit))
        message.leader_epoch = epoch
        return message

    async def _watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        holder = None
        try:
            if request.replica_id:
                holder = (core.check_id(request.replica_id), request.incarnation)
            replicas = core.check_watched(request.replica_ids)
            coordinator = self._leader()[0]
            sub = coordinator.subscribe(
                holder, without_joins=request.without_joins, replicas=replicas
            )
        except QuorumError as exc:
            code, kind, message = status_for(exc)
            context.set_trailing_metadata(((ERROR_CODE_KEY, kind),))
            await context.abort(code, message)
            return
        self._metrics.requests.labels(method="Watch", code="OK").inc()
        try:
            while True:
                event = await sub.queue.get()
                if event is None:
                    if sub.overflowed:
                        await context.abort(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "watch stream fell too far behind; subscribe again",
                        )
                    return
                yield self._encoded_event(event)
        finally:
            coordinator.unsubscribe(sub)

    def _encoded_event(self, event: MembershipEvent) -> bytes:
        """An event's bytes, encoded once for all the streams it goes to (each stream gets the
        same object from the hub; the memo holds it, so its id is not reused meanwhile)."""
        held = self._encoded_events.get(id(event))
        if held is not None and held[0] is event:
            return held[1]
        data = codec.event_to_pb(event).SerializeToString()
        self._encoded_events[id(event)] = (event, data)
        while len(self._encoded_events) > _REMEMBERED_EVENTS:
            del self._encoded_events[next(iter(self._encoded_events))]
        return data


class QuorumServer:
    """The quorum service, embeddable: `await start()` binds (port 0 allowed), `await stop()`.

    Graceful stop: health turns NOT_SERVING, waiting Quorum calls get UNAVAILABLE (clients retry
    against the restarted service or a standby), Watch streams end, new RPCs are refused, and
    in-flight ones get `grace` to finish before they are cancelled."""

    def __init__(
        self,
        config: QuorumConfig,
        token: Token | str,
        *,
        store: QuorumStore | None = None,
        metrics: QuorumMetrics | None = None,
    ) -> None:
        self.config = config
        self._token = token if isinstance(token, Token) else Token(token)
        self.metrics = metrics or QuorumMetrics()
        if store is not None and config.redis_url is not None:
            raise ValueError("pass either a store or config.redis_url, not both")
        self._slot = CoordinatorSlot(config, self.metrics, store=store, on_serving=self._serve)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._admin: AdminServer | None = None
        self._serving = False
        self._stopping: asyncio.Future[None] | None = None
        self.address = ""
        """`host:port` the gRPC server is bound to (after start)."""
        self.admin_address: str | None = None
        """`host:port` of the admin HTTP server (after start; None without one)."""

    async def start(self) -> str:
        """Binds and starts serving; returns `address`."""
        if self._server is not None:
            raise RuntimeError("QuorumServer.start() called twice")
        server = grpc.aio.server(
            interceptors=[BearerAuth(self._token, on_refused=self.metrics.auth_failures.inc)],
            options=[
                ("grpc.max_receive_message_length", _MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                # Clients ping every second during calls (a blackholed leader is noticed in
                # ~2 s); the service pings too, so a dead or stopped leader's Watch stream, which
                # keeps its replica alive without heartbeats, ends within ~2 s.
                ("grpc.http2.min_ping_interval_without_data_ms", 500),
                ("grpc.keepalive_time_ms", 1_000),
                ("grpc.keepalive_timeout_ms", 1_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.so_reuseport", 0),
                # Every replica leader holds a long poll open, and all of a round's next asks
                # arrive together: with the default (1000 calls not yet picked up by the event
                # loop) grpc-core starts cancelling new calls at ~1000 replicas.
                ("grpc.server_max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server_max_pending_requests_hard_limit", 2 * _MAX_PENDING_CALLS),
            ],
        )
        server.add_generic_rpc_handlers(
            (_Servicer(self._slot.current, self.metrics).generic_handler(),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        self._server = server
        await server.start()
        self.address = f"{self.config.host}:{port}"
        if self.config.admin_port is not None:
            self._admin = AdminServer(
                self.config.host,
                self.config.admin_port,
                self.metrics.registry,
                self.is_serving,
                token=self._token,
                name="quorum-admin",
            )
            self._admin.start()
            self.admin_address = self._admin.address
        await self._slot.start(self.address)
        log.info("quorum service listening", extra={"address": self.address})
        return self.address

    @property
    def coordinator(self) -> Coordinator:
        """The deciding coordinator (NotLeaderError on a standby)."""
        return self._slot.current()[0]

    @property
    def is_leader(self) -> bool:
        """Whether this instance decides now (always, without leader election)."""
        return self._slot.coordinator is not None

    @property
    def leader_epoch(self) -> int:
        """Lease epoch of the current leadership (0 without leader election)."""
        return self._slot.leader_epoch

    def is_serving(self) -> bool:
        """Whether the service accepts requests (readiness): started, not stopping, leading."""
        return self._serving

    async def _serve(self, serving: bool) -> None:
        if self._stopping is not None and serving:
            return
        self._serving = serving
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status.SERVING if serving else status.NOT_SERVING)

    def round_timings(self) -> list[RoundTiming]:
        """Recent server-side round latencies (for benchmarks)."""
        coordinator = self._slot.coordinator
        return list(coordinator.round_timings) if coordinator else []

    async def stop(self, grace: timedelta | None = None) -> None:
        """Stops gracefully (see the class doc); idempotent and safe to call concurrently."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)
            return
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            await self._shutdown(self.config.shutdown_grace if grace is None else grace)
        finally:
            self._stopping.set_result(None)

    async def _shutdown(self, grace: timedelta) -> None:
        self._serving = False
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._slot.close()
            await self._server.stop(grace.total_seconds())
            await self._server.wait_for_termination(0)
        if self._admin is not None:
            self._admin.stop()
        log.info("quorum service stopped", extra={"address": self.address})


class QuorumServerThread:
    """A `QuorumServer` on its own event loop in a background thread, for synchronous callers
    (tests of the sync client, the local launcher)."""

    def __init__(
        self, config: QuorumConfig, token: Token | str, *, store: QuorumStore | None = None
    ) -> None:
        self._config = config
        self._token = token
        self._store = store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.server: QuorumServer | None = None
        """The embedded server (after start)."""

    @property
    def address(self) -> str:
        """`host:port` of the gRPC server (after start)."""
        return self.server.address if self.server else ""

    @property
    def admin_address(self) -> str | None:
        """`host:port` of the admin HTTP server (after start)."""
        return self.server.admin_address if self.server else None

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> str:
        """Starts the thread and the server; returns the bound address."""
        if self._thread is not None:
            raise RuntimeError("QuorumServerThread.start() called twice")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self.server = QuorumServer(self._config, self._token, store=self._store)
                loop.run_until_complete(self.server.start())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="quorum-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout.total_seconds()):
            raise TimeoutError("the quorum server did not start in time")
        if failure:
            raise failure[0]
        return self.address

    def stop(self, grace: timedelta | None = None) -> None:
        """Stops the server gracefully and joins the thread. Idempotent."""
        loop, thread, server = self._loop, self._thread, self.server
        if loop is None or thread is None or server is None or not thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(server.stop(grace), loop)
        with contextlib.suppress(Exception):
            future.result(timeout=(grace or self._config.shutdown_grace).total_seconds() + 10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
