"""What a request costs before it is trusted, on real servers: a request without the token is
refused without being decoded (RSS measured on a real quorum-service process), one that does not
decode is a clean INVALID_ARGUMENT, for unary and streaming methods of both gRPC services; HTTP
headers are bounded and a silent half-request is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.common import admin, http_limits
from fthsdp.services.common.admin import CLIENT_TIMEOUT_S
from fthsdp.services.quorum.client import AsyncQuorumClient, InvalidRequestError, RankEndpoint
from tests.integration.conftest import QuorumServerFactory
from tests.integration.health_support import NodeFactory, health_nodes
from tests.integration.test_checkpoint_support import sidecars

__all__ = ["sidecars"]  # a fixture

GARBAGE = b"\xff\xff\xff\xff\x0f not a protobuf"


@pytest.fixture
async def make_node(token: str):  # type: ignore[no-untyped-def]
    async with health_nodes(token) as make:
        yield make


async def _raw_call(
    address: str, method: str, body: bytes, token: str | None, *, stream: bool = False
) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if stream:
                call = channel.unary_stream(method)(body, metadata=metadata, timeout=5)
                async for _ in call:
                    pass
            else:
                await channel.unary_unary(method)(body, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("method", "stream"),
    [
        ("/fthsdp.v1.QuorumService/Join", False),
        ("/fthsdp.v1.QuorumService/Watch", True),
    ],
)
async def test_the_quorum_service_answers_garbage_with_invalid_argument(
    make_quorum_server: QuorumServerFactory, token: str, method: str, stream: bool
) -> None:
    server = await make_quorum_server()
    code = await _raw_call(server.address, method, GARBAGE, token, stream=stream)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # Without the token the same bytes are refused for the token, never looked at.
    code = await _raw_call(server.address, method, GARBAGE, None, stream=stream)
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_flood_of_garbage_logs_one_line_and_no_traceback(
    make_quorum_server: QuorumServerFactory, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = await make_quorum_server()
    caplog.set_level(logging.DEBUG)
    for _ in range(50):
        code = await _raw_call(server.address, "/fthsdp.v1.QuorumService/Heartbeat", GARBAGE, token)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("port", ["²", "１２３", "٣٣", "0", "65536"])
async def test_a_join_with_a_port_that_is_no_port_is_invalid_argument(
    make_quorum_server: QuorumServerFactory, token: str, port: str
) -> None:
    server = await make_quorum_server()
    client = AsyncQuorumClient(server.address, token)
    try:
        with pytest.raises(InvalidRequestError, match="host:port"):
            await client.join("r0", [RankEndpoint(ftar=f"h:{port}", checkpoint="http://h:1")])
    finally:
        await client.close()


async def test_health_ingest_answers_garbage_with_invalid_argument(
    make_node: NodeFactory, token: str
) -> None:
    node = await make_node()
    method = "/fthsdp.v1.HealthService/Report"
    assert await _raw_call(node.grpc_address, method, GARBAGE, token) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert await _raw_call(node.grpc_address, method, GARBAGE, None) == (
        grpc.StatusCode.UNAUTHENTICATED
    )


# ---- memory: a tokenless request is never decoded ------------------------------------------


def _hostile_join(size: int) -> bytes:
    """A JoinRequest of empty RankEndpoint entries: 2 bytes each on the wire (field 3, length
    0), tens of bytes each once decoded."""
    return b"\x1a\x00" * (size // 2)


@pytest.fixture
def quorum_process(tmp_path: Path, token: str) -> Iterator[tuple[str, int]]:
    """A real quorum-service process: (its address, its pid)."""
    token_file = tmp_path / "token"
    token_file.write_text(token)
    argv = [sys.executable, "-m", "fthsdp.services.quorum", "--port", "0", "--admin-port", "0"]
    process = subprocess.Popen(
        [*argv, "--token-file", str(token_file)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        found = re.search(r"listening on (\S+)", banner)
        assert found, banner
        yield found.group(1), process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _send(address: str, body: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        try:
            channel.unary_unary("/fthsdp.v1.QuorumService/Join")(body, timeout=30)
        except grpc.RpcError as err:
            return err.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_tokenless_requests_cost_their_size_not_their_decoded_size(
    quorum_process: tuple[str, int],
) -> None:
    address, pid = quorum_process
    before = _rss_bytes(pid)
    body = _hostile_join(7 << 20)  # just under the 8 MiB request cap
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: _send(address, body), range(4)))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    grown = _rss_bytes(pid) - before
    # Decoded, each would be about 28 x 7 MiB (about 200 MB; 800 MB for the four); received
    # and dropped, each costs about its size.
    assert grown < 120 << 20, f"RSS grew by {grown >> 20} MiB"
    # Beyond the cap a request is refused before it is even received in full.
    assert _send(address, _hostile_join(9 << 20)) == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- HTTP: bounded headers, no slow-loris threads -------------------------------------------


def _drain(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends until it closes the connection (fails after `seconds`)."""
    sock.settimeout(seconds)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


