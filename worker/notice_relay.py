"""Membership notices inside a replica: only the leader watches the quorum service, and its ranks
pass each event down a tree (`FANOUT` children per rank) over loopback or the host network.

At 12 replicas x 8,192 ranks, one Watch stream per rank was ~98K long-lived streams on one
service process, and every event cost ~98K writes there (seconds). Now the service writes one
message per replica, and a rank forwards the bytes it got to at most `FANOUT` children before it
acts on them: depth log16(W), a few milliseconds for W = 8,192.

Wire: the parent (acceptor) sends MAGIC and a fresh challenge; the child answers with its own
nonce and HMAC(key, "child" | challenge | nonce); the parent answers HMAC(key, "parent" | nonce).
Both prove they hold the job's key (derived from its bearer token, never sent), so nobody else
can inject an eviction that aborts a ring. Then frames: a 4-byte big-endian length and a
serialized `fthsdp.v1.WatchResponse` (never pickle), at most `MAX_FRAME_BYTES`; length 0 is
GOODBYE, sent by a parent that shuts down cleanly. A parent's connection that ends without it
means the parent process died: its replica is dead (a replica is the unit of failure), which its
children report through `UpstreamLost`."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Iterator

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.domain import MembershipEvent

log = logging.getLogger(__name__)

FANOUT = 16
"""Children per rank: rank r's parent is (r - 1) // FANOUT."""
MAX_FRAME_BYTES = 4 << 20
"""An event names at most the registered replicas (a few dozen KB at thousands of replicas)."""
MAGIC = b"FTNR\x00\x01\x00\x00"
_NONCE = 16
_MAC = hashlib.sha256().digest_size
_LABEL = b"fthsdp-notice-relay-key-v1"
_HANDSHAKE_S = 2.0
_SEND_S = 1.0
"""A child that cannot take a frame for this long is dropped (it reconnects and goes on)."""
_LENGTH = struct.Struct(">I")


class RelayError(Exception):
    """A relay peer broke the protocol or failed the handshake."""


class UpstreamLost(RelayError):
    """The parent's connection ended without GOODBYE: the parent process is gone."""


