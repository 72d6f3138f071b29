"""The quorum service's state as tooling sees it (`Status`): membership with liveness, recent
quorums from the store, and the fail-slow planner's decisions."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from fthsdp.services.quorum.core import CoreState, QuorumRecord
from fthsdp.services.quorum.domain import (
    FailSlowDecision,
    MemberStatus,
    QuorumSummary,
    StatusSnapshot,
)


def members_status(
    state: CoreState, now: float, heartbeat_timeout: float
) -> tuple[MemberStatus, ...]:
    """Every registered replica at monotonic `now`, sorted by replica id."""
    return tuple(
        MemberStatus(
            replica_id=reg.replica_id,
            incarnation=reg.incarnation,
            world_size=reg.world_size,
            step=state.last_step.get(reg.replica_id),
            live=state.is_live(reg.replica_id, now, heartbeat_timeout),
            waiting=reg.replica_id in state.waiting,
            last_seen_ago=timedelta(seconds=max(0.0, now - state.seen(reg.replica_id, now))),
            ranks=reg.ranks,
        )
        for reg in sorted(state.registered.values(), key=lambda r: r.replica_id)
    )


def snapshot(
    state: CoreState,
    members: tuple[MemberStatus, ...],
    records: Iterable[QuorumRecord],
    failslow: Iterable[FailSlowDecision],
) -> StatusSnapshot:
    """The whole answer to a Status call."""
    return StatusSnapshot(
        quorum_id=state.last_quorum_id,
        round=state.rounds,
        members=members,
        quorums=tuple(_summary(r) for r in records),
        failslow=tuple(failslow),
    )


def _summary(record: QuorumRecord) -> QuorumSummary:
    return QuorumSummary(
        quorum_id=record.quorum_id,
        round=record.round,
        members=tuple(rid for rid, _ in record.members),
        max_step=record.max_step,
        healthy=record.healthy,
        reason=record.reason,
        formed_at=datetime.fromtimestamp(record.formed_unix, tz=UTC),
    )
