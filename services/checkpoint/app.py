"""The sidecar's HTTP wire (FastAPI): routes ↔ domain objects, errors, auth, metrics.

Auth is the rule of every fthsdp HTTP endpoint (`services/common/http_auth.py`): the probes and
the OpenAPI pages are open, everything else (/v1, /metrics) needs the bearer token; the pages
work offline and declare the token (`services/common/api_docs.py`). Bodies are bounded by
Content-Length before they are read; every domain error answers with the status it names
(`services.common.errors`) and a JSON `{"error", "detail"}` body; anything unexpected is a 500
without a traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, BinaryIO

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from fthsdp.services.checkpoint.app_data import RangeResponse
from fthsdp.services.checkpoint.client_errors import (
    CheckpointError,
    NotFoundError,
    NotReadyError,
)
from fthsdp.services.checkpoint.client_manifest import (
    ID_PATTERN,
    MAX_DIMS,
    MAX_TENSORS,
    Manifest,
    TensorEntry,
    check_id,
    check_rank,
)
from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.core import PositionRecord, check_position
from fthsdp.services.checkpoint.durable import DurableStore, DurableWriter
from fthsdp.services.checkpoint.snapshots import SnapshotRegistry
from fthsdp.services.checkpoint.store import PositionStore
from fthsdp.services.common.api_docs import install_docs
from fthsdp.services.common.http_errors import error_response, install_error_handlers
from fthsdp.services.common.http_guard import GuardRules, HttpGuard
from fthsdp.services.common.parse import MAX_STEP
from fthsdp.services.common.tokens import Token

log = logging.getLogger(__name__)


class Metrics:
    """The sidecar's Prometheus metrics, in a registry of its own (one per app instance)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fthsdp_checkpoint_requests_total",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "fthsdp_checkpoint_request_seconds",
            "HTTP request latency by route",
            ["route"],
            registry=r,
        )
        self.served_bytes = Counter(
            "fthsdp_checkpoint_served_bytes_total", "Snapshot and checkpoint bytes sent", registry=r
        )
        self.zero_copy_bytes = Counter(
            "fthsdp_checkpoint_zero_copy_bytes_total",
            "Snapshot bytes sent with sendfile from shared memory (part of served bytes)",
            registry=r,
        )
        self.registered = Counter(
            "fthsdp_checkpoint_snapshots_registered_total", "Snapshots registered", registry=r
        )
        self.checksum_seconds = Histogram(
            "fthsdp_checkpoint_checksum_seconds", "Time to checksum one snapshot", registry=r
        )
        self.durable_writes = Counter(
            "fthsdp_checkpoint_durable_writes_total",
            "Durable rank writes by outcome",
            ["outcome"],
            registry=r,
        )
        self.durable_seconds = Histogram(
            "fthsdp_checkpoint_durable_write_seconds",
            "Time to persist one rank durably",
            registry=r,
        )
        self.positions = Counter(
            "fthsdp_checkpoint_positions_recorded_total", "Data positions recorded", registry=r
        )

    def on_durable(self, outcome: str, seconds: float) -> None:
        self.durable_writes.labels(outcome).inc()
        self.durable_seconds.observe(seconds)


@dataclass(slots=True)
class Services:
    """What the routes work on; owned and closed by `server.CheckpointServer`."""

    config: CheckpointConfig
    token: Token
    registry: SnapshotRegistry
    durable: DurableStore
    writer: DurableWriter
    positions: PositionStore
    metrics: Metrics
    ready: bool = field(default=True)


def _guard_rules(services: Services) -> GuardRules:
    metrics = services.metrics

    def count(route: str, status: int, seconds: float) -> None:
        metrics.requests.labels(route, str(status)).inc()
        metrics.request_seconds.labels(route).observe(seconds)

    return GuardRules(
        token=services.token, max_body_bytes=services.config.max_body_bytes, count=count
    )


Job = Annotated[str, Path(pattern=ID_PATTERN, max_length=64)]
Replica = Annotated[str, Path(pattern=ID_PATTERN, max_length=64)]
Rank = Annotated[int, Path(ge=0, lt=2**20)]
Step = Annotated[int, Path(ge=0, le=MAX_STEP)]


class TensorModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=512)
    dtype: str = Field(max_length=16)
    shape: list[StrictInt] = Field(max_length=MAX_DIMS)
    offset: StrictInt
    nbytes: StrictInt


class RegisterBody(BaseModel):
    """A snapshot registration: a plain file name in the sidecar's shm dir and its layout."""

    model_config = ConfigDict(extra="forbid")
    file: str = Field(max_length=255)
    total_bytes: StrictInt = Field(ge=0)
    tensors: list[TensorModel] = Field(max_length=MAX_TENSORS)
    meta: dict[str, StrictStr | StrictInt] = Field(default_factory=dict, max_length=64)
    reuse: StrictBool = False
    """Hand the file back to the publisher when retention retires it (renamed to
    `<file>.free`, once no response or write still reads it) instead of unlinking it."""


class DurableBody(BaseModel):
    """Persist (job, replica, rank, step), an already-published snapshot, as rank of world_size."""

    model_config = ConfigDict(extra="forbid")
    job: str = Field(pattern=ID_PATTERN, max_length=64)
    replica: str = Field(pattern=ID_PATTERN, max_length=64)
    rank: int = Field(ge=0, lt=2**20)
    step: int = Field(ge=0, le=MAX_STEP)
    world_size: int = Field(ge=1, le=2**20)