def relay_key(token: str) -> bytes:
    """The relay key of a job, from its bearer token."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def parent_of(rank: int) -> int | None:
    """The rank whose relay feeds `rank` (None for the leader, which watches the service)."""
    return None if rank == 0 else (rank - 1) // FANOUT


def has_children(rank: int, world_size: int) -> bool:
    """Whether some rank of a replica of `world_size` ranks is fed by `rank`."""
    return rank * FANOUT + 1 < world_size


def relay_for(rank: int, world_size: int, host: str, token: str) -> NoticeRelay | None:
    """The relay `rank` runs for its children, listening on `host`; None for a leaf."""
    return NoticeRelay(host, relay_key(token)) if has_children(rank, world_size) else None


def encode_event(event: MembershipEvent) -> bytes:
    """The frame payload of an event the leader got from the service."""
    return codec.event_to_pb(event).SerializeToString()


class NoticeRelay:
    """One rank's relay: accepts its children (authenticated) and forwards frames to them."""

    def __init__(self, host: str, key: bytes) -> None:
        self._key = key
        self._listener = socket.create_server((host, 0))
        self._lock = threading.Lock()
        self._children: list[socket.socket] = []
        self._hello: bytes | None = None
        """The latest SNAPSHOT frame: a child connecting later gets it first, as a new Watch
        stream would."""
        self._closed = False
        port = self._listener.getsockname()[1]
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(target=self._accept, name="fthsdp-relay", daemon=True)
        self._thread.start()

    @property
    def children(self) -> int:
        """How many children are connected now."""
        with self._lock:
            return len(self._children)

    def forward(self, payload: bytes, *, snapshot: bool = False) -> None:
        """Sends one event to every child; a child that cannot take it is dropped."""
        frame = _LENGTH.pack(len(payload)) + payload
        with self._lock:
            if snapshot:
                self._hello = frame
            children = list(self._children)
        for child in children:
            try:
                child.sendall(frame)
            except OSError as exc:
                log.warning("dropping a relay child that cannot take events: %s", exc)
                self._drop(child)

    def close(self) -> None:
        """Says GOODBYE to every child (their parent did not die) and stops accepting."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        with contextlib.suppress(OSError):  # wakes the accept() in progress (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        _close_quietly(self._listener)
        for child in children:
            with contextlib.suppress(OSError):
                child.sendall(_LENGTH.pack(0))
            _close_quietly(child)
        self._thread.join(timeout=2)

    def _drop(self, child: socket.socket) -> None:
        with self._lock:
            if child in self._children:
                self._children.remove(child)
        _close_quietly(child)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                self._admit(conn)
            except (OSError, RelayError) as exc:
                log.warning("refused a relay connection: %s", exc)
                _close_quietly(conn)

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(_HANDSHAKE_S)
        challenge = secrets.token_bytes(_NONCE)
        conn.sendall(MAGIC + challenge)
        answer = _recv_exact(conn, _NONCE + _MAC)
        nonce, proof = answer[:_NONCE], answer[_NONCE:]
        _check(_mac(self._key, b"child", challenge, nonce), proof, "child")
        conn.sendall(_mac(self._key, b"parent", nonce))
        conn.settimeout(_SEND_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            closed = self._closed
            if not closed:
                self._children.append(conn)
            hello = self._hello
        if closed:  # closed while this child connected: a goodbye, not a death
            conn.sendall(_LENGTH.pack(0))
            _close_quietly(conn)
            return
        if hello is not None:
            try:
                conn.sendall(hello)
            except OSError:
                self._drop(conn)


class Upstream(Iterator[tuple[MembershipEvent, bytes]]):
    """A child's connection to its parent: (event, payload) pairs, the payload to forward on.
    StopIteration after GOODBYE or `cancel()`; `UpstreamLost` when the parent died."""

    def __init__(self, address: str, key: bytes, *, connect_timeout_s: float = 2.0) -> None:
        host, _, port = address.rpartition(":")
        self._cancelled = False
        self._sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        try:
            self._sock.settimeout(_HANDSHAKE_S)
            hello = _recv_exact(self._sock, len(MAGIC) + _NONCE)
            if hello[: len(MAGIC)] != MAGIC:
                raise RelayError(f"{address} is not a notice relay")
            nonce = secrets.token_bytes(_NONCE)
            self._sock.sendall(nonce + _mac(key, b"child", hello[len(MAGIC) :], nonce))
            _check(_mac(key, b"parent", nonce), _recv_exact(self._sock, _MAC), "parent")
            self._sock.settimeout(None)
        except EOFError as exc:  # the parent refused our proof (or is not a relay)
            _close_quietly(self._sock)
            raise RelayError(f"{address} ended the handshake: {exc}") from None
        except BaseException:
            _close_quietly(self._sock)
            raise

    def __iter__(self) -> Upstream:
        return self

    def __next__(self) -> tuple[MembershipEvent, bytes]:
        try:
            (length,) = _LENGTH.unpack(_recv_exact(self._sock, _LENGTH.size))
            if length == 0:
                _close_quietly(self._sock)
                raise StopIteration
            if length > MAX_FRAME_BYTES:
                _close_quietly(self._sock)
                raise RelayError(f"a relay frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            payload = _recv_exact(self._sock, length)
        except (OSError, EOFError) as exc:
            _close_quietly(self._sock)
            if self._cancelled:
                raise StopIteration from None
            raise UpstreamLost(f"the parent's relay connection ended: {exc}") from None
        try:
            event = codec.event_from_pb(pb.WatchResponse.FromString(payload))
        except Exception as exc:  # a malformed message from an authenticated peer
            raise RelayError(f"an unreadable relay frame: {exc}") from None
        return event, payload

    def cancel(self) -> None:
        """Ends the iteration from any thread."""
        self._cancelled = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        _close_quietly(self._sock)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _check(expected: bytes, received: bytes, who: str) -> None:
    if not hmac.compare_digest(expected, received):
        raise RelayError(f"bad {who} proof: the peer does not hold this job's key")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
