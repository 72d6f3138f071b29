"""The link detector (pure, fake clock): a replica behind a slow network is named by its two ring
links, and only then; one slow direction, a ring of two, jitter, a recovering job and a link
that heals name nobody (or nobody again)."""

from __future__ import annotations

import json

import pytest

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.health.client_codec import add_rank_record
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.links import STALE_S, LinkDetector
from fthsdp.services.health.domain import InvalidReportError
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Heartbeat,
    InboundLink,
    IncidentKind,
    RankId,
)

PIECE = 400_000
"""Bytes a rank receives per exchange."""
FAST_S, SLOW_S = 0.0004, 0.08
"""Seconds a healthy and a slow link take to carry PIECE."""


def _exchange(
    ring: list[str],
    n: int,
    slow: set[tuple[str, str]],
    *,
    ranks: int = 1,
    slow_s: float = SLOW_S,
) -> list[CollectiveRecord]:
    """Exchange n of a ring (replica ids in ring order) at t = n: each rank's exit record, the
    `slow` links taking `slow_s`."""
    records = []
    for i, receiver in enumerate(ring):
        sender = ring[i - 1]
        busy = slow_s if (sender, receiver) in slow else FAST_S
        for rank in range(ranks):
            records.append(
                CollectiveRecord(
                    rank=RankId(replica_id=receiver, rank=rank),
                    group=f"ftar:1:{rank}",
                    seq=n,
                    op="allreduce",
                    started_at=float(n),
                    ended_at=n + 0.5,
                    inbound=InboundLink(sender_replica=sender, bytes=PIECE, busy_s=busy),
                )
            )
    return records


def _run(
    detector: LinkDetector, ring: list[str], steps: range, slow: set[tuple[str, str]]
) -> list[tuple[str, int]]:
    """(culprit, step) of every incident over `steps`."""
    found = []
    for n in steps:
        detector.add(_exchange(ring, n, slow))
        found += [(i.replica_id, n) for i in detector.check(n + 1.0)]
    return found


RING = ["r0", "r1", "r2"]
R1_SLOW = {("r0", "r1"), ("r1", "r2")}


def test_a_replica_whose_links_in_and_out_are_slow_is_named_once_with_its_links() -> None:
    detector = LinkDetector(DetectorConfig())
    assert _run(detector, RING, range(20), set()) == []
    incidents = []
    for n in range(20, 40):
        detector.add(_exchange(RING, n, R1_SLOW))
        incidents += detector.check(n + 1.0)
    (incident,) = incidents
    assert incident.kind is IncidentKind.FAIL_SLOW and incident.replica_id == "r1"
    # Named once the window's median turned: after 3 of the 5 exchanges it looks at.
    assert incident.detected_at == 23.0
    links = incident.evidence["links"]
    assert set(links) == {"r0->r1", "r1->r2"}
    assert links["r0->r1"]["mb_per_s"] == pytest.approx(PIECE / SLOW_S / 1e6)
    assert incident.evidence["others_mb_per_s"] == pytest.approx(PIECE / FAST_S / 1e6)
    assert "r0->r1 at 5.0 MB/s" in incident.summary
    json.dumps(incident.evidence)
    assert detector.suspect("r1") and not detector.suspect("r0")


def test_it_is_named_again_only_after_its_links_healed_in_between() -> None:
    detector = LinkDetector(DetectorConfig())
    found = _run(detector, RING, range(10), R1_SLOW)
    found += _run(detector, RING, range(10, 20), set())
    assert not detector.suspect("r1")
    found += _run(detector, RING, range(20, 30), R1_SLOW)
    assert found == [("r1", 4), ("r1", 22)]


def test_one_slow_direction_names_nobody() -> None:
    """r0 -> r1 slow alone: r0's egress or r1's ingress; the measures cannot tell."""
    detector = LinkDetector(DetectorConfig())
    assert _run(detector, RING, range(30), {("r0", "r1")}) == []


