"""The health service's HTTP wire (FastAPI): the read API, detector settings, the dashboard,
probes and metrics; and `HttpServer`, uvicorn embedded in the service's own event loop.

Auth is the rule of every fthsdp HTTP endpoint (`services/common/http_auth.py`: the probes and
the OpenAPI pages are open, everything else, /metrics included, needs the bearer token), plus the
dashboard shell and its static files (the page reads the token from its URL fragment,
`#token=...`, which browsers never send to the server, and presents it as an Authorization header
on its API calls). /docs and /redoc work offline and declare the token
(`services/common/api_docs.py`); the JSON shapes are `api_models.py`.

Errors: each domain error names its status (`services.common.errors`); every error body is JSON
`{"error": code, "detail": text}`; malformed parameters are 400 `invalid_argument`; anything
unexpected is a 500 without a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.types import ASGIApp

from fthsdp.services.common.api_docs import install_docs
from fthsdp.services.common.http_auth import OPEN_PATHS
from fthsdp.services.common.http_errors import error_response, install_error_handlers
from fthsdp.services.common.http_guard import GuardRules, HttpGuard
from fthsdp.services.common.http_limits import MAX_HEADER_BYTES, BoundedH11Protocol
from fthsdp.services.common.http_listener import bind_listener, http_url
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.api_models import (
    DetectorChanges,
    DetectorSettings,
    Incidents,
    NodeStatus,
    QuorumHistory,
    Records,
    Replicas,
)
from fthsdp.services.health.central import CentralEngine
from fthsdp.services.health.client_codec import incident_to_json
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.domain import (
    MAX_CLOCK_VALUE,
    HealthError,
    HealthUnavailableError,
    InvalidReportError,
    NotFoundError,
)
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.quorum_reporter import QuorumReporter
from fthsdp.services.health.store import RECORD_KINDS, RecordKind
from fthsdp.services.health.telemetry import IncidentKind

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024
_OPEN_PATHS = OPEN_PATHS | {"/", "/dashboard"}


@dataclass(slots=True)
class ApiContext:
    """What the routes work on."""

    token: Token
    metrics: HealthMetrics
    ready: Callable[[], bool]
    engine: CentralEngine | None = None
    agent: NodeAgent | None = None
    quorum: QuorumReporter | None = None


def _guard_rules(context: ApiContext) -> GuardRules:
    metrics = context.metrics

    def count(route: str, status: int, seconds: float) -> None:
        metrics.requests.labels(method=f"http:{route}", code=str(status)).inc()

    return GuardRules(
        token=context.token,
        max_body_bytes=MAX_BODY_BYTES,
        count=count,
        is_open=lambda path: path in _OPEN_PATHS or path.startswith("/static/"),
        on_auth_failure=metrics.auth_failures.inc,
        require_length=True,
    )


def _probe_routes(app: FastAPI, context: ApiContext) -> None:
    @app.get("/livez", tags=["probes"])
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> Response:
        if not context.ready():
            return error_response(503, "not_ready", "starting or draining")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_central_app(context: ApiContext) -> FastAPI:
    """The central service's API and dashboard."""
    assert context.engine is not None
    app = FastAPI(
        title="fthsdp health service",
        version="1",
        description="Replicas, incidents with evidence, quorum history, detector settings.",
        docs_url=None,
        redoc_url=None,
    )
    install_docs(app, open_paths=_OPEN_PATHS)
    install_error_handlers(app, HealthError)
    _probe_routes(app, context)
    _state_routes(app, context.engine)
    _quorum_routes(app, context.quorum)
    _dashboard_routes(app)
    app.add_middleware(HttpGuard, rules=_guard_rules(context))
    return app


def create_agent_app(context: ApiContext) -> FastAPI:
    """A node agent's small API: probes, metrics, and its node's state."""
    agent = context.agent
    assert agent is not None
    app = FastAPI(title="fthsdp health node agent", version="1", docs_url=None, redoc_url=None)
    install_docs(app, open_paths=_OPEN_PATHS)
    install_error_handlers(app, HealthError)
    _probe_routes(app, context)

    @app.get("/v1/node", tags=["agent"], response_model=NodeStatus)
    async def node() -> dict[str, Any]:
        state = agent.node_state()
        return {
            "node": state.node,
            "ranks": [asdict(r) for r in state.ranks],
            "dropped": agent.dropped,
            "forwarded": agent.forwarded,
        }

    app.add_middleware(HttpGuard, rules=_guard_rules(context))
    return app


Since = Annotated[float | None, Query(ge=0, le=MAX_CLOCK_VALUE, description="Unix seconds")]
Limit = Annotated[int, Query(ge=1, le=1000)]


