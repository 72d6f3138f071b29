"""A minimal HTTP/1.1 client on `http.client`, shared by the publisher, fetcher and control calls.

Why not httpx: the fetcher reads response bodies with `HTTPResponse.readinto` straight into the
destination tensors' memory (one kernel→tensor copy, no intermediate bytes objects), which httpx
cannot do; and the training process then carries no extra HTTP stack. Callers never see HTTP types:
non-2xx answers become the typed errors of `client_errors`, transport failures `OSError`."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit

from fthsdp.services.checkpoint.client_errors import (
    ERROR_WIRE,
    CheckpointError,
    InvalidArgumentError,
    NotReadyError,
)
from fthsdp.services.common.backoff import Backoff, sleep_before_retry
from fthsdp.services.common.tokens import Token

MAX_ERROR_BODY = 64 * 1024
MAX_JSON_BODY = 64 * 1024 * 1024
DEFAULT_BACKOFF = Backoff()


@dataclass(frozen=True, slots=True)
class BaseUrl:
    """A parsed `http(s)://host:port[/prefix]` base URL."""

    scheme: str
    host: str
    port: int
    prefix: str

    @staticmethod
    def parse(url: str) -> BaseUrl:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgumentError(f"not an http(s) base URL: {url!r}")
        default = 443 if parts.scheme == "https" else 80
        return BaseUrl(parts.scheme, parts.hostname, parts.port or default, parts.path.rstrip("/"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"


class Connection:
    """One keep-alive connection to a base URL; reconnects on the next request after a failure."""

    def __init__(self, base: BaseUrl, token: Token) -> None:
        self.base = base
        self._auth = token.header()
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        """Sends one request and returns the response with its body unread.

        The caller must read the body fully (or call `close()`) before the next request."""
        conn = self._conn
        if conn is None:
            cls = (
                http.client.HTTPSConnection
                if self.base.scheme == "https"
                else http.client.HTTPConnection
            )
            conn = cls(self.base.host, self.base.port, timeout=max(timeout, 0.001))
            self._conn = conn
        elif conn.sock is not None:
            conn.sock.settimeout(max(timeout, 0.001))
        conn.timeout = max(timeout, 0.001)
        all_headers = {"authorization": self._auth, "accept": "application/json"}
        if body is not None:
            all_headers["content-type"] = "application/json"
        all_headers.update(headers or {})
        try:
            conn.request(method, self.base.prefix + path, body=body, headers=all_headers)
            return conn.getresponse()
        except BaseException:
            self.close()
            raise


def error_from_response(resp: http.client.HTTPResponse) -> CheckpointError:
    """The typed error a non-2xx response stands for (its body is read, bounded)."""
    raw = resp.read(MAX_ERROR_BODY)
    code, detail = "", f"HTTP {resp.status}"
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict):
            code = str(parsed.get("error", ""))
            detail = str(parsed.get("detail", detail))
    except ValueError:
        pass
    return cast(CheckpointError, ERROR_WIRE.from_http(resp.status, detail, code))


def read_json(resp: http.client.HTTPResponse) -> Any:
    length = resp.getheader("content-length")
    if length is not None and int(length) > MAX_JSON_BODY:
        raise InvalidArgumentError(f"response of {length} bytes exceeds {MAX_JSON_BODY}")
    return json.loads(resp.read(MAX_JSON_BODY + 1))


def call_json(
    url: str,
    token: Token,
    method: str,
    path: str,
    *,
    timeout: timedelta,
    body: Any = None,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> Any:
    """One JSON request, retried with backoff on transport errors and 503 until `timeout`.

    Raises TimeoutError once the timeout passes, the typed error of any other non-2xx answer."""
    deadline = time.monotonic() + timeout.total_seconds()
    payload = None if body is None else json.dumps(body).encode()
    delays = backoff.delays()
    conn = Connection(BaseUrl.parse(url), token)
    last: BaseException | None = None
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{method} {path} on {url}: no answer within {timeout}: {last}")
            try:
                resp = conn.request(method, path, timeout=remaining, body=payload)
                if 200 <= resp.status < 300:
                    return read_json(resp)
                error = error_from_response(resp)
                if not isinstance(error, NotReadyError):
                    raise error
                last = error
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                conn.close()
            if not sleep_before_retry(delays, deadline):
                raise TimeoutError(f"{method} {path} on {url}: no answer within {timeout}: {last}")
    finally:
        conn.close()
