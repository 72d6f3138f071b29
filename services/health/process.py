"""`HealthProcess`: one health-service process (central or agent), assembled and embeddable.

`await start()` binds the gRPC ingest server and the HTTP server (port 0 allowed) and returns;
`grpc_address` and `http_url` are then the real addresses. `await stop()` is idempotent: not ready
-> the ingest server refuses new batches and drains for the grace period -> the loops stop
(pending quorum reports finish, an agent flushes once) -> HTTP stops -> the store closes.
Tests and `__main__` use the same object."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from fthsdp.services.common.tokens import Token
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.app import ApiContext, HttpServer, create_agent_app, create_central_app
from fthsdp.services.health.central import CentralEngine
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.quorum_reporter import QuorumReporter
from fthsdp.services.health.server import IngestServer, IngestSink
from fthsdp.services.health.store import InMemoryTelemetryStore, RedisTelemetryStore, TelemetryStore

log = logging.getLogger(__name__)


def make_store(config: HealthConfig) -> TelemetryStore:
    """The store the config asks for."""
    if config.redis_url is not None:
        return RedisTelemetryStore(
            config.redis_url,
            prefix=config.redis_prefix,
            max_incidents=config.max_incidents,
            max_records=config.max_records,
        )
    return InMemoryTelemetryStore(
        max_incidents=config.max_incidents, max_records=config.max_records
    )


class HealthProcess:
    """A central health service or a node agent, with its gRPC and HTTP servers."""

    def __init__(
        self,
        config: HealthConfig,
        token: Token | str,
        *,
        detectors: DetectorConfig | None = None,
        store: TelemetryStore | None = None,
    ) -> None:
        self.config = config
        self._token = token if isinstance(token, Token) else Token(token)
        self.metrics = HealthMetrics()
        self.quorum: QuorumReporter | None = None
        if config.quorum:
            self.quorum = QuorumReporter(
                config.quorum, self._token, timeout=config.quorum_timeout, metrics=self.metrics
            )
        self.engine: CentralEngine | None = None
        self.agent: NodeAgent | None = None
        self._store: TelemetryStore | None = None
        sink: IngestSink
        if config.mode == "central":
            self._store = store or make_store(config)
            self.engine = CentralEngine(
                config, detectors or DetectorConfig(), self._store, self.metrics, quorum=self.quorum
            )
            sink = self.engine
        else:
            self.agent = NodeAgent(config, self._token, self.metrics, quorum=self.quorum)
            sink = self.agent
        self._ingest = IngestServer(
            host=config.host,
            port=config.port,
            token=self._token,
            sink=sink,
            metrics=self.metrics,
            grace=config.shutdown_grace,
        )
        self._http: HttpServer | None = None
        self._started = False
        self._stopping: asyncio.Future[None] | None = None
        self.http_url: str | None = None
        """Base URL of the HTTP server (after start; None without one)."""

    @property
    def grpc_address(self) -> str:
        """`host:port` of the gRPC ingest server (after start)."""
        return self._ingest.address

    def is_ready(self) -> bool:
        """Readiness: started and not draining."""
        return self._started and self._ingest.is_serving()

    async def start(self) -> None:
        """Starts everything; on failure, what was started is stopped again."""
        if self._started or self._stopping is not None:
            raise RuntimeError("a HealthProcess starts once")
        try:
            if self.engine is not None:
                await self.engine.start()
            if self.agent is not None:
                await self.agent.start()
            await self._ingest.start()
            if self.config.http_port is not None:
                self._http = HttpServer(self._app(), self.config.host, self.config.http_port, 1.0)
                self.http_url = await self._http.start()
        except BaseException:
            await self.stop()
            raise
        self._started = True
        log.info(
            "health %s listening",
            self.config.mode,
            extra={"grpc": self.grpc_address, "http": self.http_url},
        )

    def _app(self) -> FastAPI:
        context = ApiContext(
            token=self._token,
            metrics=self.metrics,
            ready=self.is_ready,
            engine=self.engine,
            agent=self.agent,
            quorum=self.quorum,
        )
        if self.engine is not None:
            return create_central_app(context)
        return create_agent_app(context)

    async def stop(self) -> None:
        """Drains and stops; idempotent and safe to call concurrently."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)
            return
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            await self._ingest.stop()
            if self.engine is not None:
                await self.engine.stop()
            if self.agent is not None:
                await self.agent.stop()
            if self._http is not None:
                await self._http.stop()
            if self.quorum is not None:
                await self.quorum.close()
            if self._store is not None:
                await self._store.close()
        finally:
            self._started = False
            self._stopping.set_result(None)
