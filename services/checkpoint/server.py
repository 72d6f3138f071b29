"""The embeddable checkpoint sidecar: `CheckpointServer(config, token).start()` → its URL.

uvicorn runs on its own event loop in a background thread, bound to a socket made here (port 0
allowed), so tests and `__main__` use the same object and the real address is known before the
first request. `stop()` is idempotent: not ready → stop accepting → drain open requests and queued
durable writes for the grace period → cancel; then the shm files the sidecar owns are unlinked."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import uvicorn

from fthsdp.services.checkpoint.app import Metrics, Services, create_app
from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.durable import DurableStore, DurableWriter
from fthsdp.services.checkpoint.snapshots import SnapshotRegistry
from fthsdp.services.checkpoint.store import FilePositionStore, PositionStore
from fthsdp.services.checkpoint.store_redis import RedisPositionStore
from fthsdp.services.checkpoint.zerocopy import ZeroCopyHttpToolsProtocol
from fthsdp.services.common.http_listener import bind_listener, http_url
from fthsdp.services.common.private_dir import ensure_private_dir
from fthsdp.services.common.tokens import Token

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0


def _position_store(config: CheckpointConfig) -> PositionStore:
    if config.redis_url is not None:
        return RedisPositionStore(config.redis_url)
    return FilePositionStore(config.durable_root / "positions")


class CheckpointServer:
    """One sidecar: snapshot registry, durable writer, position store and the HTTP server."""

    def __init__(
        self, config: CheckpointConfig, token: Token, *, positions: PositionStore | None = None
    ) -> None:
        self.config = config
        metrics = Metrics()
        registry = SnapshotRegistry(config, on_checksums=metrics.checksum_seconds.observe)
        store = DurableStore(
            config.durable_root,
            retain=config.retain_checkpoints,
            max_bytes=config.max_snapshot_bytes,
        )
        self.services = Services(
            config=config,
            token=token,
            registry=registry,
            durable=store,
            writer=DurableWriter(store, metrics.on_durable),
            positions=positions or _position_store(config),
            metrics=metrics,
        )
        self.app = create_app(self.services)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("the checkpoint server is not started")
        return self._address

    @property
    def url(self) -> str:
        host, port = self.address
        return http_url(host, port)

    def start(self) -> str:
        """Binds, starts serving in a background thread, and returns the base URL."""
        with self._lock:
            if self._stopped or self._thread is not None:
                raise RuntimeError("a CheckpointServer starts once")
            ensure_private_dir(self.config.shm_dir)
            self.config.durable_root.mkdir(parents=True, exist_ok=True)
            sock = bind_listener(self.config.host, self.config.port, backlog=1024)
            self._address = sock.getsockname()[:2]
            uv_config = uvicorn.Config(
                self.app,
                log_level=self.config.log_level,
                # uvicorn's lines go through the process's one handler (services.common.logs)
                # instead of uvicorn's own, so a JSON log stays JSON.
                log_config=None,
                access_log=False,
                lifespan="off",
                # httptools (C parser: ~10% more fetch bandwidth than h11 here), with bounds on
                # the request head's size and time, and snapshot bytes sent with sendfile.
                http=ZeroCopyHttpToolsProtocol,
                ws="none",
                timeout_graceful_shutdown=max(int(self.config.shutdown_grace.total_seconds()), 1),
            )
            server = uvicorn.Server(uv_config)
            self._server = server
            self._thread = threading.Thread(
                # asyncio's own loop, whatever else is installed: its socket transports do
                # `sendfile` natively (zerocopy).
                target=lambda: asyncio.run(server.serve(sockets=[sock])),
                name="fthsdp-checkpoint-http",
                daemon=True,
            )
            self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the checkpoint server failed to start")
            time.sleep(0.005)
        log.info("checkpoint sidecar serving on %s", self.url)
        return self.url

    def stop(self) -> None:
        """Drains and stops; safe to call any number of times, started or not."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        services = self.services
        services.ready = False
        grace = self.config.shutdown_grace.total_seconds()
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(grace + 5.0)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(5.0)
        services.writer.close(grace)
        services.registry.close()
        services.positions.close()
        log.info("checkpoint sidecar stopped")
