"""The one HTTP front check (`services/common/http_guard.py`) on a small FastAPI app: the token
outside the open paths, the body bound declared and streamed (also through a route that lets the
bound's error escape), the length rule, and one count per request with its route and status."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request

from fthsdp.services.common.http_guard import GuardRules, HttpGuard
from fthsdp.services.common.tokens import Token

LIMIT = 1024
SECRET = "s3cret-token-for-the-guard-tests"


class _Seen:
    def __init__(self) -> None:
        self.counts: list[tuple[str, int]] = []
        self.auth_failures = 0

    def count(self, route: str, status: int, seconds: float) -> None:
        assert seconds >= 0.0
        self.counts.append((route, status))

    def auth_failed(self) -> None:
        self.auth_failures += 1


def _app(seen: _Seen, *, require_length: bool = False) -> FastAPI:
    app = FastAPI()

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/json")
    async def parse_json(body: dict[str, str]) -> dict[str, int]:
        return {"keys": len(body)}

    @app.post("/v1/stream")
    async def stream(request: Request) -> dict[str, int]:
        size = 0
        async for part in request.stream():
            size += len(part)
        return {"bytes": size}

    rules = GuardRules(
        token=Token(SECRET),
        max_body_bytes=LIMIT,
        count=seen.count,
        on_auth_failure=seen.auth_failed,
        require_length=require_length,
    )
    app.add_middleware(HttpGuard, rules=rules)
    return app


def _client(app: FastAPI, *, token: str | None = SECRET) -> httpx.AsyncClient:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://guard", headers=headers
    )


async def _chunks(total: int) -> AsyncIterator[bytes]:
    for _ in range(total // 256):
        yield b"x" * 256


async def test_open_paths_need_no_token_and_the_rest_does() -> None:
    seen = _Seen()
    async with _client(_app(seen), token=None) as http:
        assert (await http.get("/livez")).status_code == 200
        refused = await http.post("/v1/stream", content=b"hi")
    assert refused.status_code == 401
    assert refused.json()["error"] == "unauthorized"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert seen.auth_failures == 1
    assert seen.counts == [("livez", 200), ("unmatched", 401)]


async def test_a_wrong_token_is_refused() -> None:
    seen = _Seen()
    async with _client(_app(seen), token="not-the-token") as http:
        assert (await http.post("/v1/stream", content=b"hi")).status_code == 401
    assert seen.auth_failures == 1


async def test_a_declared_body_over_the_bound_is_refused_before_it_is_read() -> None:
    seen = _Seen()
    async with _client(_app(seen)) as http:
        answer = await http.post("/v1/stream", content=b"x" * (LIMIT + 1))
        within = await http.post("/v1/stream", content=b"x" * LIMIT)
    assert answer.status_code == 413 and answer.json()["error"] == "too_large"
    assert within.json() == {"bytes": LIMIT}
    assert seen.counts == [("unmatched", 413), ("stream", 200)]


@pytest.mark.parametrize("path", ["/v1/stream", "/v1/json"])
async def test_a_streamed_body_over_the_bound_is_413_whatever_the_route_does_with_it(
    path: str,
) -> None:
    """/v1/stream lets the bound's error escape; /v1/json has the framework turn it into a 400."""
    seen = _Seen()
    async with _client(_app(seen)) as http:
        answer = await http.post(path, content=_chunks(4 * LIMIT))
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"] == "too_large"
    assert [status for _, status in seen.counts] == [413]


async def test_a_streamed_body_within_the_bound_passes() -> None:
    seen = _Seen()
    async with _client(_app(seen)) as http:
        answer = await http.post("/v1/stream", content=_chunks(LIMIT))
    assert answer.json() == {"bytes": LIMIT}


async def test_require_length_refuses_a_body_without_one() -> None:
    seen = _Seen()
    async with _client(_app(seen, require_length=True)) as http:
        answer = await http.post("/v1/stream", content=_chunks(256))
        declared = await http.post("/v1/stream", content=b"abc")
    assert answer.status_code == 411 and answer.json()["error"] == "length_required"
    assert declared.json() == {"bytes": 3}
