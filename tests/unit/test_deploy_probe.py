"""`python -m fthsdp.deploy.probe`, the images' health check: HTTP status and file freshness."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fthsdp.deploy.probe import file_fresh, http_ok, main


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path == "/livez" else 503
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_http_probe_passes_on_2xx_and_fails_otherwise(server: str) -> None:
    assert http_ok(f"{server}/livez", 2.0)[0]
    ok, reason = http_ok(f"{server}/readyz", 2.0)
    assert not ok and "503" in reason
    assert main([f"{server}/livez"]) == 0
    assert main([f"{server}/readyz"]) == 1


def test_http_probe_fails_on_a_closed_port_and_refuses_other_schemes() -> None:
    assert not http_ok("http://127.0.0.1:1/livez", 1.0)[0]
    assert not http_ok("file:///etc/passwd", 1.0)[0]


def test_http_probe_fails_when_something_else_answers_on_the_port() -> None:
    """A server of another protocol on the port (a gRPC server that took a port picked for an
    HTTP one) is "not ready", not an exception out of the probe."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_in_binary() -> None:
            peer, _ = listener.accept()
            with peer:
                peer.recv(1024)
                peer.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\n")

        thread = threading.Thread(target=answer_in_binary, daemon=True)
        thread.start()
        ok, reason = http_ok(f"http://127.0.0.1:{listener.getsockname()[1]}/readyz", 5.0)
        thread.join(5)
    assert not ok and "not an HTTP answer" in reason


def test_file_probe_passes_only_while_the_file_is_fresh(tmp_path: Path) -> None:
    log = tmp_path / "r0.jsonl"
    assert not file_fresh(log, 300)[0]
    log.write_text("{}\n")
    os.utime(log, (1000.0, 1000.0))
    assert file_fresh(log, 300, now=1200.0)[0]
    assert not file_fresh(log, 300, now=1301.0)[0]
    assert main(["--fresh", str(log), "--max-age-s", "1"]) == 1


def test_exactly_one_target_is_required() -> None:
    with pytest.raises(SystemExit):
        main([])
