"""RedisTelemetryStore against a real redis-server: bounded streams, filters, and incidents that
survive the service's restart (a new store instance) and Redis's own crash."""

from __future__ import annotations

import pytest

from fthsdp.services.health.store import RedisTelemetryStore
from fthsdp.services.health.telemetry import Incident, IncidentKind, RankId, StepRecord
from tests.redis_support import RedisServer


def _incident(n: int, kind: IncidentKind = IncidentKind.FAIL_STOP) -> Incident:
    return Incident(
        kind=kind,
        replica_id=f"r{n}",
        rank=n % 2,
        host="h",
        detected_at=1000.0 + n,
        summary=f"incident {n}",
        evidence={"n": n, "nested": {"ok": True}},
    )


@pytest.mark.redis
async def test_redis_streams_keep_bounded_incidents_across_restarts(
    redis_server: RedisServer,
) -> None:
    store = RedisTelemetryStore(redis_server.url, prefix="t1", max_incidents=100, max_records=50)
    await store.add_incidents([_incident(n) for n in range(300)])
    await store.add_incidents([_incident(300, IncidentKind.SDC)])
    rank = RankId(replica_id="r0", rank=0)
    steps = [
        StepRecord(rank=rank, step=n, started_at=1.0, duration_s=0.1, tokens=1, sum_seq_len_sq=1)
        for n in range(500)
    ]
    await store.add_records("steps", steps)
    assert await store.ping()
    await store.close()
    await store.close()  # idempotent

    redis_server.kill()  # a crash: the append-only file keeps what was written
    redis_server.start()
    again = RedisTelemetryStore(redis_server.url, prefix="t1", max_incidents=100)
    try:
        everything = await again.incidents(limit=1000)
        # MAXLEN ~ trims in whole nodes: never far below, never unbounded.
        assert 100 <= len(everything) < 300
        assert everything[0].replica_id == "r300"
        assert everything[1] == _incident(299)
        assert [i.replica_id for i in await again.incidents(kind=IncidentKind.SDC)] == ["r300"]
        recent = await again.incidents(since=1298.0, limit=10)
        assert [i.replica_id for i in recent] == ["r300", "r299", "r298"]
        kept = await again.records("steps", 1000)
        assert 50 <= len(kept) < 500 and kept[0]["step"] == 499
        other = RedisTelemetryStore(redis_server.url, prefix="t2")
        assert await other.incidents() == []  # prefixes isolate jobs
        await other.close()
    finally:
        await again.close()
