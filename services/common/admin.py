"""The admin HTTP endpoint of a service: /metrics (Prometheus), /livez, /readyz.

A stdlib threaded HTTP server: it must answer even while the event loop is busy, and it needs no
dependency beyond prometheus_client."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_SHUTDOWN_POLL_S = 0.1  # how often serve_forever checks for shutdown: bounds stop() latency
CLIENT_TIMEOUT_S = 5.0
"""A connection silent this long mid-request is closed (its thread with it): a probe or a scrape
sends its request at once, a slow-loris client would hold a thread each for ever."""


class AdminServer:
    """Serves metrics and probes on `host:port` (port 0 picks a free one) in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        *,
        name: str = "admin",
    ) -> None:
        self._name = name
        self._registry = registry
        self._ready = ready
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
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
                if self.path == "/metrics":
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

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

        return Handler