def test_a_ring_of_two_names_nobody() -> None:
    """Both links join the same pair: no link leaves either alone to compare with."""
    detector = LinkDetector(DetectorConfig())
    assert _run(detector, ["a", "b"], range(30), {("a", "b"), ("b", "a")}) == []


def test_jitter_below_the_floor_names_nobody() -> None:
    """Links 8x slower than the others but 3 ms an exchange: a healthy link's jitter."""
    detector = LinkDetector(DetectorConfig(slow_link_min_busy_s=0.005))
    found = []
    for n in range(30):
        detector.add(_exchange(RING, n, R1_SLOW, slow_s=0.003))
        found += detector.check(n + 1.0)
    assert found == []


def test_a_larger_ring_with_many_ranks_names_the_one_slow_host() -> None:
    ring = [f"r{i}" for i in range(6)]
    slow = {("r2", "r3"), ("r3", "r4")}
    detector = LinkDetector(DetectorConfig())
    found = []
    for n in range(15):
        detector.add(_exchange(ring, n, slow, ranks=4))
        found += [i.replica_id for i in detector.check(n + 1.0)]
    assert found == ["r3"]


def test_exchanges_while_the_job_recovers_are_not_judged() -> None:
    detector = LinkDetector(DetectorConfig())
    detector.hold(30.0)
    assert _run(detector, RING, range(30), R1_SLOW) == []
    assert _run(detector, RING, range(30, 40), R1_SLOW) == [("r1", 34)]


def test_a_restarted_replica_and_stale_links_are_forgotten() -> None:
    detector = LinkDetector(DetectorConfig())
    _run(detector, RING, range(10), R1_SLOW)
    detector.forget("r1")
    assert not detector.suspect("r1")
    assert _run(detector, RING, range(10, 12), R1_SLOW) == []  # a fresh window fills first
    # The ring lost r2 a minute ago; r0 and r1 carry on as a ring of two.
    detector.add(_exchange(["r0", "r1"], 12, set()))
    detector.check(12.0 + STALE_S + 5)
    assert _run(detector, ["r0", "r1"], range(80, 90), {("r0", "r1"), ("r1", "r0")}) == []


def test_the_core_names_the_replica_and_shows_it_suspect() -> None:
    core = HealthCore(DetectorConfig())
    kinds = []
    for n in range(20):
        for replica in RING:
            rank = RankId(replica_id=replica, rank=0)
            core.heartbeat(Heartbeat(rank=rank, host="h", step=n, at=float(n), process="p"))
        core.collectives(_exchange(RING, n, R1_SLOW if n >= 10 else set()))
        kinds += [(i.kind, i.replica_id) for i in core.evaluate(n + 1.0)]
    assert kinds == [(IncidentKind.FAIL_SLOW, "r1")]
    states = {v.replica_id: v.state for v in core.replicas()}
    assert states == {"r0": "healthy", "r1": "suspect", "r2": "healthy"}


@pytest.mark.parametrize(
    ("sender", "size", "busy", "refused"),
    [
        ("r0", 10, 0.5, None),
        ("", 10, 0.5, "inbound.sender_replica"),
        ("r 0", 10, 0.5, "inbound.sender_replica"),
        ("r0", -1, 0.5, "inbound.bytes"),
        ("r0", 10, float("nan"), "inbound.busy_s"),
        ("r0", 10, -0.1, "inbound.busy_s"),
        ("r0", 10, 1e9, "inbound.busy_s"),
    ],
)
def test_the_wire_refuses_a_malformed_inbound_link(
    sender: str, size: int, busy: float, refused: str | None
) -> None:
    record = CollectiveRecord(
        rank=RankId(replica_id="r1", rank=0),
        group="ftar:1:0",
        seq=1,
        op="allreduce",
        started_at=10.0,
        ended_at=11.0,
        inbound=InboundLink(sender_replica=sender, bytes=size, busy_s=busy),
    )
    request = pb.ReportRequest()
    if refused is None:
        add_rank_record(request, record)
        assert request.collectives[0].inbound.bytes == size
        return
    with pytest.raises(InvalidReportError, match=refused):
        add_rank_record(request, record)
