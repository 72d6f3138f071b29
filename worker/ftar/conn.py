"""Sockets of a ring: listener, dialing, handshake reads, liveness probes, addresses."""

from __future__ import annotations

import contextlib
import select
import socket
import struct

from fthsdp.services.common.parse import host_port
from fthsdp.worker.ftar import auth, wire
from fthsdp.worker.ftar.errors import FatalFtarError, FtarPeerError

__all__ = [
    "close_quietly",
    "dial",
    "is_alive",
    "listen",
    "parse_address",
    "read_hello",
    "shutdown_quietly",
    "tune",
]


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) -> (host, port); FatalFtarError if malformed."""
    try:
        return host_port(address)
    except ValueError:
        raise FatalFtarError(f"bad FTAR address {address!r}: want host:port") from None


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY, and fixed buffers when asked (set before connect/listen for the window)."""
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(host: str, port: int, buffer_bytes: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune(sock, buffer_bytes)
        sock.bind(addr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def dial(address: str, timeout: float, buffer_bytes: int) -> socket.socket:
    host, port = parse_address(address)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        tune(sock, buffer_bytes)
        sock.settimeout(timeout)
        sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def read_hello(
    sock: socket.socket, max_ring_size: int, key: bytes, challenge: bytes
) -> tuple[wire.Hello, bytes]:
    """Read (under the socket's timeout) and validate a HELLO, bounded sizes before any
    allocation, and check its proof against `challenge`; returns it with the connector's nonce
    (the ACK's proof covers it)."""
    head = bytearray(wire.HELLO_PREFIX_SIZE)
    wire.recv_exact(sock, memoryview(head))
    epoch, position, size, alen = wire.Hello.decode_prefix(bytes(head), max_ring_size)
    rest = bytearray(alen + auth.NONCE_BYTES + auth.MAC_BYTES)
    wire.recv_exact(sock, memoryview(rest))
    raw = bytes(rest[:alen])
    nonce = bytes(rest[alen : alen + auth.NONCE_BYTES])
    proof = auth.hello_proof(key, challenge, bytes(head) + raw, nonce)
    auth.check_proof(proof, bytes(rest[alen + auth.NONCE_BYTES :]), "HELLO")
    try:
        address = raw.decode()
    except UnicodeDecodeError:
        raise FtarPeerError("HELLO address is not UTF-8") from None
    return wire.Hello(epoch, position, size, address), nonce


_RDHUP = getattr(select, "POLLRDHUP", 0)
"""Linux's "peer shut its sending side down" poll event (elsewhere, `is_alive` peeks instead)."""


def is_alive(sock: socket.socket) -> bool:
    """False once the peer closed, shut down or reset the connection (non-blocking probe).

    Buffered bytes alone count as alive (a faster neighbour may already have started the next
    exchange on this connection), but not behind the peer's FIN: a receiver's READY for an
    exchange its sender never began sits unread on the sender's socket after the receiver
    dropped the connection, and a probe that only peeked would keep that connection for a
    new epoch (the receiver, awaiting a fresh one, would then wait out its connect timeout).
    """
    if _RDHUP:
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN | _RDHUP)
            events = poller.poll(0)
        except (OSError, ValueError):  # closed here: fileno() is -1
            return False
        return not any(
            ev & (_RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events
        )
    try:
        # MSG_DONTWAIT: non-blocking for this call only; the fd's mode is never toggled, so a
        # thread blocked on the socket meanwhile is unaffected.
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def set_kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking send/recv on a data socket (SO_SNDTIMEO/SO_RCVTIMEO).

    Data sockets stay in blocking mode so a whole chunk moves in one system call; Python's own
    socket timeout would poll before every call instead.
    """
    seconds = max(seconds, 0.001)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def shutdown_quietly(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock`` (close() alone does not on Linux)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def close_quietly(sock: socket.socket) -> None:
    shutdown_quietly(sock)
    with contextlib.suppress(OSError):
        sock.close()
