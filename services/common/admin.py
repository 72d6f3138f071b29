"""The admin HTTP endpoint of a service: /metrics (Prometheus), /livez, /readyz.

Auth: the rule of every fthsdp HTTP endpoint (`http_auth`): the probes are open, /metrics needs
the bearer token.

A stdlib threaded HTTP server: it must answer even while the event loop is busy, and it needs no
dependency beyond prometheus_client."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fthsdp.services.common.http_auth import OPEN_PATHS, UNAUTHORIZED_BODY
from fthsdp.services.common.tokens import Token

log = logging.getLogger(__name__)

_SHUTDOWN_POLL_S = 0.1  # how often serve_forever checks for shutdown: bounds stop() latency
CLIENT_TIMEOUT_S = 5.0
"""A connection silent this long mid-request is closed (its thread with it): a probe or a scrape
sends its request at once, a slow-loris client would hold a thread each for ever."""
MAX_CONNECTIONS = 32
"""Connections served at once (a thread each); more are closed on arrival. Probes and scrapes
are a handful; hundreds of idle connections took as many threads."""
CONNECTION_LIFETIME_S = 10.0
"""A connection is cut this long after it was accepted, whatever it is doing: one that sends a
byte just before each read timeout would otherwise keep its thread."""


class _BoundedServer(ThreadingHTTPServer):
    """At most MAX_CONNECTIONS handler threads; each connection cut CONNECTION_LIFETIME_S after
    it was accepted, by the serving thread itself (`service_actions` runs every poll)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst is accepted, not SYN-retried

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + CONNECTION_LIFETIME_S
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [sock for sock, deadline in self._deadlines.items() if deadline <= now]
        for sock in overdue:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it then releases

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client gone mid-answer (or cut off by the lifetime bound): not worth a traceback.
        log.debug("admin connection from %s failed", client_address, exc_info=True)


class AdminServer:
    """Serves metrics and probes on `host:port` (port 0 picks a free one) in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        *,
        token: Token,
        name: str = "admin",
    ) -> None:
        self._name = name
        self._token = token
        self._registry = registry
        self._ready = ready
        self._httpd = _BoundedServer((host, port), self._handler_class())
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """`host:port` actually bound."""
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> None:
        """Starts serving in a background thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": _SHUTDOWN_POLL_S},
            name=f"{self._name}-http",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops serving and closes the socket. Idempotent."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        admin = self

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT_S

            def do_GET(self) -> None:
                if self.path not in OPEN_PATHS and not admin._token.accepts(
                    self.headers.get("authorization")
                ):
                    self._send(
                        401, UNAUTHORIZED_BODY, "application/json", {"WWW-Authenticate": "Bearer"}
                    )
                elif self.path == "/metrics":
                    self._send(200, generate_latest(admin._registry), CONTENT_TYPE_LATEST)
                elif self.path == "/livez":
                    self._send(200, b"ok\n", "text/plain")
                elif self.path == "/readyz":
                    ready = admin._ready()
                    self._send(
                        200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain"
                    )
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(
                self,
                status: int,
                body: bytes,
                content_type: str,
                headers: dict[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

        return Handler
