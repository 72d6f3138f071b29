"""Helpers of the health-service tests: nodes on free ports, raw reports, polling."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import grpc

from fthsdp.protos import health_pb2 as pb
from fthsdp.protos import health_pb2_grpc as pb_grpc
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.health.store import TelemetryStore

NodeFactory = Callable[..., Awaitable[HealthProcess]]


@asynccontextmanager
async def health_nodes(token: str) -> AsyncIterator[NodeFactory]:
    """Starts HealthNodes on free ports (HealthConfig fields as keyword overrides, plus
    `detectors=` and `store=`); stops them all on exit."""
    nodes: list[HealthProcess] = []

    async def make(
        *,
        detectors: DetectorConfig | None = None,
        store: TelemetryStore | None = None,
        **overrides: Any,
    ) -> HealthProcess:
        fields: dict[str, Any] = {
            "port": 0,
            "http_port": 0,
            "node": "testhost",
            "shutdown_grace": timedelta(milliseconds=200),
            **overrides,
        }
        node = HealthProcess(HealthConfig(**fields), token, detectors=detectors, store=store)
        await node.start()
        nodes.append(node)
        return node

    try:
        yield make
    finally:
        for node in reversed(nodes):
            await node.stop()


def rank_ref(replica_id: str, rank: int = 0) -> pb.RankRef:
    return pb.RankRef(replica_id=replica_id, rank=rank)


def heartbeat(replica_id: str, rank: int = 0, step: int = 0) -> pb.HeartbeatRecord:
    return pb.HeartbeatRecord(rank=rank_ref(replica_id, rank), step=step, at=time.time())


def incident(kind: str, replica_id: str, summary: str, **evidence: Any) -> pb.IncidentRecord:
    import json

    return pb.IncidentRecord(
        kind=kind,
        replica_id=replica_id,
        rank=0,
        host="testhost",
        detected_at=time.time(),
        summary=summary,
        evidence_json=json.dumps(evidence),
    )


async def report(address: str, token: str | None, request: pb.ReportRequest) -> pb.ReportResponse:
    """One raw Report call (raises grpc.aio.AioRpcError on a refusal)."""
    request.sent_at = request.sent_at or time.time()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = pb_grpc.HealthServiceStub(channel)
        response: pb.ReportResponse = await stub.Report(request, timeout=5, metadata=metadata)
        return response
