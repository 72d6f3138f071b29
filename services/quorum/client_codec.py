"""Wire mapping of the quorum service: domain objects <-> `fthsdp.v1` messages (errors travel by
the classes' own codes: `domain.ERROR_WIRE`). One module for both directions, so the
server's encoding and the clients' decoding cannot drift apart (a `client*` module, so the worker
may import it)."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Literal, TypeAlias

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.services.quorum.domain import (
    MAX_MICRO_STEPS,
    EventKind,
    FailSlowDecision,
    InternalError,
    Member,
    MembershipEvent,
    MemberStatus,
    MicroSteps,
    Quorum,
    QuorumSummary,
    RankEndpoint,
    StatusSnapshot,
    StepWork,
    source_rotation,
)

_EVENT_KINDS: dict[pb.EventKind.ValueType, EventKind] = {
    pb.EVENT_KIND_SNAPSHOT: "snapshot",
    pb.EVENT_KIND_JOINED: "joined",
    pb.EVENT_KIND_LEFT: "left",
    pb.EVENT_KIND_EVICTED: "evicted",
    pb.EVENT_KIND_QUORUM: "quorum",
}
_EVENT_CODES: dict[EventKind, pb.EventKind.ValueType] = {v: k for k, v in _EVENT_KINDS.items()}


def ranks_to_pb(ranks: Sequence[RankEndpoint]) -> list[pb.RankEndpoint]:
    """Rank endpoints as messages."""
    return [pb.RankEndpoint(ftar=r.ftar, checkpoint=r.checkpoint) for r in ranks]


def ranks_from_pb(ranks: Sequence[pb.RankEndpoint]) -> tuple[RankEndpoint, ...]:
    """Rank endpoints from messages."""
    return tuple(RankEndpoint(ftar=r.ftar, checkpoint=r.checkpoint) for r in ranks)


# ---- quorum ---------------------------------------------------------------------------------


MembersForm: TypeAlias = pb.MembersForm.ValueType
FULL: MembersForm = pb.MEMBERS_FORM_FULL
SAME: MembersForm = pb.MEMBERS_FORM_SAME

HeldEndpoints: TypeAlias = Mapping[str, tuple[int, tuple[RankEndpoint, ...]]]
"""Endpoints a caller holds: replica id -> (incarnation, per-rank endpoints)."""


def quorum_to_pb(quorum: Quorum, *, form: MembersForm = FULL) -> pb.QuorumResponse:
    """A quorum as sent to every participant of its round, the same bytes for all: FULL lists
    every member, SAME none (the caller's known quorum has this id), only the members below
    max_step (`lagging`). The endpoints each caller needs are appended (`endpoints_to_pb`).

    Sources travel as the index of each rank's first source in `healthy`: every source list
    is a `source_rotation` of `healthy`, so per step the message stays O(replicas + recovering
    ranks), never O(recovering ranks x healthy)."""
    index = {rid: i for i, rid in enumerate(quorum.healthy)} if quorum.sources else {}
    message = pb.QuorumResponse(
        quorum_id=quorum.quorum_id,
        max_step=quorum.max_step,
        members_form=form,
        recovering=[
            pb.RecoveryAssignment(
                replica_id=rid,
                first_source=[index[per_rank[0]] for per_rank in quorum.sources[rid]],
            )
            for rid in sorted(quorum.sources)
        ],
        reason=quorum.reason,
        even_micro_steps=quorum.micro_steps.even,
        uneven=shares_to_pb(quorum.micro_steps),
    )
    if form == SAME:
        message.lagging.extend(
            pb.LaggingMember(replica_id=m.replica_id, step=m.step)
            for m in quorum.members
            if m.step != quorum.max_step
        )
        return message
    message.members.extend(
        pb.QuorumMember(replica_id=m.replica_id, incarnation=m.incarnation, step=m.step)
        for m in quorum.members
    )
    return message


def endpoints_to_pb(member: Member) -> bytes:
    """A member's endpoints as a part of an answer: a `QuorumResponse` holding only them, so
    that answers are concatenations (a message concatenated with another is their merge, and a
    repeated field's entries keep their order)."""
    entry = pb.MemberEndpoints(
        replica_id=member.replica_id,
        incarnation=member.incarnation,
        ranks=ranks_to_pb(member.ranks),
    )
    return pb.QuorumResponse(endpoints=[entry]).SerializeToString()


def quorum_from_pb(msg: pb.QuorumResponse, known: Quorum | None) -> Quorum:
    """The quorum as every participant sees it, endpoints left empty (`with_endpoints` adds
    the caller's); what a SAME answer leaves out comes from `known` (the latest complete quorum
    seen). KeyError when `known` is not the same quorum id for a SAME answer."""
    if msg.members_form == SAME:
        if known is None or known.quorum_id != msg.quorum_id:
            raise KeyError(msg.quorum_id)
        steps = {m.replica_id: m.step for m in msg.lagging}
        if len(steps) != len(msg.lagging) or not all(known.is_member(r) for r in steps):
            raise InternalError("lagging members that are not members of the quorum")
        members = tuple(
            dataclasses.replace(m, step=steps.get(m.replica_id, msg.max_step), ranks=())
            for m in known.members
        )
    else:
        members = tuple(
            Member(replica_id=m.replica_id, incarnation=m.incarnation, step=m.step, ranks=())
            for m in msg.members
        )
    healthy = tuple(m.replica_id for m in members if m.step == msg.max_step)
    rotations: dict[int, tuple[str, ...]] = {}
    sources: dict[str, tuple[tuple[str, ...], ...]] = {}
    for assignment in msg.recovering:
        per_rank = []
        for start in assignment.first_source:
            if start >= len(healthy):
                raise InternalError(f"source index {start} outside {len(healthy)} healthy replicas")
            rotation = rotations.get(start)
            if rotation is None:
                rotation = rotations[start] = source_rotation(healthy, start)
            per_rank.append(rotation)
        sources[assignment.replica_id] = tuple(per_rank)
    return Quorum(
        quorum_id=msg.quorum_id,
        members=members,
        max_step=msg.max_step,
        healthy=healthy,
        sources=MappingProxyType(sources),
        reason=msg.reason,
        micro_steps=shares_from_pb(msg.even_micro_steps, msg.uneven),
    )


def endpoints_from_pb(msg: pb.QuorumResponse) -> dict[str, tuple[int, tuple[RankEndpoint, ...]]]:
    """The endpoints an answer carries for its caller (InternalError for a replica named
    twice)."""
    held = {e.replica_id: (e.incarnation, ranks_from_pb(e.ranks)) for e in msg.endpoints}
    if len(held) != len(msg.endpoints):
        raise InternalError("an answer names a member's endpoints twice")
    return held


def with_endpoints(quorum: Quorum, held: HeldEndpoints) -> Quorum:
    """`quorum` with the endpoints of the members `held` has at their incarnation; the others'
    stay empty. O(members) pointer copies plus O(held log members)."""
    if not held:
        return quorum
    members = list(quorum.members)
    for rid, (incarnation, ranks) in held.items():
        index = bisect.bisect_left(members, rid, key=lambda m: m.replica_id)
        if index < len(members) and members[index].replica_id == rid:
            member = members[index]
            if member.incarnation == incarnation:
                members[index] = dataclasses.replace(member, ranks=ranks)
    return dataclasses.replace(quorum, members=tuple(members))


def shares_to_pb(micro_steps: MicroSteps) -> list[pb.MicroStepShare]:
    """The members whose micro-steps differ from the even share, in replica_id order."""
    uneven = sorted(set(micro_steps.trained) | set(micro_steps.next))
    return [
        pb.MicroStepShare(
            replica_id=rid, trained=micro_steps.trained_by(rid), next=micro_steps.next_for(rid)
        )
        for rid in uneven
    ]


def shares_from_pb(even: int, uneven: Sequence[pb.MicroStepShare]) -> MicroSteps:
    """The inverse of `shares_to_pb` (0 for `even` means 1, as from an older service)."""
    even = even or 1
    if even > MAX_MICRO_STEPS or any(max(s.trained, s.next) > MAX_MICRO_STEPS for s in uneven):
        raise InternalError(f"a micro-step share above {MAX_MICRO_STEPS}")
    trained = {s.replica_id: s.trained for s in uneven if s.trained != even}
    upcoming = {s.replica_id: s.next for s in uneven if s.next != even}
    return MicroSteps(even=even, trained=MappingProxyType(trained), next=MappingProxyType(upcoming))


def work_to_pb(request: pb.QuorumRequest, work: StepWork) -> None:
    """Puts a replica's `StepWork` into its Quorum request."""
    if work.micro_steps is not None:
        request.micro_steps = work.micro_steps
    request.even_micro_steps = work.even
    request.max_micro_steps = work.max_micro_steps
    request.busy_seconds = work.busy_seconds
    request.busy_micro_steps = work.busy_micro_steps


def work_from_pb(request: pb.QuorumRequest) -> StepWork:
    """A Quorum request's `StepWork`; ValueError for values out of range."""
    declared = request.micro_steps if request.HasField("micro_steps") else None
    counts = (
        declared or 0,
        request.even_micro_steps,
        request.max_micro_steps,
        request.busy_micro_steps,
    )
    if max(counts) > MAX_MICRO_STEPS:
        raise ValueError(f"micro-step counts must be at most {MAX_MICRO_STEPS}")
    busy = request.busy_seconds
    if not 0.0 <= busy <= 86_400.0:  # also false for NaN
        raise ValueError("busy_seconds must be in [0, 86400]")
    return StepWork(
        micro_steps=declared,
        even=request.even_micro_steps or 1,
        max_micro_steps=request.max_micro_steps,
        busy_seconds=busy,
        busy_micro_steps=request.busy_micro_steps,
    )


# ---- status and events ----------------------------------------------------------------------


def status_to_pb(snapshot: StatusSnapshot) -> pb.StatusResponse:
    """The service's state as a message."""
    return pb.StatusResponse(
        quorum_id=snapshot.quorum_id,
        round=snapshot.round,
        members=[
            pb.MemberStatus(
                replica_id=m.replica_id,
                incarnation=m.incarnation,
                world_size=m.world_size,
                step=m.step,
                live=m.live,
                waiting=m.waiting,
                last_seen_ms_ago=int(m.last_seen_ago.total_seconds() * 1000),
                ranks=ranks_to_pb(m.ranks),
            )
            for m in snapshot.members
        ],
        history=[
            pb.QuorumSummary(
                quorum_id=h.quorum_id,
                round=h.round,
                members=h.members,
                max_step=h.max_step,
                healthy=h.healthy,
                reason=h.reason,
                formed_unix_ms=int(h.formed_at.timestamp() * 1000),
            )
            for h in snapshot.quorums
        ],
        failslow=[
            pb.FailSlowDecision(
                decided_unix_ms=int(d.decided_at.timestamp() * 1000),
                step=d.step,
                action=d.action,
                uneven=[
                    pb.MicroStepShare(replica_id=rid, next=k) for rid, k in sorted(d.shares.items())
                ],
                evicted=d.evicted,
                reason=d.reason,
            )
            for d in snapshot.failslow
        ],
    )


def status_from_pb(msg: pb.StatusResponse) -> StatusSnapshot:
    """The service's state from a message."""
    return StatusSnapshot(
        quorum_id=msg.quorum_id,
        round=msg.round,
        leader_epoch=msg.leader_epoch,
        members=tuple(
            MemberStatus(
                replica_id=m.replica_id,
                incarnation=m.incarnation,
                world_size=m.world_size,
                step=m.step if m.HasField("step") else None,
                live=m.live,
                waiting=m.waiting,
                last_seen_ago=timedelta(milliseconds=m.last_seen_ms_ago),
                ranks=ranks_from_pb(m.ranks),
            )
            for m in msg.members
        ),
        quorums=tuple(
            QuorumSummary(
                quorum_id=h.quorum_id,
                round=h.round,
                members=tuple(h.members),
                max_step=h.max_step,
                healthy=tuple(h.healthy),
                reason=h.reason,
                formed_at=datetime.fromtimestamp(h.formed_unix_ms / 1000, tz=UTC),
            )
            for h in msg.history
        ),
        failslow=tuple(
            FailSlowDecision(
                decided_at=datetime.fromtimestamp(d.decided_unix_ms / 1000, tz=UTC),
                step=d.step,
                action=_action(d.action),
                shares=MappingProxyType({s.replica_id: s.next for s in d.uneven}),
                evicted=tuple(d.evicted),
                reason=d.reason,
            )
            for d in msg.failslow
        ),
    )


_ACTIONS: dict[str, Literal["keep", "rebalance", "evict"]] = {
    "keep": "keep",
    "rebalance": "rebalance",
    "evict": "evict",
}


def _action(name: str) -> Literal["keep", "rebalance", "evict"]:
    action = _ACTIONS.get(name)
    if action is None:
        raise InternalError(f"unknown fail-slow action {name!r}")
    return action


def event_to_pb(event: MembershipEvent) -> pb.WatchResponse:
    """A membership event as a message."""
    return pb.WatchResponse(
        kind=_EVENT_CODES[event.kind],
        replica_id=event.replica_id or "",
        quorum_id=event.quorum_id,
        reason=event.reason,
        members=event.members,
        teardown=event.teardown,
        incarnation=event.incarnation or 0,
        incarnations=event.incarnations,
    )


def event_from_pb(msg: pb.WatchResponse) -> MembershipEvent:
    """A membership event from a message (InternalError for an unknown kind)."""
    kind = _EVENT_KINDS.get(msg.kind)
    if kind is None:
        raise InternalError(f"unknown event kind {msg.kind}")
    return MembershipEvent(
        kind=kind,
        replica_id=msg.replica_id or None,
        quorum_id=msg.quorum_id,
        reason=msg.reason,
        members=tuple(msg.members),
        teardown=msg.teardown,
        incarnation=msg.incarnation or None,
        incarnations=tuple(msg.incarnations),
    )
