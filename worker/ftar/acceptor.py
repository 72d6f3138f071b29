"""The acceptor of an FtarRing: the listener's accept loop, both halves of the connection
handshake, and the admission of a HELLO (see :mod:`worker.ftar.ring` for the scheme).

Every connection's handshake runs in a thread of its own under one overall deadline: the acceptor
sends a challenge, the connector answers with HELLO, a nonce and its proof of the ring key
(:mod:`worker.ftar.auth`), and the acceptor answers with an ACK and its own proof. A HELLO from a
newer epoch is parked until this rank's ``reconfigure`` reaches that epoch.
"""

from __future__ import annotations

import logging
import socket
import threading

from fthsdp.worker.ftar import auth, conn, wire
from fthsdp.worker.ftar.errors import FtarError
from fthsdp.worker.ftar.ring_state import PeerConn, RingState

__all__ = ["Acceptor"]

log = logging.getLogger(__name__)

_MAX_PARKED = 8
_MAX_HANDSHAKES = 32
"""Handshakes in progress at once; a connection beyond them is closed at once (a legitimate
ring has two neighbours per rank reconnecting, not dozens)."""


class Acceptor(RingState):
    """FtarRing's acceptor thread and handshakes (a mixin over :class:`RingState`)."""

    def _accept_loop(self) -> None:
        """Accepts; each connection's handshake runs in a thread of its own under one overall
        deadline, so a silent or trickling client never holds up the neighbour behind it."""
        handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            self._counters.accepts += 1
            if self._closed:
                conn.close_quietly(sock)
                return
            if not handshakes.acquire(blocking=False):
                log.warning("ftar dropped a connection: too many handshakes", extra=self._ctx())
                conn.close_quietly(sock)
                continue
            threading.Thread(
                target=self._accept_handshake,
                args=(sock, handshakes),
                name=f"ftar-hello-{self.address}",
                daemon=True,
            ).start()

    def _accept_handshake(
        self, sock: socket.socket, handshakes: threading.BoundedSemaphore
    ) -> None:
        # Past the deadline the socket is shut down under the reader, whatever it is waiting on.
        cutoff = threading.Timer(
            self.config.hello_timeout.total_seconds(), conn.shutdown_quietly, (sock,)
        )
        cutoff.start()
        try:
            conn.tune(sock, 0)
            challenge = auth.new_nonce()
            sock.settimeout(self.config.hello_timeout.total_seconds())
            sock.sendall(wire.Challenge(challenge).encode())
            hello, nonce = conn.read_hello(
                sock, self.config.max_ring_size, self.config.auth_key, challenge
            )
        except (OSError, FtarError) as exc:
            log.warning("ftar rejected a connection: %r", exc, extra=self._ctx())
            conn.close_quietly(sock)
            return
        finally:
            cutoff.cancel()
            handshakes.release()
        with self._lock:
            if self._closed:
                conn.close_quietly(sock)
                return
            topo = self._topo
            if topo is None or hello.epoch > topo.epoch:
                self._park_locked(sock, hello, nonce)
            else:
                self._admit_locked(sock, hello, nonce)

    def _park_locked(self, sock: socket.socket, hello: wire.Hello, nonce: bytes) -> None:
        self._parked.append((sock, hello, nonce))
        if len(self._parked) > _MAX_PARKED:
            old, _, _ = self._parked.pop(0)
            conn.close_quietly(old)

    def _admit_locked(self, sock: socket.socket, hello: wire.Hello, nonce: bytes) -> None:
        topo = self._topo
        assert topo is not None
        if hello.epoch < topo.epoch:
            status = wire.AckStatus.STALE_EPOCH
        elif (hello.address, hello.position, hello.size) != (
            topo.left,
            (topo.index - 1) % topo.size,
            topo.size,
        ) or topo.size == 1:
            status = wire.AckStatus.WRONG_PEER
        elif not self._admitting:
            status = wire.AckStatus.EPOCH_FAILED
        else:
            status = wire.AckStatus.OK
        try:
            sock.settimeout(self.config.connect_timeout.total_seconds())
            ack = wire.Ack(status, topo.epoch).encode()
            sock.sendall(ack + auth.ack_proof(self.config.auth_key, nonce, ack))
        except OSError:
            conn.close_quietly(sock)
            return
        if status != wire.AckStatus.OK:
            log.warning(
                "ftar refused %s (epoch %d): %s",
                hello.address,
                hello.epoch,
                status.name,
                extra=self._ctx(),
            )
            conn.close_quietly(sock)
            return
        if self._in is not None:
            conn.shutdown_quietly(self._in.sock)
            self._graveyard.append(self._in.sock)
        sock.settimeout(None)  # blocking; the engine bounds it with kernel timeouts
        self._in = PeerConn(sock, hello.address)
        self._cv.notify_all()

    def _handshake(self, sock: socket.socket, hello: bytes) -> wire.Ack:
        """Connector side: answer the acceptor's challenge with HELLO and our proof, then read
        the ACK and check the acceptor's proof (see `worker.ftar.auth`)."""
        key = self.config.auth_key
        buf = bytearray(wire.CHALLENGE_SIZE)
        wire.recv_exact(sock, memoryview(buf))
        challenge = wire.Challenge.decode(bytes(buf)).nonce
        nonce = auth.new_nonce()
        sock.sendall(hello + nonce + auth.hello_proof(key, challenge, hello, nonce))
        buf = bytearray(wire.ACK_SIZE + auth.MAC_BYTES)
        wire.recv_exact(sock, memoryview(buf))
        raw = bytes(buf[: wire.ACK_SIZE])
        auth.check_proof(auth.ack_proof(key, nonce, raw), bytes(buf[wire.ACK_SIZE :]), "ACK")
        return wire.Ack.decode(raw)
