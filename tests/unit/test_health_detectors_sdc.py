"""SDC: the minority fingerprint is named; fewer than 3 replicas or no majority names nobody."""

from __future__ import annotations

from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.sdc import SdcDetector
from fthsdp.services.health.telemetry import Fingerprint


def _fp(replica: str, step: int, digest: str, quorum_id: int = 0) -> Fingerprint:
    return Fingerprint(replica_id=replica, step=step, digest=digest, quorum_id=quorum_id)


def test_the_odd_one_out_is_named_once_until_it_heals() -> None:
    det = SdcDetector(DetectorConfig())
    for r, d in (("a", "x"), ("b", "x"), ("c", "y")):
        det.add(_fp(r, 1, d))
    found = det.check(1.0)
    assert [(i.replica_id, i.evidence["majority_digest"]) for i in found] == [("c", "x")]
    for r, d in (("a", "z"), ("b", "z"), ("c", "bad")):
        det.add(_fp(r, 2, d))
    assert det.check(2.0) == []  # still the same corruption
    for r in "abc":
        det.add(_fp(r, 3, "w"))
    assert det.check(3.0) == [] and not det.suspect("c")
    for r, d in (("a", "v"), ("b", "q"), ("c", "v")):
        det.add(_fp(r, 4, d))
    assert [i.replica_id for i in det.check(4.0)] == ["b"]


def test_two_replicas_or_a_tie_name_nobody() -> None:
    det = SdcDetector(DetectorConfig())
    det.add(_fp("a", 1, "x"))
    det.add(_fp("b", 1, "y"))
    assert det.check(1.0) == []
    det.add(_fp("c", 2, "x"))
    det.add(_fp("d", 2, "x"))
    det.add(_fp("e", 2, "y"))
    det.add(_fp("f", 2, "y"))
    assert det.check(2.0) == []


def test_a_step_waits_for_the_third_replica() -> None:
    det = SdcDetector(DetectorConfig())
    det.add(_fp("a", 1, "x"))
    det.add(_fp("b", 1, "y"))
    assert det.check(1.0) == []
    det.add(_fp("c", 1, "x"))
    assert [i.replica_id for i in det.check(2.0)] == ["b"]


def test_a_step_trained_again_after_a_rollback_is_judged_within_its_quorum() -> None:
    """The job rolled back to a durable checkpoint: step 120 is trained again in quorum 6 with
    other digests than in quorum 5. The first replica back must not be judged against the old
    timeline (a false SDC verdict tore a healthy replica down); a real outlier in the new
    quorum still is."""
    det = SdcDetector(DetectorConfig())
    for replica in ("a", "b", "c"):
        det.add(_fp(replica, 120, "old", quorum_id=5))
    assert det.check(1.0) == []
    det.add(_fp("c", 120, "new", quorum_id=6))  # a and b still hold quorum 5's digests
    assert det.check(2.0) == []
    det.add(_fp("a", 120, "new", quorum_id=6))
    det.add(_fp("b", 120, "bad", quorum_id=6))
    (incident,) = det.check(3.0)
    assert incident.replica_id == "b"