async def test_a_huge_header_is_refused_without_reading_it_all(
    make_node: NodeFactory, token: str
) -> None:
    node = await make_node()
    host, port = (node.http_url or "").removeprefix("http://").rsplit(":", 1)

    def send() -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\nx-junk: ")
            with contextlib.suppress(OSError):  # the server may close while we still send
                for _ in range(64):
                    sock.sendall(b"a" * (1 << 20))
            return _drain(sock, 10.0)

    answer = await asyncio.to_thread(send)
    # Refused after the 64 KiB bound (h11 says 400), or cut off while we still sent.
    assert answer == b"" or answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), answer[:80]


async def test_the_admin_port_drops_a_silent_half_request(
    make_quorum_server: QuorumServerFactory,
) -> None:
    server = await make_quorum_server()
    assert server.admin_address is not None
    host, port = server.admin_address.rsplit(":", 1)

    def send() -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /livez HTTP/1.1\r\n")  # and then nothing
            return _drain(sock, CLIENT_TIMEOUT_S + 10.0)

    assert await asyncio.to_thread(send) == b""  # closed by the server, not our timeout


def _trickle(url: str, seconds: float) -> bool:
    """Sends a request head one byte at a time for up to `seconds`; whether the server closed
    the connection meanwhile."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n")
        sock.settimeout(0.1)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"x")
                if sock.recv(1) == b"":
                    return True
            except TimeoutError:
                continue
            except OSError:  # reset: closed
                return True
    return False


@pytest.fixture
def short_head_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 0.5)


@pytest.mark.usefixtures("short_head_deadline")
async def test_a_trickling_request_head_is_cut_off_on_every_http_server(
    make_node: NodeFactory, sidecars: Callable[..., CheckpointServer]
) -> None:
    """Slow-loris: one byte at a time kept a connection (and on the admin port a thread) for
    ever. The head must now be complete within the head deadline; normal requests still work."""
    node = await make_node()
    sidecar = sidecars()
    for url in (node.http_url or "", sidecar.url):
        assert await asyncio.to_thread(_trickle, url, 8.0), url
        answer = await asyncio.to_thread(_request, url, b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), (url, answer[:80])


def _request(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(65536)


def test_the_checkpoint_sidecar_refuses_a_huge_header_unread(
    sidecars: Callable[..., CheckpointServer],
) -> None:
    """httptools read a 64 MiB header on /livez (no token needed) in full before answering."""
    host, port = sidecars().url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\nx-junk: ")
        sent = 0
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(64):
                sock.sendall(b"a" * (1 << 20))
                sent += 1
        answer = _drain(sock, 10.0)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert sent < 64 or answer.startswith(b"HTTP/1.1 431")


async def test_the_admin_port_bounds_its_threads_and_cuts_trickling_clients(
    make_quorum_server: QuorumServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 idle connections took 207 threads; one byte before each read timeout kept a thread
    for ever. Now at most MAX_CONNECTIONS are served at once, each for a bounded time."""
    server = await make_quorum_server()
    assert server.admin_address is not None
    url = f"http://{server.admin_address}"
    host, port = server.admin_address.rsplit(":", 1)
    before = threading.active_count()
    monkeypatch.setattr(admin, "CONNECTION_LIFETIME_S", 30.0)  # the idle ones keep their slot
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
    try:
        # Those past the bound are closed on arrival; once that many were, every one of the
        # 100 has been accepted, and the threads are what the bound allows.
        closed = await asyncio.to_thread(_closed_by_server, idle, 100 - admin.MAX_CONNECTIONS)
        assert closed >= 100 - admin.MAX_CONNECTIONS, closed
        grown = threading.active_count() - before
        assert grown <= admin.MAX_CONNECTIONS + 2, grown
    finally:
        for sock in idle:
            sock.close()
    monkeypatch.setattr(admin, "CONNECTION_LIFETIME_S", 0.5)
    assert await asyncio.to_thread(_trickle, url, 8.0)

    def answered() -> bytes:
        deadline = time.monotonic() + 10
        while True:
            answer = _request(url, b"GET /livez HTTP/1.0\r\n\r\n")
            if answer.startswith(b"HTTP/1.0 200") or time.monotonic() > deadline:
                return answer
            time.sleep(0.05)  # a freed slot: poll until one is

    assert (await asyncio.to_thread(answered)).startswith(b"HTTP/1.0 200")


def _closed_by_server(socks: list[socket.socket], wanted: int) -> int:
    """How many of `socks` the server closed, polling until `wanted` were (10 s at most)."""
    closed: set[int] = set()
    for sock in socks:
        sock.setblocking(False)  # a probe must not wait out the socket's timeout
    deadline = time.monotonic() + 10
    while len(closed) < wanted and time.monotonic() < deadline:
        for i, sock in enumerate(socks):
            if i in closed:
                continue
            try:
                if sock.recv(1) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.02)
    return len(closed)
