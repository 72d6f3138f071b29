"""Response bodies without a Python copy: an ASGI extension on uvicorn's httptools protocol.

ASGI has no way to hand a file or a mapping to the server, and uvicorn does not implement the draft
`http.response.zerocopysend` extension, so snapshot bytes would go through Python: a slice of the
mapping per piece, copied into the transport's buffer when the socket is full, then into the
kernel. This protocol adds the extension `fthsdp.zerocopy` to each request's scope. A response that
started with a content-length may then send part of its body with

- `sendfile(file, offset, count)`: os.sendfile; the kernel queues references to the file's pages
  (no copy on this side at all), or
- `write(data)`: os.write of a view of a mapping; the kernel copies straight from it.

Both run on a thread of a small pool, the socket in its usual non-blocking mode, waiting with
poll() when it is full: one system call per socket-buffer's worth instead of a trip through the
event loop each time (reading the connection is paused meanwhile, as asyncio's own
`loop.sendfile` does). A client that reads nothing for `STALL_S` is cut off. The count is taken off
what the response still owes, so its final empty body completes it.

Which of the two: `sendfile` leaves the source's CPU alone (what a healthy replica serving a peer
on another host wants); on loopback, though, the receiver then copies from pages no cache has
seen, and on the 2-core dev box it measured costlier in total than the copy `write` makes (see
`bench.checkpoint`). The sidecar's `send_with` chooses (default "write").

`sendfile` queues references to pages: the client may read them after the call returns, so
`hold(release)` keeps a caller's hold on the bytes until the client provably read the response
(its next request on the connection begins) or the connection is gone.

Only plain TCP: over TLS (or while the response's head is still queued) both raise
`asyncio.SendfileNotAvailableError` before sending anything, and the caller streams instead."""

from __future__ import annotations

import asyncio
import logging
import os
import select
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from fthsdp.services.common.http_limits import BoundedHttpToolsProtocol

log = logging.getLogger(__name__)

EXTENSION = "fthsdp.zerocopy"
STALL_S = 30.0
"""A client that accepts no byte for this long is cut off (its response thread freed)."""
WRITE_BYTES = 4 << 20
"""Largest single os.write: bounds one call's time under the GIL-free copy."""
_POOL = ThreadPoolExecutor(16, thread_name_prefix="fthsdp-zerocopy")
"""Responses sending at once; more wait their turn (each thread serves one response)."""


def _send_all(sock_fd: int, send: Callable[[int, int], int], count: int) -> int:
    """Calls send(fd, sent_so_far) until `count` bytes went out; polls while the socket is full."""
    fd = os.dup(sock_fd)  # the connection's fd may be closed by the loop meanwhile: not this one
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        sent = 0
        while sent < count:
            try:
                n = send(fd, sent)
            except BlockingIOError:
                if not poller.poll(STALL_S * 1000):
                    raise TimeoutError(f"the client read nothing for {STALL_S:.0f} s") from None
                continue
            if n == 0:
                break  # the file ended early
            sent += n
        return sent
    finally:
        os.close(fd)


def _sendfile(sock_fd: int, file_fd: int, offset: int, count: int) -> int:
    src = os.dup(file_fd)  # the registry may close its descriptor once the snapshot retires
    try:
        return _send_all(
            sock_fd, lambda fd, done: os.sendfile(fd, src, offset + done, count - done), count
        )
    finally:
        os.close(src)


def _write(sock_fd: int, data: memoryview) -> int:
    def send(fd: int, done: int) -> int:
        return os.write(fd, data[done : done + WRITE_BYTES])

    return _send_all(sock_fd, send, len(data))


class ZeroCopy:
    """The extension object of one request."""

    def __init__(self, protocol: ZeroCopyHttpToolsProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol = protocol
        self._cycle = cycle

    async def sendfile(self, file: BinaryIO, offset: int, count: int) -> None:
        """Sends `count` bytes of `file` from `offset` as part of the response body."""
        fileno = file.fileno()
        await self._run(count, lambda sock: _sendfile(sock, fileno, offset, count))

    async def write(self, data: memoryview) -> None:
        """Sends `data` (a view of memory that stays unchanged meanwhile) as part of the body."""
        await self._run(len(data), lambda sock: _write(sock, data))

    async def _run(self, count: int, send: Callable[[int], int]) -> None:
        """Runs `send(socket fd)` on the pool.

        Raises asyncio.SendfileNotAvailableError (nothing sent) where it cannot. A connection
        that fails midway is closed, and the response's later sends are ignored, as for any
        client that left."""
        cycle, transport = self._cycle, self._protocol.transport
        if not cycle.response_started or cycle.chunked_encoding:
            raise RuntimeError("zero-copy sends need a started response with a content-length")
        if not 0 < count <= cycle.expected_content_length:
            raise RuntimeError(f"{count} bytes exceed what the response declared")
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("sslcontext") is not None:
            raise asyncio.SendfileNotAvailableError("not a plain TCP connection")
        if transport.get_write_buffer_size():
            raise asyncio.SendfileNotAvailableError("the response's head is still queued")
        reading = transport.is_reading()
        transport.pause_reading()
        try:
            loop = asyncio.get_running_loop()
            sent = await loop.run_in_executor(_POOL, send, sock.fileno())
        except (OSError, TimeoutError) as exc:
            log.info("a client left during a zero-copy response: %s", exc)
            sent = -1
        finally:
            if reading and not transport.is_closing():
                transport.resume_reading()
        if sent != count:  # the client left, or the file is shorter than the range
            cycle.disconnected = True
            transport.abort()
            return
        cycle.expected_content_length -= count

    def hold(self, release: Callable[[], None]) -> None:
        """Calls `release` once the client has read this response, or the connection is gone."""
        self._protocol.hold(release)


class ZeroCopyHttpToolsProtocol(BoundedHttpToolsProtocol):
    """The sidecar's HTTP protocol: the bounded httptools one, plus `fthsdp.zerocopy`."""

    _held: list[Callable[[], None]] | None = None
    _lost = False

    def on_message_begin(self) -> None:
        # A client sends its next request only after reading the last response: HTTP/1.1
        # without pipelining, as the fetcher and every client here do. A pipelining client only
        # risks checksum failures of its own.
        self._release_held()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            scope = cast(dict[str, Any], self.scope)  # ASGI types extensions as dict[object, ...]
            scope.setdefault("extensions", {})[EXTENSION] = ZeroCopy(self, cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        try:
            super().connection_lost(exc)
        finally:
            self._release_held()

    def hold(self, release: Callable[[], None]) -> None:
        if self._lost:
            release()
            return
        if self._held is None:
            self._held = []
        self._held.append(release)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for release in held or ():
            try:
                release()
            except Exception:  # a release must not break the connection's other requests
                log.exception("releasing a response's hold failed")