def _state_routes(app: FastAPI, engine: CentralEngine) -> None:
    @app.get("/v1/replicas", tags=["state"], response_model=Replicas)
    async def replicas() -> dict[str, Any]:
        return {
            "now": engine.now(),
            "replicas": [asdict(v) for v in engine.replicas()],
            "nodes": [asdict(n) for n in engine.nodes()],
        }

    @app.get("/v1/incidents", tags=["state"], response_model=Incidents)
    async def incidents(
        since: Since = None, kind: IncidentKind | None = None, limit: Limit = 100
    ) -> dict[str, Any]:
        try:
            found = await engine.store.incidents(since=since, kind=kind, limit=limit)
        except HealthError:
            raise
        except Exception as exc:
            raise HealthUnavailableError(f"the telemetry store failed: {exc}") from None
        return {"incidents": [incident_to_json(i) for i in found]}

    @app.get("/v1/records/{kind}", tags=["state"], response_model=Records)
    async def records(kind: str, limit: Limit = 100) -> dict[str, Any]:
        if kind not in RECORD_KINDS:
            raise NotFoundError(f"no record kind {kind!r}; one of {', '.join(RECORD_KINDS)}")
        record_kind: RecordKind = kind
        return {"records": await engine.store.records(record_kind, limit)}

    @app.get("/v1/detectors", tags=["settings"], response_model=DetectorSettings)
    async def get_detectors() -> dict[str, Any]:
        return engine.detectors.to_dict()

    # The body is described, not parsed, by its model: DetectorConfig.from_dict is the one check
    # (its 400s and their texts are the API's; the model would answer with its own).
    @app.put(
        "/v1/detectors",
        tags=["settings"],
        response_model=DetectorSettings,
        openapi_extra={"requestBody": _json_body(DetectorChanges)},
    )
    async def put_detectors(request: Request) -> dict[str, Any]:
        """Changes detector settings: the body's keys override the current ones."""
        changes = _json_object(await request.body())
        try:
            config = DetectorConfig.from_dict(engine.detectors.to_dict() | changes)
        except (ValueError, TypeError) as exc:
            raise InvalidReportError(str(exc)) from None
        engine.reconfigure(config)
        return config.to_dict()


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise InvalidReportError("the body must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidReportError("the body must be a JSON object")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _quorum_routes(app: FastAPI, quorum: QuorumReporter | None) -> None:
    @app.get("/v1/quorum/history", tags=["quorum"], response_model=QuorumHistory)
    async def quorum_history(limit: Annotated[int, Query(ge=1, le=128)] = 32) -> dict[str, Any]:
        if quorum is None:
            return {
                "configured": False,
                "quorum_id": 0,
                "members": [],
                "quorums": [],
                "failslow": [],
            }
        snapshot = await quorum.status(history_limit=limit)
        return {
            "configured": True,
            "quorum_id": snapshot.quorum_id,
            "members": [
                {
                    "replica_id": m.replica_id,
                    "incarnation": m.incarnation,
                    "step": m.step,
                    "live": m.live,
                    "last_seen_ago_s": m.last_seen_ago.total_seconds(),
                }
                for m in snapshot.members
            ],
            "quorums": [
                {
                    "quorum_id": q.quorum_id,
                    "round": q.round,
                    "members": list(q.members),
                    "healthy": list(q.healthy),
                    "max_step": q.max_step,
                    "reason": q.reason,
                    "formed_at": q.formed_at.timestamp(),
                }
                for q in snapshot.quorums
            ],
            "failslow": [
                {
                    "decided_at": d.decided_at.timestamp(),
                    "step": d.step,
                    "action": d.action,
                    "shares": dict(d.shares),
                    "evicted": list(d.evicted),
                    "reason": d.reason,
                }
                for d in snapshot.failslow
            ],
        }


def _dashboard_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


_PAGE_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
}


# ---- uvicorn, embedded ------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process's `__main__` owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HttpServer:
    """An ASGI app served by uvicorn on the running event loop: `await start()` binds (port 0
    allowed) and returns the base URL; `await stop()` drains for `grace` seconds; idempotent."""

    def __init__(self, app: ASGIApp, host: str, port: int, grace: float) -> None:
        self._sock = bind_listener(host, port, backlog=256)
        self.url = http_url(*self._sock.getsockname()[:2])
        config = uvicorn.Config(
            app,
            log_level="warning",
            # uvicorn's lines go through the process's one handler (services.common.logs)
            # instead of uvicorn's own, so a JSON log stays JSON.
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="none",
            # h11, for its bound on an incomplete request (a 64 MiB header was read in full),
            # plus a deadline on the request head.
            http=BoundedH11Protocol,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            timeout_graceful_shutdown=max(math.ceil(grace), 1),
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                await self._task
                raise OSError("the HTTP server did not start")
            await asyncio.sleep(0.005)
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
