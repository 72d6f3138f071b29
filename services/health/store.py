"""Where the central health service keeps incidents and telemetry streams.

`TelemetryStore` is the port; `InMemoryTelemetryStore` (bounded ring buffers, the embedded
default) and `RedisTelemetryStore` (Redis Streams, `XADD ... MAXLEN ~ N`, for a service that must
survive its own restart) are the adapters. Records are stored as JSON, never pickled. Every read
returns newest first and is bounded by `limit`."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Literal, Protocol, cast

import redis.asyncio as aioredis

from fthsdp.services.health.client_codec import incident_from_json, incident_to_json
from fthsdp.services.health.domain import InvalidReportError
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    Incident,
    IncidentKind,
    StepRecord,
)

RecordKind = Literal["steps", "collectives", "fingerprints"]
RECORD_KINDS: tuple[RecordKind, ...] = ("steps", "collectives", "fingerprints")
Record = StepRecord | CollectiveRecord | Fingerprint
_Page = list[tuple[bytes, dict[bytes, bytes]]]
_PAGE = 256  # entries per XREVRANGE page when filtering incidents


def record_to_json(record: Record) -> dict[str, Any]:
    """A telemetry record as plain JSON (the rank nested as {"replica_id", "rank"})."""
    return asdict(record)


def _matches(incident: Incident, since: float | None, kind: IncidentKind | None) -> bool:
    if since is not None and incident.detected_at < since:
        return False
    return kind is None or incident.kind == kind


class TelemetryStore(Protocol):
    """Incidents and recent telemetry of one job."""

    async def add_incidents(self, incidents: Sequence[Incident]) -> None:
        """Appends incidents (the oldest beyond the bound are dropped)."""

    async def incidents(
        self, *, since: float | None = None, kind: IncidentKind | None = None, limit: int = 100
    ) -> list[Incident]:
        """Incidents detected at or after `since` (of `kind`), newest first, at most `limit`."""

    async def add_records(self, kind: RecordKind, records: Sequence[Record]) -> None:
        """Appends telemetry records of one kind (bounded)."""

    async def records(self, kind: RecordKind, limit: int = 100) -> list[dict[str, Any]]:
        """The newest telemetry records of one kind as JSON, newest first."""

    async def close(self) -> None:
        """Releases connections; idempotent."""


class InMemoryTelemetryStore:
    """Ring buffers in this process: the embedded default (lost on restart)."""

    def __init__(self, *, max_incidents: int = 10_000, max_records: int = 100_000) -> None:
        if max_incidents < 1 or max_records < 1:
            raise ValueError("store bounds must be >= 1")
        self._incidents: deque[Incident] = deque(maxlen=max_incidents)
        self._records: dict[RecordKind, deque[Record]] = {
            kind: deque(maxlen=max_records) for kind in RECORD_KINDS
        }

    async def add_incidents(self, incidents: Sequence[Incident]) -> None:
        self._incidents.extend(incidents)

    async def incidents(
        self, *, since: float | None = None, kind: IncidentKind | None = None, limit: int = 100
    ) -> list[Incident]:
        found: list[Incident] = []
        for incident in reversed(self._incidents):
            if len(found) >= limit:
                break
            if _matches(incident, since, kind):
                found.append(incident)
        return found

    async def add_records(self, kind: RecordKind, records: Sequence[Record]) -> None:
        self._records[kind].extend(records)

    async def records(self, kind: RecordKind, limit: int = 100) -> list[dict[str, Any]]:
        buffer = self._records[kind]
        newest = [buffer[-1 - i] for i in range(min(limit, len(buffer)))]
        return [record_to_json(r) for r in newest]

    async def close(self) -> None:
        return None


class RedisTelemetryStore:
    """Redis Streams: `<prefix>:incidents` and `<prefix>:<kind>` trimmed with MAXLEN ~ bound.

    Approximate trimming keeps XADD O(1); a stream may hold slightly more than its bound."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "fthsdp:health",
        max_incidents: int = 10_000,
        max_records: int = 100_000,
        client: aioredis.Redis | None = None,
    ) -> None:
        if max_incidents < 1 or max_records < 1:
            raise ValueError("store bounds must be >= 1")
        self._redis = client or aioredis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self._prefix = prefix
        self._max_incidents = max_incidents
        self._max_records = max_records
        self._closed = False

    def _key(self, name: str) -> str:
        return f"{self._prefix}:{name}"

    async def ping(self) -> bool:
        """Whether Redis answers (readiness)."""
        return bool(await self._redis.ping())

    async def add_incidents(self, incidents: Sequence[Incident]) -> None:
        await self._append(
            "incidents", [incident_to_json(i) for i in incidents], self._max_incidents
        )

    async def incidents(
        self, *, since: float | None = None, kind: IncidentKind | None = None, limit: int = 100
    ) -> list[Incident]:
        found: list[Incident] = []
        upper: bytes | str = "+"
        while len(found) < limit:
            page = await self._xrevrange("incidents", upper, _PAGE)
            for _, fields in page:
                incident = _decode_incident(fields)
                if incident is not None and _matches(incident, since, kind):
                    found.append(incident)
            # Entries are appended in detection order (up to evaluation jitter): a page that
            # reaches far before `since` ends the scan.
            if len(page) < _PAGE or self._older(page[-1][1], since):
                break
            upper = b"(" + page[-1][0]
        return found[:limit]

    @staticmethod
    def _older(fields: dict[bytes, bytes], since: float | None) -> bool:
        incident = _decode_incident(fields)
        return since is not None and incident is not None and incident.detected_at < since - 60

    async def add_records(self, kind: RecordKind, records: Sequence[Record]) -> None:
        await self._append(kind, [record_to_json(r) for r in records], self._max_records)

    async def records(self, kind: RecordKind, limit: int = 100) -> list[dict[str, Any]]:
        page = await self._xrevrange(kind, "+", limit)
        out: list[dict[str, Any]] = []
        for _, fields in page:
            try:
                out.append(json.loads(fields[b"j"]))
            except (KeyError, ValueError):
                continue
        return out

    async def _xrevrange(self, name: str, upper: bytes | str, count: int) -> _Page:
        page = await self._redis.xrevrange(self._key(name), max=upper, count=count)
        return cast(_Page, page or [])

    async def _append(self, name: str, items: list[dict[str, Any]], bound: int) -> None:
        if not items:
            return
        key = self._key(name)
        async with self._redis.pipeline(transaction=False) as pipe:
            for item in items:
                data = json.dumps(item, separators=(",", ":"))
                pipe.xadd(key, {"j": data}, maxlen=bound, approximate=True)
            await pipe.execute()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._redis.aclose()


def _decode_incident(fields: dict[bytes, bytes]) -> Incident | None:
    try:
        return incident_from_json(json.loads(fields[b"j"]))
    except (KeyError, ValueError, InvalidReportError):
        return None  # written by a newer or broken writer: skip, never fail the read
