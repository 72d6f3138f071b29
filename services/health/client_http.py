"""`HealthClient`: a blocking reader of the central health service's HTTP API (for tooling such
as `fthsdp status`). It hides HTTP: callers get plain JSON-shaped dicts and the typed errors of
`domain` (`HealthTimeoutError` is a TimeoutError, `HealthUnavailableError` a
ConnectionError)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import httpx

from fthsdp.services.common.tokens import Token
from fthsdp.services.health.domain import (
    ERROR_WIRE,
    HealthError,
    HealthTimeoutError,
    HealthUnavailableError,
)


class HealthClient:
    """Reads replicas, incidents, quorum history and detector settings."""

    def __init__(
        self, url: str, token: str | Token, *, timeout: timedelta = timedelta(seconds=5)
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        secret = token if isinstance(token, Token) else Token(token)
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"authorization": secret.header()},
            timeout=timeout.total_seconds(),
        )

    def replicas(self) -> dict[str, Any]:
        """{"now", "replicas": [...], "nodes": [...]}."""
        return self._get("/v1/replicas")

    def incidents(
        self, *, since: float | None = None, kind: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Incidents, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if since is not None:
            params["since"] = since
        if kind is not None:
            params["kind"] = kind
        incidents: list[dict[str, Any]] = self._get("/v1/incidents", params)["incidents"]
        return incidents

    def quorum_history(self, limit: int = 32) -> dict[str, Any]:
        """{"configured", "quorum_id", "members", "quorums"} (oldest quorum first)."""
        return self._get("/v1/quorum/history", {"limit": limit})

    def detectors(self) -> dict[str, Any]:
        """The detector settings in force."""
        return self._get("/v1/detectors")

    def set_detectors(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Changes some detector settings; returns all of them."""
        return self._request("PUT", "/v1/detectors", json=changes)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HealthClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._request("GET", path, params=params)

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise HealthTimeoutError(f"{method} {path}: {exc}") from None
        except httpx.HTTPError as exc:
            raise HealthUnavailableError(f"{method} {path}: {exc}") from None
        if response.status_code >= 400:
            raise _error(response)
        body = response.json()
        if not isinstance(body, dict):
            raise HealthError(f"{method} {path}: unexpected response")
        return body


def _error(response: httpx.Response) -> HealthError:
    """The typed error of an error response: by the body's `error` code, else by the status."""
    code, detail = None, response.text[:200]
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        code, detail = str(body.get("error", "")), str(body.get("detail", ""))
    status = response.status_code
    return cast(HealthError, ERROR_WIRE.from_http(status, f"HTTP {status}: {detail}", code))
