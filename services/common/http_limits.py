"""uvicorn HTTP protocols with the two bounds a public port needs on a request's head.

- Size: at most `MAX_HEADER_BYTES` of request line and headers. h11 enforces it itself
  (`h11_max_incomplete_event_size`); httptools buffers a header whole before any callback sees
  it, so its protocol here counts the raw bytes fed while the head is incomplete.
- Time: a request's head must be complete within `HEADER_TIMEOUT_S` of the connection opening
  or of the request's first byte; otherwise the connection is closed. Without it a client that
  sends one byte every few seconds (or nothing at all) holds its connection for ever, since
  uvicorn's keep-alive timeout only runs between requests.

Pass the classes as `uvicorn.Config(http=...)`."""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Request line plus headers; a real client sends well under 8 KiB."""
HEADER_TIMEOUT_S = 10.0
"""From connection (or a request's first byte) to its complete head."""


class _HeadDeadline(asyncio.Protocol):
    """The timer half, shared by both protocols: armed while a head is awaited (from the
    connection on, and again at each request's first byte)."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_expired)

    def _disarm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            log.info("closing a connection whose request head did not arrive in time")
            self.transport.close()

    def _awaiting_head(self) -> bool:
        raise NotImplementedError


class BoundedHttpToolsProtocol(_HeadDeadline, HttpToolsProtocol):
    """httptools with a head size bound (431) and the head deadline."""

    _in_head = True
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Counted after feeding: a chunk that completes the head may carry body bytes too.
        if self._in_head and self._head_bytes > MAX_HEADER_BYTES and self.parser is not None:
            self._reject_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm_head_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request's head; its first byte arms the deadline

    def _awaiting_head(self) -> bool:
        return self._in_head

    def _reject_head(self) -> None:
        self._disarm_head_deadline()
        body = b'{"error":"header_too_large","detail":"request head over 65536 bytes"}'
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


class BoundedH11Protocol(_HeadDeadline, H11Protocol):
    """h11 (which bounds the head size itself) with the head deadline."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_head():
            self._arm_head_deadline()
        else:
            self._disarm_head_deadline()

    def _awaiting_head(self) -> bool:
        # IDLE on their side: no complete request head since the last response.
        return self.conn.their_state is h11.IDLE
