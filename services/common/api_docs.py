"""The API description pages of every fthsdp FastAPI service (health, checkpoint sidecar),
served without a network, and the bearer token declared in their OpenAPI schema.

FastAPI's own /docs and /redoc load Swagger UI and ReDoc from a CDN, so on an air-gapped cluster
they render blank. `install_docs` serves both pages with the files the `fastapi-offline` wheel
ships (Swagger UI 5, ReDoc 2; pinned in pyproject.toml, only its files are used), at the paths
`http_auth.DOCS_ASSETS` leaves open, and turns off Swagger UI's online validator badge (a
request to a public host on every page load).

The schema declares the auth rule that each service's guard middleware enforces: an HTTP bearer
scheme, required by every operation outside the open paths, so Swagger UI's Authorize button
sends the token on "Try it out". It is derived from the same `OPEN_PATHS` table as the check,
so the two cannot disagree; the check itself stays in the middleware.

The pages carry a Content-Security-Policy of their own (`PAGE_CSP`; the health dashboard's
stricter one covers /dashboard only): FastAPI's Swagger UI page starts with an inline script and
both UIs inject styles, so those are allowed, but nothing may be loaded from or sent to another
host. It stops ReDoc's one fetch from elsewhere (its sidebar's Redocly logo, which it hides when
the image fails) and keeps "Try it out" on this server."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import FileResponse, HTMLResponse

from fthsdp.services.common.http_auth import OPEN_PATHS

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
SECURITY_SCHEME = "bearer"
"""The scheme's name in `components.securitySchemes`."""

ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSETS: dict[str, tuple[str, str]] = {
    "/docs/swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript; charset=utf-8"),
    "/docs/swagger-ui.css": ("swagger-ui.css", "text/css; charset=utf-8"),
    "/docs/redoc.standalone.js": ("redoc.standalone.js", "text/javascript; charset=utf-8"),
    "/docs/favicon.png": ("favicon.png", "image/png"),
}
"""URL path -> (file in ASSET_DIR, content type); the paths are `http_auth.DOCS_ASSETS`."""

PAGE_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {"content-security-policy": PAGE_CSP, "referrer-policy": "no-referrer"}

_METHODS = frozenset({"get", "put", "post", "delete", "patch", "head", "options", "trace"})
_UNAUTHORIZED = {
    "description": "Missing or wrong bearer token",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"error": {"type": "string"}, "detail": {"type": "string"}},
                "required": ["error", "detail"],
            }
        }
    },
}


def install_docs(app: FastAPI, *, open_paths: Collection[str] = OPEN_PATHS) -> None:
    """Serves /docs, /redoc and their files from this process, and declares the bearer token
    on every operation whose path is not in `open_paths` (the app's guard's table).

    Raises ValueError unless `app` was created with `docs_url=None, redoc_url=None` (FastAPI's
    CDN pages would answer first) and with an OpenAPI URL."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("create the app with docs_url=None, redoc_url=None")
    if app.openapi_url is None:
        raise ValueError("the app has no OpenAPI URL to describe")
    for path, (name, media_type) in ASSETS.items():
        app.add_api_route(path, _asset(ASSET_DIR / name, media_type), include_in_schema=False)
    _page_routes(app, app.openapi_url)
    _declare_bearer(app, frozenset(open_paths))


def _asset(file: Path, media_type: str) -> Callable[[], Any]:
    async def asset() -> FileResponse:
        return FileResponse(file, media_type=media_type)

    asset.__name__ = f"docs_{file.stem.replace('-', '_').replace('.', '_')}"  # metrics labels
    return asset


def _page_routes(app: FastAPI, openapi_url: str) -> None:
    def local(request: Request, path: str) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/") + path

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=local(request, openapi_url),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=local(request, "/docs/swagger-ui-bundle.js"),
            swagger_css_url=local(request, "/docs/swagger-ui.css"),
            swagger_favicon_url=local(request, "/docs/favicon.png"),
            oauth2_redirect_url=local(request, OAUTH2_REDIRECT_URL),
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
        )
        page.headers.update(_PAGE_HEADERS)
        return page

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=local(request, openapi_url),
            title=f"{app.title} - ReDoc",
            redoc_js_url=local(request, "/docs/redoc.standalone.js"),
            redoc_favicon_url=local(request, "/docs/favicon.png"),
            with_google_fonts=False,
        )
        page.headers.update(_PAGE_HEADERS)
        return page


def _declare_bearer(app: FastAPI, open_paths: frozenset[str]) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = generate()  # FastAPI's, cached in app.openapi_schema after the first call
        if fresh:
            add_bearer(schema, open_paths)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented extension point


def add_bearer(schema: dict[str, Any], open_paths: Collection[str]) -> None:
    """Adds the bearer scheme to an OpenAPI `schema`, and requires it (with its 401 answer) on
    every operation whose path is not in `open_paths`."""
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[SECURITY_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The job's token (FTHSDP_TOKEN), sent as `Authorization: Bearer <token>`.",
    }
    for path, item in schema.get("paths", {}).items():
        if path in open_paths:
            continue
        for method, operation in item.items():
            if method in _METHODS:
                operation["security"] = [{SECURITY_SCHEME: []}]
                operation.setdefault("responses", {}).setdefault(
                    "401", copy.deepcopy(_UNAUTHORIZED)
                )
