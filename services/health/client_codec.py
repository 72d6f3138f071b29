"""Conversion between `fthsdp.v1` health messages and the domain records, with the boundary
checks: every string, number and count is validated before anything is kept.

Clock rebasing: a batch carries its sender's clock at sending time (`sent_at`); decoding shifts
every time in it by `now - sent_at`, so the receiver holds only times on its own clock (up to the
transit delay) and hosts need not agree on the time."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.common.process_ref import MAX_PID
from fthsdp.services.health.domain import (
    MAX_BATCH_RECORDS,
    MAX_EVIDENCE_BYTES,
    MAX_LINK_BUSY_S,
    MAX_NODE_RANKS,
    MAX_OP_CHARS,
    MAX_PROCESS_CHARS,
    MAX_TEXT_CHARS,
    InvalidReportError,
    check_count,
    check_duration,
    check_id,
    check_rank,
    check_step,
    check_text,
    check_time,
)
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    Heartbeat,
    InboundLink,
    Incident,
    IncidentKind,
    RankId,
    StepRecord,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRank:
    """A rank as its node agent sees it."""

    rank: RankId
    step: int
    silent_s: float
    """Seconds since the agent last heard from it (clock-free: a duration)."""
    process: str = ""
    """Its process as its last heartbeat named it (`Heartbeat.process`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeState:
    """One node's compact state, as its agent reports it."""

    node: str
    ranks: tuple[NodeRank, ...] = ()
    dropped: int = 0
    """Batches the agent dropped on the way to the central service."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportBatch:
    """One validated batch, times already on the receiver's clock."""

    source: str
    host: str
    heartbeats: tuple[Heartbeat, ...] = ()
    steps: tuple[StepRecord, ...] = ()
    collectives: tuple[CollectiveRecord, ...] = ()
    fingerprints: tuple[Fingerprint, ...] = ()
    left: tuple[RankId, ...] = ()
    incidents: tuple[Incident, ...] = ()
    node: NodeState | None = None

    def size(self) -> int:
        """Records in the batch (node state not counted)."""
        return (
            len(self.heartbeats)
            + len(self.steps)
            + len(self.collectives)
            + len(self.fingerprints)
            + len(self.left)
            + len(self.incidents)
        )


# ---- decoding (untrusted input) ---------------------------------------------------------------


def _rank(msg: pb.RankRef) -> RankId:
    return RankId(replica_id=check_id(msg.replica_id), rank=check_rank(msg.rank))


def batch_size(msg: pb.ReportRequest) -> int:
    """Records in a request, counted before any of them is decoded."""
    return (
        len(msg.heartbeats)
        + len(msg.steps)
        + len(msg.collectives)
        + len(msg.fingerprints)
        + len(msg.left)
        + len(msg.incidents)
    )


def batch_from_pb(msg: pb.ReportRequest, now: float) -> ReportBatch:
    """The validated batch with its times rebased onto `now`'s clock.

    Raises InvalidReportError naming the first bad field."""
    count = batch_size(msg)
    if count > MAX_BATCH_RECORDS:
        raise InvalidReportError(f"a batch holds at most {MAX_BATCH_RECORDS} records, got {count}")
    host = check_text(msg.host, "host")
    shift = now - check_time(msg.sent_at, "sent_at") if msg.sent_at else 0.0
    return ReportBatch(
        source=check_text(msg.source, "source"),
        host=host,
        heartbeats=tuple(_heartbeat(h, host, shift) for h in msg.heartbeats),
        steps=tuple(_step(s, shift) for s in msg.steps),
        collectives=tuple(_collective(c, shift) for c in msg.collectives),
        fingerprints=tuple(_fingerprint(f) for f in msg.fingerprints),
        left=tuple(_left(r) for r in msg.left),
        incidents=tuple(_incident(i, shift) for i in msg.incidents),
        node=_node(msg.node) if msg.HasField("node") else None,
    )


def _heartbeat(msg: pb.HeartbeatRecord, host: str, shift: float) -> Heartbeat:
    at = check_time(msg.at, "heartbeat.at")
    return Heartbeat(
        rank=_rank(msg.rank),
        host=host,
        step=check_step(msg.step, minimum=-1),
        at=at + shift,
        process=check_text(msg.process, "heartbeat.process", MAX_PROCESS_CHARS),
        pid=_pid(msg.pid),
        pid_start=check_count(msg.pid_start, "heartbeat.pid_start"),
    )


def _pid(value: int) -> int:
    if not 0 <= value < MAX_PID:
        raise InvalidReportError(f"heartbeat.pid must be in 0..{MAX_PID - 1}")
    return value


def _step(msg: pb.StepRecord, shift: float) -> StepRecord:
    duration = check_duration(msg.duration_s, "step.duration_s")
    if not 0.0 <= msg.exchange_wait_s <= duration:
        raise InvalidReportError("step.exchange_wait_s must be in 0..duration_s")
    return StepRecord(
        rank=_rank(msg.rank),
        step=check_step(msg.step),
        started_at=check_time(msg.started_at, "step.started_at") + shift,
        duration_s=duration,
        tokens=check_count(msg.tokens, "step.tokens"),
        sum_seq_len_sq=check_count(msg.sum_seq_len_sq, "step.sum_seq_len_sq"),
        committed=msg.committed,
        exchange_wait_s=msg.exchange_wait_s,
    )


def _collective(msg: pb.CollectiveRecord, shift: float) -> CollectiveRecord:
    started = check_time(msg.started_at, "collective.started_at")
    ended: float | None = None
    if msg.HasField("ended_at"):
        ended = check_time(msg.ended_at, "collective.ended_at")
        if ended < started:
            raise InvalidReportError("collective.ended_at must not precede started_at")
        ended += shift
    group = check_text(msg.group, "collective.group")
    if not group:
        raise InvalidReportError("collective.group must not be empty")
    return CollectiveRecord(
        rank=_rank(msg.rank),
        group=group,
        seq=check_step(msg.seq, "collective.seq"),
        op=check_text(msg.op, "collective.op", MAX_OP_CHARS),
        started_at=started + shift,
        ended_at=ended,
        inbound=_inbound(msg.inbound) if msg.HasField("inbound") else None,
    )


def _inbound(msg: pb.InboundLink) -> InboundLink:
    if not 0.0 <= msg.busy_s <= MAX_LINK_BUSY_S:  # also false for NaN
        raise InvalidReportError(f"inbound.busy_s must be in 0..{MAX_LINK_BUSY_S:g} seconds")
    return InboundLink(
        sender_replica=check_id(msg.sender_replica, "inbound.sender_replica"),
        bytes=check_count(msg.bytes, "inbound.bytes"),
        busy_s=msg.busy_s,
    )


def _left(msg: pb.RankLeft) -> RankId:
    check_text(msg.reason, "left.reason", MAX_TEXT_CHARS)
    return _rank(msg.rank)


def _fingerprint(msg: pb.FingerprintRecord) -> Fingerprint:
    return Fingerprint(
        replica_id=check_id(msg.replica_id),
        step=check_step(msg.step),
        digest=check_id(msg.digest, "fingerprint.digest"),
        quorum_id=check_count(msg.quorum_id, "fingerprint.quorum_id"),
    )


def _incident(msg: pb.IncidentRecord, shift: float) -> Incident:
    try:
        kind = IncidentKind(msg.kind)
    except ValueError:
        kinds = ", ".join(k.value for k in IncidentKind)
        raise InvalidReportError(f"incident.kind must be one of {kinds}") from None
    return Incident(
        kind=kind,
        replica_id=check_id(msg.replica_id),
        rank=check_rank(msg.rank) if msg.HasField("rank") else None,
        host=check_text(msg.host, "incident.host") if msg.HasField("host") else None,
        detected_at=check_time(msg.detected_at, "incident.detected_at") + shift,
        summary=check_text(msg.summary, "incident.summary", MAX_TEXT_CHARS),
        evidence=decode_evidence(msg.evidence_json),
    )


def decode_evidence(text: str) -> dict[str, Any]:
    """A bounded JSON object (no NaN or infinities)."""
    if not text:
        return {}
    if len(text.encode()) > MAX_EVIDENCE_BYTES:
        raise InvalidReportError(f"incident evidence is limited to {MAX_EVIDENCE_BYTES} bytes")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise InvalidReportError("incident evidence must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidReportError("incident evidence must be a JSON object")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _node(msg: pb.NodeState) -> NodeState:
    node = check_text(msg.node, "node.node")
    if not node:
        raise InvalidReportError("node.node must not be empty")
    if len(msg.ranks) > MAX_NODE_RANKS:
        raise InvalidReportError(f"a node state lists at most {MAX_NODE_RANKS} ranks")
    ranks = tuple(
        NodeRank(
            rank=_rank(r.rank),
            step=check_step(r.step, minimum=-1),
            silent_s=check_duration(r.silent_s, "node.ranks.silent_s"),
            process=check_text(r.process, "node.ranks.process", MAX_PROCESS_CHARS),
        )
        for r in msg.ranks
    )
    return NodeState(node=node, ranks=ranks, dropped=msg.dropped)


# ---- encoding ---------------------------------------------------------------------------------


def _rank_pb(rank: RankId) -> pb.RankRef:
    return pb.RankRef(replica_id=rank.replica_id, rank=rank.rank)


def encode_evidence(evidence: dict[str, Any]) -> str:
    """Evidence as compact JSON, cut to the wire bound (non-finite numbers become strings)."""
    text = json.dumps(_finite(evidence), separators=(",", ":"), default=str)
    if len(text.encode()) > MAX_EVIDENCE_BYTES:
        text = json.dumps({"truncated": True, "keys": sorted(map(str, evidence))[:100]})
    return text


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def incident_to_pb(incident: Incident) -> pb.IncidentRecord:
    msg = pb.IncidentRecord(
        kind=incident.kind.value,
        replica_id=incident.replica_id,
        detected_at=incident.detected_at,
        summary=incident.summary[:MAX_TEXT_CHARS],
        evidence_json=encode_evidence(incident.evidence),
    )
    if incident.rank is not None:
        msg.rank = incident.rank
    if incident.host is not None:
        msg.host = incident.host
    return msg


def step_to_pb(record: StepRecord) -> pb.StepRecord:
    return pb.StepRecord(
        rank=_rank_pb(record.rank),
        step=record.step,
        started_at=record.started_at,
        duration_s=record.duration_s,
        tokens=record.tokens,
        sum_seq_len_sq=record.sum_seq_len_sq,
        committed=record.committed,
        exchange_wait_s=record.exchange_wait_s,
    )


def collective_to_pb(record: CollectiveRecord) -> pb.CollectiveRecord:
    msg = pb.CollectiveRecord(
        rank=_rank_pb(record.rank),
        group=record.group,
        seq=record.seq,
        op=record.op,
        started_at=record.started_at,
    )
    if record.ended_at is not None:
        msg.ended_at = record.ended_at
    if record.inbound is not None:
        msg.inbound.CopyFrom(
            pb.InboundLink(
                sender_replica=record.inbound.sender_replica,
                bytes=record.inbound.bytes,
                busy_s=record.inbound.busy_s,
            )
        )
    return msg


def fingerprint_to_pb(record: Fingerprint) -> pb.FingerprintRecord:
    return pb.FingerprintRecord(
        replica_id=record.replica_id,
        step=record.step,
        digest=record.digest,
        quorum_id=record.quorum_id,
    )


RankRecord = StepRecord | CollectiveRecord | Fingerprint
"""What a rank queues for the health service besides its heartbeats."""


def add_rank_record(request: pb.ReportRequest, record: RankRecord) -> None:
    """Appends `record` to `request`, checked by the very decoder the service applies to it:
    InvalidReportError (or ValueError, TypeError from protobuf) for a record it would refuse."""
    if isinstance(record, StepRecord):
        step = step_to_pb(record)
        _step(step, 0.0)
        request.steps.append(step)
    elif isinstance(record, CollectiveRecord):
        collective = collective_to_pb(record)
        _collective(collective, 0.0)
        request.collectives.append(collective)
    else:
        fingerprint = fingerprint_to_pb(record)
        _fingerprint(fingerprint)
        request.fingerprints.append(fingerprint)


def node_to_pb(state: NodeState) -> pb.NodeState:
    return pb.NodeState(
        node=state.node,
        dropped=state.dropped,
        ranks=[
            pb.NodeRank(rank=_rank_pb(r.rank), step=r.step, silent_s=r.silent_s, process=r.process)
            for r in state.ranks
        ],
    )


def batch_to_pb(batch: ReportBatch, sent_at: float) -> pb.ReportRequest:
    """The request for a batch whose times are on the clock that `sent_at` reads."""
    msg = pb.ReportRequest(
        source=batch.source,
        host=batch.host,
        sent_at=sent_at,
        heartbeats=[
            pb.HeartbeatRecord(
                rank=_rank_pb(h.rank),
                step=h.step,
                at=h.at,
                process=h.process,
                pid=h.pid,
                pid_start=h.pid_start,
            )
            for h in batch.heartbeats
        ],
        steps=[step_to_pb(s) for s in batch.steps],
        collectives=[collective_to_pb(c) for c in batch.collectives],
        fingerprints=[fingerprint_to_pb(f) for f in batch.fingerprints],
        left=[pb.RankLeft(rank=_rank_pb(r)) for r in batch.left],
        incidents=[incident_to_pb(i) for i in batch.incidents],
    )
    if batch.node is not None:
        msg.node.CopyFrom(node_to_pb(batch.node))
    return msg


def incident_to_json(incident: Incident) -> dict[str, Any]:
    """An incident as the HTTP API and the stores show it."""
    return {
        "kind": incident.kind.value,
        "replica_id": incident.replica_id,
        "rank": incident.rank,
        "host": incident.host,
        "detected_at": incident.detected_at,
        "summary": incident.summary,
        "evidence": _finite(incident.evidence),
    }


def incident_from_json(data: dict[str, Any]) -> Incident:
    """The inverse of `incident_to_json` (for stores; raises InvalidReportError)."""
    try:
        return Incident(
            kind=IncidentKind(data["kind"]),
            replica_id=str(data["replica_id"]),
            rank=None if data.get("rank") is None else int(data["rank"]),
            host=None if data.get("host") is None else str(data["host"]),
            detected_at=float(data["detected_at"]),
            summary=str(data.get("summary", "")),
            evidence=dict(data.get("evidence") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidReportError(f"not an incident record: {exc}") from None


def restamp(incident: Incident, **changes: Any) -> Incident:
    """A copy of an incident with some fields changed (evidence merged)."""
    evidence = {**incident.evidence, **changes.pop("evidence", {})}
    return replace(incident, evidence=evidence, **changes)


def split(records: Sequence[Any], limit: int) -> list[Sequence[Any]]:
    """`records` in chunks of at most `limit`."""
    return [records[i : i + limit] for i in range(0, len(records), limit)] or [records[:0]]
