"""The one auth rule of every fthsdp HTTP endpoint (quorum admin, health, checkpoint, a worker's
metrics): the paths in `OPEN_PATHS` are answered without the bearer token, everything else,
/metrics and /v1 included, needs it (Prometheus sends it with `authorization.credentials_file`).
The health service's dashboard shell is the one addition (`services/health/app.py`): a static
page that reads the token from its URL fragment and carries no data itself."""

from __future__ import annotations

DOCS_ASSETS = frozenset(
    {"/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/redoc.standalone.js"}
    | {"/docs/favicon.png"}
)
"""The files the API pages load, served by each FastAPI service itself
(`services/common/api_docs.py`), so that the pages work without a network."""

OPEN_PATHS = (
    frozenset({"/livez", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
    | DOCS_ASSETS
)
"""The probes (an orchestrator's liveness check carries no token) and the API's description
(it describes the API, not the job), with the files its pages load."""

UNAUTHORIZED_BODY = b'{"error":"unauthorized","detail":"missing or wrong bearer token"}'
"""The 401 body, the same JSON error shape as every other error of these services."""