class PositionBody(BaseModel):
    """A data position committed with `step` (at most 64 keys)."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, le=MAX_STEP)
    position: dict[str, StrictInt] = Field(max_length=64)


def create_app(services: Services) -> FastAPI:
    """The FastAPI app over `services`."""
    app = FastAPI(
        title="fthsdp checkpoint sidecar",
        version="1",
        description="Serves peer snapshots, writes durable checkpoints, records data positions.",
        docs_url=None,
        redoc_url=None,
    )
    install_docs(app)
    install_error_handlers(app, CheckpointError)
    _health_routes(app, services)
    _snapshot_routes(app, services)
    _checkpoint_routes(app, services)
    _position_routes(app, services)
    app.add_middleware(HttpGuard, rules=_guard_rules(services))
    return app


def _health_routes(app: FastAPI, services: Services) -> None:
    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if not services.ready:
            return error_response(503, "not_ready", "draining")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _checksummed(services: Services, snap_future: Any) -> None:
    try:
        await asyncio.wait_for(
            asyncio.shield(asyncio.wrap_future(snap_future)),
            services.config.checksum_wait.total_seconds(),
        )
    except (TimeoutError, asyncio.CancelledError) as exc:
        raise NotReadyError("checksums are still being computed; retry") from exc


def _data_response(
    services: Services,
    data: memoryview,
    range_header: str | None,
    source: BinaryIO | None = None,
    release: Callable[[], None] | None = None,
) -> Response:
    """A range of `data`; `release` (a lease's) runs once the client has read it, or at once
    if the request is refused."""
    try:
        return RangeResponse(
            data,
            range_header=range_header,
            max_range_bytes=services.config.max_range_bytes,
            stream_bytes=services.config.stream_bytes,
            served=services.metrics.served_bytes,
            zero_copied=services.metrics.zero_copy_bytes,
            source=source,
            send_with=services.config.send_with,
            release=release or (lambda: None),
        )
    except BaseException:
        if release is not None:
            release()
        raise


def _ids(job: str, replica: str | None = None) -> tuple[str, str]:
    """Path ids checked beyond the route pattern (which cannot express "no '..'")."""
    return check_id("job", job), "" if replica is None else check_id("replica", replica)


def _snapshot_routes(app: FastAPI, services: Services) -> None:
    registry = services.registry

    @app.post("/v1/snapshots/{job}/{replica}/{rank}/{step}", status_code=201)
    def register_snapshot(
        job: Job, replica: Replica, rank: Rank, step: Step, body: RegisterBody
    ) -> Response:
        tensors = [
            TensorEntry(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in body.tensors
        ]
        _, created = registry.register(
            job,
            replica,
            rank,
            step,
            file=body.file,
            total_bytes=body.total_bytes,
            tensors=tensors,
            meta=dict(body.meta),
            reuse=body.reuse,
        )
        if created:
            services.metrics.registered.inc()
        answer = {"job": job, "replica": replica, "rank": rank, "step": step, "created": created}
        return JSONResponse(answer, status_code=201 if created else 200)

    @app.delete("/v1/snapshots/{job}/{replica}/{rank}")
    def forget_snapshots(job: Job, replica: Replica, rank: Rank) -> dict[str, int]:
        """A new process of this rank starts its own history: earlier snapshots are dropped."""
        return {"forgotten": registry.forget(*_ids(job, replica), rank)}

    @app.get("/v1/snapshots/{job}/{replica}/{rank}")
    def list_snapshot_steps(job: Job, replica: Replica, rank: Rank) -> dict[str, list[int]]:
        _ids(job, replica)
        return {"steps": registry.steps(job, replica, rank)}

    @app.get("/v1/snapshots/{job}/{replica}/{rank}/{step}/manifest")
    async def snapshot_manifest(
        job: Job, replica: Replica, rank: Rank, step: Step
    ) -> dict[str, Any]:
        snap = registry.get(*_ids(job, replica), rank, step)
        await _checksummed(services, snap.checksums)
        return snap.manifest().to_json()

    @app.get("/v1/snapshots/{job}/{replica}/{rank}/{step}/data")
    async def snapshot_data(
        job: Job, replica: Replica, rank: Rank, step: Step, request: Request
    ) -> Response:
        lease = registry.lease(*_ids(job, replica), rank, step)
        snap = lease.snapshot
        return _data_response(
            services, snap.data, request.headers.get("range"), snap.source, lease.release
        )


def _checkpoint_routes(app: FastAPI, services: Services) -> None:
    durable, writer = services.durable, services.writer

    @app.post("/v1/checkpoints", status_code=202)
    def request_checkpoint(body: DurableBody) -> Response:
        check_rank(body.rank, body.world_size)
        job = check_id("job", body.job)
        lease = services.registry.lease(job, body.replica, body.rank, body.step)
        snap = lease.snapshot

        def manifest() -> Manifest:
            return snap.manifest(world_size=body.world_size)

        key = (body.job, body.step, body.rank)
        status = writer.submit(key, manifest, snap.data, on_done=lease.release)
        return JSONResponse({"state": status.state, "detail": status.detail}, status_code=202)

    @app.get("/v1/checkpoints/{job}/latest")
    def latest_checkpoint(
        job: Job, world_size: Annotated[int | None, Query(ge=1, le=2**20)] = None
    ) -> dict[str, Any]:
        step, why = durable.latest(_ids(job)[0], world_size)
        if step is None:
            raise NotFoundError(f"no restorable checkpoint of {job}: {why}")
        return {"step": step, "reason": why}

    @app.get("/v1/checkpoints/{job}/{step}/{rank}/status")
    def checkpoint_status(job: Job, step: Step, rank: Rank) -> dict[str, str]:
        status = writer.status((_ids(job)[0], step, rank))
        return {"state": status.state, "detail": status.detail}

    @app.get("/v1/checkpoints/{job}/{step}/{rank}/manifest")
    def checkpoint_manifest(job: Job, step: Step, rank: Rank) -> dict[str, Any]:
        return durable.read_manifest(_ids(job)[0], step, rank).to_json()

    @app.get("/v1/checkpoints/{job}/{step}/{rank}/data")
    def checkpoint_data(job: Job, step: Step, rank: Rank, request: Request) -> Response:
        _, data = durable.open_data(_ids(job)[0], step, rank)
        return _data_response(services, data, request.headers.get("range"))


def _position_routes(app: FastAPI, services: Services) -> None:
    positions = services.positions

    @app.put("/v1/positions/{job}/{replica}")
    def put_position(job: Job, replica: Replica, body: PositionBody) -> dict[str, int]:
        record = PositionRecord(body.step, check_position(body.position))
        positions.append(check_id("job", job), check_id("replica", replica), record)
        services.metrics.positions.inc()
        return {"step": body.step}

    @app.get("/v1/positions/{job}/{replica}")
    def get_position(
        job: Job, replica: Replica, at_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None
    ) -> dict[str, Any]:
        record = positions.at(check_id("job", job), check_id("replica", replica), at_step)
        if record is None:
            where = "" if at_step is None else f" at or before step {at_step}"
            raise NotFoundError(f"no data position for {job}/{replica}{where}")
        return {"step": record.step, "position": record.position}
