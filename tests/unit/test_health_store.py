"""The in-memory telemetry store's bounds and filters, and the wire codec's checks and clock
rebasing."""

from __future__ import annotations

import json
import math

import pytest

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.health.client_codec import (
    batch_from_pb,
    batch_to_pb,
    incident_from_json,
    incident_to_json,
    restamp,
)
from fthsdp.services.health.domain import InvalidReportError
from fthsdp.services.health.store import InMemoryTelemetryStore
from fthsdp.services.health.telemetry import Incident, IncidentKind, RankId, StepRecord


def _incident(n: int, kind: IncidentKind = IncidentKind.HANG) -> Incident:
    return Incident(
        kind=kind, replica_id=f"r{n}", rank=0, detected_at=1000.0 + n, summary=f"incident {n}"
    )


def _step(n: int) -> StepRecord:
    rank = RankId(replica_id="r0", rank=0)
    return StepRecord(rank=rank, step=n, started_at=1.0, duration_s=0.1, tokens=1, sum_seq_len_sq=1)


async def test_incidents_are_bounded_newest_first_and_filtered() -> None:
    store = InMemoryTelemetryStore(max_incidents=5, max_records=3)
    await store.add_incidents([_incident(n) for n in range(8)])
    await store.add_incidents([_incident(8, IncidentKind.SDC)])
    newest = await store.incidents(limit=100)
    assert [i.replica_id for i in newest] == ["r8", "r7", "r6", "r5", "r4"]
    assert [i.replica_id for i in await store.incidents(limit=2)] == ["r8", "r7"]
    assert [i.replica_id for i in await store.incidents(since=1006.0)] == ["r8", "r7", "r6"]
    assert [i.replica_id for i in await store.incidents(kind=IncidentKind.SDC)] == ["r8"]
    await store.add_records("steps", [_step(n) for n in range(10)])
    assert [r["step"] for r in await store.records("steps", 100)] == [9, 8, 7]
    assert await store.records("collectives") == []


def test_store_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        InMemoryTelemetryStore(max_incidents=0)


def test_batches_are_rebased_onto_the_receivers_clock() -> None:
    msg = pb.ReportRequest(source="r0/0", host="h", sent_at=100.0)
    msg.heartbeats.add(rank=pb.RankRef(replica_id="r0", rank=0), step=4, at=99.5)
    msg.steps.add(rank=pb.RankRef(replica_id="r0", rank=0), step=4, started_at=99.0, duration_s=0.5)
    batch = batch_from_pb(msg, now=5000.0)
    assert batch.heartbeats[0].at == pytest.approx(4999.5)
    assert batch.heartbeats[0].host == "h"
    assert batch.steps[0].started_at == pytest.approx(4999.0)
    again = batch_from_pb(batch_to_pb(batch, sent_at=5000.0), now=5000.0)
    assert again == batch


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.heartbeats.add(rank=pb.RankRef(replica_id="r0", rank=0), at=math.inf),
        lambda m: m.heartbeats.add(rank=pb.RankRef(replica_id="x" * 129, rank=0), at=1.0),
        lambda m: m.collectives.add(
            rank=pb.RankRef(replica_id="r0"), group="g", started_at=5.0, ended_at=4.0
        ),
        lambda m: m.collectives.add(rank=pb.RankRef(replica_id="r0"), group="", started_at=5.0),
        lambda m: m.fingerprints.add(replica_id="r0", step=-1, digest="d"),
        lambda m: m.incidents.add(kind="sdc", replica_id="r0", evidence_json="x" * 20000),
        lambda m: m.incidents.add(kind="sdc", replica_id="r0", evidence_json='{"a": NaN}'),
        lambda m: setattr(m, "source", "s" * 300),
        lambda m: m.node.ranks.add(rank=pb.RankRef(replica_id="r0"), silent_s=-1.0),
    ],
)
def test_bad_fields_are_refused(mutate: object) -> None:
    msg = pb.ReportRequest()
    mutate(msg)  # type: ignore[operator]
    if msg.HasField("node"):
        msg.node.node = "n"
    with pytest.raises(InvalidReportError):
        batch_from_pb(msg, now=1.0)


def test_incidents_round_trip_through_json_with_finite_evidence() -> None:
    incident = restamp(_incident(1), evidence={"residual": math.inf, "nested": {"x": [1, 2]}})
    data = incident_to_json(incident)
    json.dumps(data, allow_nan=False)  # strict JSON
    back = incident_from_json(data)
    assert back.evidence == {"residual": "inf", "nested": {"x": [1, 2]}}
    assert (back.kind, back.replica_id, back.detected_at) == (
        incident.kind,
        incident.replica_id,
        incident.detected_at,
    )
    with pytest.raises(InvalidReportError):
        incident_from_json({"kind": "nope"})
