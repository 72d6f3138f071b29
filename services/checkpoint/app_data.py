"""The sidecar's data responses: one byte range of a snapshot or durable checkpoint.

A snapshot's range goes out with `sendfile` from its shm file, or `write` from its mapping
(`zerocopy`, config `send_with`): no Python copy, no per-piece framing. Where that is not
available (TLS, another ASGI server, a durable checkpoint served from its mapping) the range is
streamed from the mapping in `stream_bytes` pieces, which bounds the memory per response either
way. The caller's hold on the bytes (a snapshot `Lease`) ends only when the client has read them,
or the connection is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import BinaryIO

from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from fthsdp.services.checkpoint.core import parse_range
from fthsdp.services.checkpoint.zerocopy import EXTENSION, ZeroCopy


def _nothing() -> None:
    pass


class RangeResponse(Response):
    """`[start, stop)` of `data` (or of `source`, the same bytes as a file), 200 or 206."""

    def __init__(
        self,
        data: memoryview,
        *,
        range_header: str | None,
        max_range_bytes: int,
        stream_bytes: int,
        served: Counter,
        zero_copied: Counter,
        source: BinaryIO | None = None,
        send_with: str = "write",
        release: Callable[[], None] = _nothing,
    ) -> None:
        total = len(data)
        self.start, self.stop = parse_range(range_header, total, max_range_bytes)
        self.data, self.source, self.piece = data, source, stream_bytes
        self.served, self.zero_copied = served, zero_copied
        self.release, self.send_with = release, send_with
        headers = {"content-length": str(self.stop - self.start), "accept-ranges": "bytes"}
        status = 200 if range_header is None else 206
        if status == 206:
            headers["content-range"] = f"bytes {self.start}-{self.stop - 1}/{total}"
        super().__init__(None, status, headers, "application/octet-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        zero: ZeroCopy | None = scope.get("extensions", {}).get(EXTENSION)
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            if not await self._send_file(zero):
                await self._stream(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if zero is None:
                self.release()  # streamed: the server copied every piece before this returns
            else:
                zero.hold(self.release)

    async def _send_file(self, zero: ZeroCopy | None) -> bool:
        count = self.stop - self.start
        if zero is None or self.source is None or count == 0:
            return False
        try:
            if self.send_with == "write":
                await zero.write(self.data[self.start : self.stop])
            else:
                await zero.sendfile(self.source, self.start, count)
        except asyncio.SendfileNotAvailableError:
            return False
        self.served.inc(count)
        self.zero_copied.inc(count)
        return True

    async def _stream(self, send: Send) -> None:
        for at in range(self.start, self.stop, self.piece):
            end = min(at + self.piece, self.stop)
            self.served.inc(end - at)
            body = self.data[at:end]
            await send({"type": "http.response.body", "body": body, "more_body": True})
