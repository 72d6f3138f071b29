"""A TCP proxy for fault injection: forwards 127.0.0.1:<port> to a target, and can blackhole
(keep connections open but stop moving bytes, as a network partition does) or cut every
connection. Runs its own thread; works with blocking and asyncio clients alike."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class TcpProxy:
    """`start()` binds a free port; `blackhole()` / `heal()` / `cut()`; `stop()`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._blackholed = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)

    def start(self) -> TcpProxy:
        """Starts forwarding."""
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def blackhole(self) -> None:
        """Stops forwarding bytes (both ways) and accepting new connections' data."""
        self._blackholed.set()

    def heal(self) -> None:
        """Forwards again."""
        self._blackholed.clear()

    def cut(self) -> None:
        """Closes every open connection (new ones are still accepted)."""
        with self._lock:
            sockets = list(self._peers)
        for sock in sockets:
            self._close(sock)

    def stop(self) -> None:
        """Stops the proxy and closes everything (idempotent)."""
        self._stopped.set()
        self._thread.join(timeout=5)
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                elif not self._blackholed.is_set():
                    self._forward(sock)
            if self._blackholed.is_set():
                self._stopped.wait(0.01)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
            upstream = socket.create_connection(self._target, timeout=2)
        except OSError:
            return
        for sock in (client, upstream):
            sock.setblocking(False)
        with self._lock:
            self._peers[client] = upstream
            self._peers[upstream] = client
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(upstream, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            peer = self._peers.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(65536)
            if data:
                peer.setblocking(True)
                peer.sendall(data)
                peer.setblocking(False)
                return
        except OSError:
            pass
        self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            peer = self._peers.pop(sock, None)
            if peer is not None:
                self._peers.pop(peer, None)
        for each in (sock, peer):
            if each is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(each)
            with contextlib.suppress(OSError):
                each.close()
